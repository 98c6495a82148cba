"""Faults of a 2-process run (issue 57) said as the one-process path says them: a damaged latest
checkpoint (a rank's file, a shard, DCP's metadata) is set aside as ``.damaged`` and the run
resumes from the one before; a full disk during a sharded checkpoint is one line, exit 2, with
no half-written directory left, and the same command resumes (ZeRO-2 and FSDP2 on CPU, gloo)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from datc.run.checkpoint import load_checkpoint
from datc.run.shards import shard_problem
from tests.helpers.distributed.same_batch import free_port
from tests.helpers.full_disk import full_disk_site

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = {"zero2": ["deepspeed=zero2"], "fsdp2": ["backend=fsdp2"]}


def _launch(run: Path, cache_dir, backend: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "datc.commands.launch", "--nproc", "2", "--master-port", str(free_port()),
           *BACKENDS[backend], "debug=fast", "credit=grpo", "trainer.steps=4", "trainer.checkpoint_every=2",
           "trainer.keep_checkpoints=3", f"cache_dir={cache_dir}", f"run_dir={run}"]
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=900, cwd=ROOT)


def _said(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("datc")]


def _damage(ckpt: Path, backend: str) -> dict[str, Path]:
    """The files whose truncation the check must find: a rank's file, a shard, DCP's metadata."""
    out = {"rank file": ckpt / "rank_00001.pt"}
    if backend == "zero2":
        out["shard"] = ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    else:
        out["shard"] = sorted((ckpt / "dcp").glob("*.distcp"))[-1]
        out["metadata"] = ckpt / "dcp" / ".metadata"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_full_disk_then_damaged_checkpoint_under_two_processes(prepared_cache, tmp_path, backend):
    run = tmp_path / "run"
    site = full_disk_site(tmp_path / "site")
    r = _launch(run, prepared_cache, backend, {"PYTHONPATH": f"{site}{os.pathsep}{ROOT}",
                                               "DATC_TEST_FULL_DISK_AT": "step_0000004"})
    assert r.returncode == 2, r.stderr[-4000:]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr, r.stderr[-4000:]
    full = [ln for ln in _said(r.stderr) if "no space left on device" in ln]
    assert full and all("step_0000002 is kept" in ln for ln in full), r.stderr[-4000:]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000002"]  # nothing half-written

    r = _launch(run, prepared_cache, backend)  # space is back: the same command resumes and finishes
    assert r.returncode == 0 and "resumed" in r.stderr and (run / "summary.json").is_file(), r.stderr[-4000:]

    # Each damage found by the rank that checks that file (the check itself, in this process)
    ckpt = run / "checkpoints" / "step_0000004"
    state = load_checkpoint(ckpt)
    assert all(shard_problem(ckpt, state, k, 2) is None for k in range(2))
    for what, file in _damage(ckpt, backend).items():
        copy = tmp_path / "copy" / what.replace(" ", "_") / ckpt.name
        shutil.copytree(ckpt, copy)
        target = copy / file.relative_to(ckpt)
        target.write_bytes(target.read_bytes()[: max(1, target.stat().st_size // 2)])
        said = [p for k in range(2) if (p := shard_problem(copy, state, k, 2)) is not None]
        assert len(said) == 1 and target.name in said[0], (what, said)

    # The run as a kill after its step-4 checkpoint left it, that checkpoint then damaged
    (run / "summary.json").unlink()
    shutil.rmtree(run / "final")
    victim = _damage(ckpt, backend)["metadata" if backend == "fsdp2" else "rank file"]
    victim.write_bytes(victim.read_bytes()[:40])
    r = _launch(run, prepared_cache, backend)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
    skipped = [ln for ln in _said(r.stderr) if "checkpoint step_0000004 skipped" in ln]
    assert len(skipped) == 1 and victim.name in skipped[0] and "step_0000004.damaged" in skipped[0], r.stderr[-4000:]
    assert "from its checkpoint of step 2 of 4" in r.stderr
    assert (run / "checkpoints" / "step_0000004.damaged").is_dir() and (run / "summary.json").is_file()
    assert torch.load(run / "checkpoints" / "step_0000004" / "state.pt", weights_only=False)["step"] == 4  # written again

    # The other backend on the run killed again: its refusal, exit 2, and nothing more (torchrun's block under FSDP2)
    (run / "summary.json").unlink()
    r = _launch(run, prepared_cache, "fsdp2" if backend == "zero2" else "zero2")
    assert r.returncode == 2, r.stderr[-4000:]
    for s in ("Traceback", "ChildFailedError", "distributed/elastic"):
        assert s not in r.stderr, r.stderr[-4000:]
    assert any(ln.startswith("datc-train: run_dir:") and "holds another run" in ln for ln in r.stderr.splitlines())
