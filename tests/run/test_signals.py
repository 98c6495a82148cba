"""The signal scopes of datc.run.signals seen from a whole process: ``until_said`` keeps a run's last
line when a launcher's SIGTERM lands while the run unwinds (another rank died), and changes nothing
before the run began."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

SCRIPT = """
import os, signal, sys
from datc.run.signals import stop_signals, until_said
phase = sys.argv[1]
with until_said():
    if phase == "before":  # the config and models loading: no run scope yet
        os.kill(os.getpid(), signal.SIGTERM)
        print("still here", flush=True)
    try:
        with stop_signals():
            raise RuntimeError("a collective failed")
    except RuntimeError:
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's SIGTERM, while the run unwinds
        if phase == "twice":
            os.kill(os.getpid(), signal.SIGTERM)
        print("datc-train: rank 0 of 2: another process of this run ended", file=sys.stderr, flush=True)
        sys.exit(1)
"""


def _run(phase: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, phase], capture_output=True, text=True, timeout=60)


def test_a_sigterm_while_the_run_unwinds_keeps_its_line_and_status():
    p = _run("ending")
    assert p.returncode == 1 and "another process of this run ended" in p.stderr, p.stderr


@pytest.mark.parametrize("phase", ["before", "twice"])
def test_before_the_run_or_a_second_time_a_sigterm_ends_the_process_as_before(phase):
    p = _run(phase)
    assert p.returncode == -signal.SIGTERM, (p.returncode, p.stderr)
    assert "still here" not in p.stdout and "another process" not in p.stderr
