"""``datc-launch`` under FSDP2 says its failures in one line, as under DeepSpeed (issue 57):
torchrun's error block and traceback (exit 1) are replaced by the rank's own line and status
(a run directory in use: exit 2), one line for a rank killed by a signal, and one for a
``--master-port`` already in use (exit 2)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from datc.commands.launch import rank_pids
from datc.run.runlock import RunLock
from tests.helpers.distributed.same_batch import free_port

ROOT = Path(__file__).resolve().parents[2]


def _cmd(run: Path, cache_dir, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "datc.commands.launch", "--nproc", "2", "--master-port", str(port), "backend=fsdp2",
            "debug=fast", "credit=grpo", f"cache_dir={cache_dir}", f"run_dir={run}", *extra]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _no_block(err: str) -> None:
    for s in ("Traceback", "ChildFailedError", "Root Cause", "torch.distributed.elastic", "distributed/elastic"):
        assert s not in err, err[-4000:]


def test_a_busy_master_port_is_one_line_exit_2(tmp_path, cache_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run(_cmd(tmp_path / "run", cache_dir, port), env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-4000:]
    _no_block(r.stderr)
    said = [ln for ln in r.stderr.splitlines() if "is in use" in ln]
    assert len(said) == 1 and said[0].startswith(f"datc-launch: --master-port {port} is in use") and \
        "pass another --master-port" in said[0], r.stderr[-4000:]


@pytest.mark.slow
def test_a_run_directory_in_use_is_the_ranks_line_and_exit_2(tmp_path, prepared_cache):
    run = tmp_path / "run"
    run.mkdir()
    lock = RunLock.acquire(run)  # another datc-train holds it
    try:
        r = subprocess.run(_cmd(run, prepared_cache, free_port()), env=ENV, capture_output=True, text=True, timeout=600)
    finally:
        lock.release()
    assert r.returncode == 2, r.stderr[-4000:]
    _no_block(r.stderr)
    assert any(ln.startswith("datc-train: run_dir:") and "is in use by" in ln for ln in r.stderr.splitlines()), r.stderr[-4000:]


@pytest.mark.slow
def test_a_killed_fsdp2_rank_is_one_line(tmp_path, prepared_cache):
    run = tmp_path / "run"
    proc = subprocess.Popen(_cmd(run, prepared_cache, free_port(), "trainer.steps=500", "trainer.checkpoint_every=250"),
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count('"perf/step_s"') >= 2):
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.time() - t0 < 500
        time.sleep(0.5)
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGKILL, err[-4000:]
    _no_block(err)
    said = [ln for ln in err.splitlines() if "was ended by SIGKILL" in ln]
    assert len(said) == 1 and said[0].startswith("datc-launch: rank 1") and "run the same command again" in said[0], err[-4000:]
