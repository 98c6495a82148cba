"""The wheel kit of the GPU check: the Python packages this project needs beyond what the GPU
machine's image already holds, as wheels in one folder (default ``.whl/``, ignored by git), so a
machine with no network installs them with ``pip install --no-index``.

    python -m scripts.gpu_check.kit                     # CPython 3.12, manylinux x86-64 -> .whl/
    python -m scripts.gpu_check.kit --python-version 3.11 --out .whl311   # a set for a local dry run

Run it with the project's virtual environment (``make gpu-kit``): pure-Python packages are pinned
to the versions that environment resolved, and the one compiled package (pydantic-core) to the
same version, built for the target CPython. DeepSpeed and antlr4-python3-runtime are published
as source only; they are built here into py3-none-any wheels (DeepSpeed with ``DS_BUILD_OPS=0``:
its kernels are compiled on first use, on the machine that runs them).

The image's packages were read from its package list (torch, transformers, accelerate, numpy,
scipy, matplotlib, tqdm, pyyaml, safetensors, tokenizers, psutil, pytest, and also pyarrow,
pandas, xxhash, requests, httpx, fsspec, huggingface-hub, filelock, packaging, ninja, py-cpuinfo,
msgpack and einops). Not in the kit: wandb (the check runs ``logger=none``; its wheel alone is
larger than the rest of the kit together).

The kit plus the repository must stay within what travels to the machine (64 MiB); the script
checks and fails with the sizes if it does not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT_MIB = 64
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# name -> why the GPU machine needs it (everything else the project imports is in its image)
PURE = {
    "hydra-core": "configs (datc.train composes with Hydra)",
    "omegaconf": "Hydra's config objects",
    "datasets": "prompt data (datc.data.prompts)",
    "dill": "datasets",
    "multiprocess": "datasets",
    "fsspec": "datasets (pins fsspec <= the version it was released with)",
    "peft": "LoRA (policy.lora: the paper presets' _lora variants; its own needs are in the image)",
    "hjson": "deepspeed",
    "pydantic": "deepspeed's config",
    "annotated-types": "pydantic",
    "typing-inspection": "pydantic",
    "typing-extensions": "pydantic (needs a recent one)",
}
COMPILED = {"pydantic-core": "pydantic"}
SDIST = {"deepspeed": "ZeRO-2/3 engines", "antlr4-python3-runtime": "omegaconf's interpolation grammar"}


def pinned(name: str) -> str:
    try:
        return f"{name}=={version(name)}"
    except PackageNotFoundError:
        sys.exit(f"scripts.gpu_check.kit: {name} is not installed in this environment ({sys.executable}); run `make venv` first")


def run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"scripts.gpu_check.kit: failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")


def repo_bytes() -> int:
    """Bytes of what travels besides the kit: tracked and untracked, not ignored, files."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return sum((ROOT / p).stat().st_size for p in out.split("\0") if p and (ROOT / p).is_file())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.gpu_check.kit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / ".whl"), help="folder of the wheels (emptied first)")
    ap.add_argument("--python-version", default="3.12", help="target CPython, e.g. 3.12 (the GPU machine) or 3.11")
    ap.add_argument("--extra", nargs="*", default=[], metavar="NAME",
                    help="more packages at this environment's versions, e.g. pyarrow (about 42 MiB) if the image's is "
                         "older than datasets wants (>= 24)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip"]
    target = ["--python-version", a.python_version, "--implementation", "cp"]
    for p in PLATFORMS:
        target += ["--platform", p]
    run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", *target, "-d", str(out), *map(pinned, PURE)])
    run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", *target, "-d", str(out),
         *map(pinned, [*COMPILED, *a.extra])])
    env = {**os.environ, "DS_BUILD_OPS": "0"}  # DeepSpeed: no kernels built here, JIT on the machine that runs them
    with tempfile.TemporaryDirectory() as tmp:
        run([*pip, "wheel", "-q", "--no-deps", "--no-binary=:all:", "-w", tmp, *map(pinned, SDIST)], env=env)
        for w in Path(tmp).glob("*.whl"):
            if not w.name.endswith("py3-none-any.whl"):
                sys.exit(f"scripts.gpu_check.kit: {w.name} is not a pure-Python wheel; it would not install on the GPU machine")
            shutil.move(str(w), out / w.name)
    wheels = sorted(out.glob("*.whl"))
    want = len(PURE) + len(COMPILED) + len(SDIST) + len(a.extra)
    if len(wheels) != want:
        sys.exit(f"scripts.gpu_check.kit: expected {want} wheels, got {len(wheels)}: {[w.name for w in wheels]}")
    kit, repo = sum(w.stat().st_size for w in wheels), repo_bytes()
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    total = (kit + repo) / 2**20
    print(f"kit {kit / 2**20:.1f} MiB + repository {repo / 2**20:.1f} MiB = {total:.1f} MiB (limit {LIMIT_MIB} MiB)")
    if total > LIMIT_MIB:
        sys.exit(f"scripts.gpu_check.kit: the wheels plus the repository are {total:.1f} MiB, over the {LIMIT_MIB} MiB that may travel "
                 "to the GPU machine; drop a wheel or shrink the repository")


if __name__ == "__main__":
    main()
