"""Where a results file came from: the command, the commit of the code, the date, the machine and
its load. The shared keys of every results file the package's commands and the scripts write.

Only the standard library is imported here; torch is imported inside :func:`machine`, so
importing this module stays cheap."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # datc/: its checkout is the one whose commit is read


def git_commit(short: bool = False, cwd: str | Path | None = None) -> str | None:
    """The commit checked out at ``cwd`` (default: the package's own checkout), with ``+dirty``
    when tracked files have changes; abbreviated with ``short``. None outside a git checkout or
    without git."""
    cwd = PACKAGE_DIR if cwd is None else cwd
    try:
        head = subprocess.run(["git", "rev-parse", *(["--short"] if short else []), "HEAD"], capture_output=True,
                              text=True, timeout=5, cwd=cwd).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               timeout=5, cwd=cwd).stdout.strip()
        return (head + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def package_version(name: str) -> str | None:
    """The installed version of the distribution ``name``, or None when it is not installed."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def machine(*packages: str, **extra: Any) -> dict[str, Any]:
    """The Python and torch versions, the CPU count and the processor name, then the installed
    version of each of ``packages`` (None where one is missing) and ``extra`` as given."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"python": platform.python_version(), "torch": torch_version, "cpus": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(), **{p: package_version(p) for p in packages}, **extra}


def processor() -> dict[str, str | None]:
    """The processor's vendor and model name (``/proc/cpuinfo``; None where it is not there): its
    kernels decide the last bits of a sum (docs/real-models.md)."""
    out: dict[str, str | None] = {"cpu_vendor": None, "cpu_model": None}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            for key, field in (("vendor_id", "cpu_vendor"), ("model name", "cpu_model")):
                if line.startswith(key) and out[field] is None:
                    out[field] = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return out


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded to 2 decimals (empty where the system has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def provenance(command: str, *packages: str, **extra: Any) -> dict[str, Any]:
    """The shared keys of a results file: ``command`` as given, the short commit (``+dirty`` when
    tracked files have changes), today's date, the :func:`machine` (with ``packages`` and
    ``extra``) and the load average now."""
    return {"command": command, "commit": git_commit(short=True), "date": datetime.date.today().isoformat(),
            "machine": machine(*packages, **extra), "load_average": load_average()}
