"""A run's files as the tests read them: its metric rows, those without timings, a run killed at
its checkpoint (or a copy as a kill would have left it) and two runs' metrics compared."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest


def metric_rows(run_dir) -> list[dict]:
    """The run's ``metrics.jsonl``, one dict per row."""
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def comparable(rows: list[dict]) -> list[dict]:
    """Metric rows without wall-clock timings (``perf/*``): what two equal runs share exactly."""
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def kill_at_checkpoint(cmd: list[str], run_dir, step: int, timeout: float = 300) -> None:
    """Start ``cmd`` (a training run writing to ``run_dir``), SIGKILL it as soon as its
    checkpoint of ``step`` exists, and check that it had not finished: what a resume test
    starts from. Fails if the run ends first or ``timeout`` seconds pass."""
    ckpt = Path(run_dir) / "checkpoints" / f"step_{step:07d}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    try:
        while not ckpt.exists():
            assert proc.poll() is None and time.time() < deadline, f"run ended or timed out before {ckpt.name}"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert not (Path(run_dir) / "summary.json").exists(), "the run finished before it could be killed"


def copy_as_killed(run_dir, dst, last_checkpoint: int, rows_through: int) -> None:
    """``run_dir`` copied to ``dst`` as a kill after checkpoint ``last_checkpoint`` would have
    left it: no later checkpoint, no summary.json, the metrics rows through step
    ``rows_through`` only (those written after the checkpoint included)."""
    def later(_dir, names):
        return [n for n in names if n == "summary.json"
                or (re.fullmatch(r"step_\d+", n) is not None and int(n[5:]) > last_checkpoint)]

    shutil.copytree(run_dir, dst, ignore=later)
    rows = [r for r in metric_rows(dst) if r["step"] <= rows_through]
    (Path(dst) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def assert_same_metrics(a, b, rel: float = 1e-6, abs: float = 1e-9) -> None:
    """The two runs' metric rows, timings aside, step for step within ``rel``/``abs`` (several
    processes reduce in an order that may differ from run to run)."""
    ra, rb = comparable(metric_rows(a)), comparable(metric_rows(b))
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb, strict=True):
        assert y == pytest.approx(x, rel=rel, abs=abs)
