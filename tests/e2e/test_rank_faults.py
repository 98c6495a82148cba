"""Faults of a multi-process run (docs/reliability.md): a SIGTERM to ``datc-launch`` reaches the
training processes, which checkpoint and stop, and the launcher exits with their status, leaving
no process behind; a rank killed with SIGKILL ends the others in one line each, not a traceback;
the training processes of a launcher's tree are found by their command line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from datc.commands.launch import rank_pids
from datc.train import lost_peer_line

ROOT = Path(__file__).resolve().parents[2]


def test_the_ranks_below_a_launcher_are_its_leaves_that_run_datc_train(tmp_path):
    # a "launcher" whose own command line names -m datc.train (as torchrun's does), with one
    # "rank" below it whose command line does too, and one helper process that does not
    child = "import time; time.sleep(60)"
    parent = ("import subprocess, sys, time\n"
              f"a = subprocess.Popen([sys.executable, '-c', {child!r}, '-m', 'datc.train'])\n"
              f"b = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", parent, "-m", "datc.train"])
    try:
        for _ in range(100):
            found = rank_pids(proc.pid)
            if found:
                break
            time.sleep(0.1)
        assert len(found) == 1 and found[0] != proc.pid
        assert b"datc.train" in Path(f"/proc/{found[0]}/cmdline").read_bytes()
    finally:
        for pid in [*rank_pids(proc.pid), proc.pid]:
            os.kill(pid, signal.SIGKILL)


def test_a_lost_peer_is_one_line_and_only_in_a_multi_process_run(tmp_path, monkeypatch):
    e = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:28579: Connection reset by peer\nmore")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    line = lost_peer_line(e, tmp_path)
    assert line.startswith("datc-train: rank 0 of 2: another process of this run ended or stopped answering")
    assert "\n" not in line and "no checkpoint was written yet" in line and "Connection reset by peer" in line
    assert lost_peer_line(ValueError("a bug"), tmp_path) is None  # its traceback follows
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert lost_peer_line(e, tmp_path) is None


def _metric_steps(run_dir: Path) -> int:
    f = run_dir / "metrics.jsonl"
    return f.read_text().count('"perf/step_s"') if f.exists() else 0


def _start(run_dir: Path, cache_dir, port: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "datc.commands.launch", "--nproc", "2", "--master-port", str(port), "deepspeed=zero2",
           "debug=fast", "credit=grpo", "trainer.steps=500", "trainer.checkpoint_every=250", f"cache_dir={cache_dir}",
           f"run_dir={run_dir}"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _after_steps(proc: subprocess.Popen, run_dir: Path, n: int, timeout: float = 400) -> None:
    t0 = time.time()
    while _metric_steps(run_dir) < n:
        assert proc.poll() is None, f"exited ({proc.returncode}) before step {n}: " + proc.communicate()[1][-3000:]
        assert time.time() - t0 < timeout, f"step {n} not reached in {timeout} s"
        time.sleep(0.5)


@pytest.mark.slow
def test_sigterm_to_the_launcher_checkpoints_every_rank_and_a_killed_rank_ends_the_other_in_one_line(cache_dir, tmp_path):
    run = tmp_path / "run"
    proc = _start(run, cache_dir, 29681)
    _after_steps(proc, run, 2)
    proc.send_signal(signal.SIGTERM)  # as `timeout` or a scheduler would
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    stopped = [ln for ln in err.splitlines() if "stopped by SIGTERM at step" in ln]
    assert len(stopped) >= 1 and "checkpoint of step" in stopped[0]
    step = int(stopped[0].split("at step ")[1].split(":")[0])
    assert (run / "checkpoints" / f"step_{step:07d}" / "state.pt").is_file()
    assert not subprocess.run(["pgrep", "-f", f"run_dir={run}"], capture_output=True).stdout  # nothing left running

    proc = _start(run, cache_dir, 29683)  # the same command resumes; then one rank is killed
    _after_steps(proc, run, step + 2)
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    lost = [ln for ln in err.splitlines() if "another process of this run ended or stopped answering" in ln]
    assert len(lost) == 1 and lost[0].startswith("datc-train: rank 0 of 2") and "run the same command again" in lost[0], \
        f"after the kill (exit {proc.returncode}): " + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not subprocess.run(["pgrep", "-f", f"run_dir={run}"], capture_output=True).stdout
