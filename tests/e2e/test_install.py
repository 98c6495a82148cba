"""The CPU install's torch pin: on Linux x86-64 it admits only PyTorch's CPU build, so an install
without that build at hand fails naming it instead of resolving PyPI's CUDA build."""

from __future__ import annotations

import subprocess
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]


def _torch_specifiers(env: dict[str, str]):
    lines = [ln.split("#")[0].strip() for ln in (REPO / "constraints" / "cpu.txt").read_text().splitlines()]
    reqs = [Requirement(ln) for ln in lines if ln]
    return [r.specifier for r in reqs if r.name == "torch" and (r.marker is None or r.marker.evaluate(env))]


def test_the_cpu_pin_admits_only_the_cpu_build_on_linux_x86_64():
    # Before: torch==2.13.0 admitted PyPI's 2.13.0 (the CUDA build: 527 MB and 15 nvidia-* packages).
    (spec,) = _torch_specifiers({"sys_platform": "linux", "platform_machine": "x86_64"})
    assert spec.contains("2.13.0+cpu") and not spec.contains("2.13.0")
    (mac,) = _torch_specifiers({"sys_platform": "darwin", "platform_machine": "arm64"})
    assert mac.contains("2.13.0")  # PyPI's macOS torch is the CPU build, without a +cpu label


def test_the_makefile_adds_pytorchs_cpu_index_when_it_answers():
    out = subprocess.run(["make", "-n", "-B", "venv", "CONSTRAINTS=constraints/cpu.txt",
                          "TORCH_CPU_INDEX=http://127.0.0.1:9"], capture_output=True, text=True, cwd=REPO, timeout=60)
    line = next(ln for ln in out.stdout.splitlines() if "pip install" in ln and "-e" in ln)
    assert "-c constraints/cpu.txt" in line and "--extra-index-url" not in line  # nothing answers on port 9
