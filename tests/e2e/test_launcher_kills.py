"""``datc-launch`` killed or signalled every way a user, a terminal or a scheduler does (issue 57):
no training process outlives it, and a Ctrl-C ends in the stop checkpoint under DeepSpeed too."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from datc.commands.launch import rank_pids
from datc.run.lifeline import launcher_gone

ROOT = Path(__file__).resolve().parents[2]


def _left(run: Path, timeout: float = 60) -> list[str]:
    """The processes whose command line names ``run`` once they had ``timeout`` seconds to end."""
    deadline = time.time() + timeout
    while True:
        left = subprocess.run(["pgrep", "-f", f"run_dir={run}"], capture_output=True, text=True).stdout.split()
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)


def test_a_process_of_a_launch_ends_when_the_launcher_is_killed(tmp_path):
    # a stand-in for datc-launch -> DeepSpeed's launcher -> rank: the rank is a grandchild
    up = tmp_path / "up"
    rank = ("import os, time\n"
            "from datc.run.lifeline import die_with_launcher\n"
            "assert die_with_launcher(poll_s=0.1)\n"
            f"open({str(up)!r} + '.tmp', 'w').write(f'{{os.getpid()}} {{os.getppid()}}')\n"
            f"os.rename({str(up)!r} + '.tmp', {str(up)!r})\n"
            "time.sleep(120)\n")
    middle = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {rank!r}]); time.sleep(120)"
    launcher = ("import os, subprocess, sys, time\n"
                "from datc.run.lifeline import launcher_env\n"
                f"subprocess.Popen([sys.executable, '-c', {middle!r}], env={{**os.environ, **launcher_env()}})\n"
                "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", launcher], env={**os.environ, "PYTHONPATH": str(ROOT)})
    pids: list[int] = []
    try:
        deadline = time.time() + 60
        while not up.exists():
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.05)
        pids = [int(x) for x in up.read_text().split()]  # the rank, the launcher between
        os.kill(proc.pid, signal.SIGKILL)  # datc-launch cannot pass anything on
        proc.wait()
        deadline = time.time() + 10
        while not launcher_gone(f"{pids[0]}:"):  # gone, or a zombie its parent has not reaped
            assert time.time() < deadline, "the rank outlived its launcher"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pid in reversed(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_sigterm_right_after_a_sigint_is_the_same_stop():
    from datc.run.signals import stop_requested, stop_signals

    with stop_signals():
        os.kill(os.getpid(), signal.SIGINT)  # the Ctrl-C, passed on by DeepSpeed's launcher...
        os.kill(os.getpid(), signal.SIGTERM)  # ...which sends SIGTERM on top of it: it used to exit at once
        assert stop_requested()
        with pytest.raises(SystemExit) as e:
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C still exits at once
            time.sleep(1)
        assert e.value.code == 130
    with stop_signals():
        os.kill(os.getpid(), signal.SIGHUP)  # the terminal closed (datc-launch passes it on): it ended the run at once
        assert stop_requested()


def _start(run: Path, cache_dir, port: int, backend: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    chosen = ["deepspeed=zero2"] if backend == "zero2" else ["backend=fsdp2"]
    cmd = [sys.executable, "-m", "datc.commands.launch", "--nproc", "2", "--master-port", str(port), *chosen,
           "debug=fast", "credit=grpo", "trainer.steps=500", "trainer.checkpoint_every=250", f"cache_dir={cache_dir}",
           f"run_dir={run}"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.parametrize(("signame", "backend", "port"), [
    ("SIGKILL", "zero2", 29741), ("SIGKILL", "fsdp2", 29743), ("SIGHUP", "zero2", 29745), ("SIGTERM", "fsdp2", 29747),
    ("SIGINT", "fsdp2", 29749)])
def test_no_rank_outlives_the_launcher_killed_or_signalled(prepared_cache, tmp_path, signame, backend, port):
    run = tmp_path / "run"
    proc = _start(run, prepared_cache, port, backend)
    try:
        deadline = time.time() + 300
        while len(rank_pids(proc.pid)) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline
            time.sleep(0.2)
        time.sleep(3)  # a few seconds in: the ranks are starting up
        proc.send_signal(getattr(signal, signame))
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0
        assert _left(run) == [], f"processes of the run outlived datc-launch ({signame}): {err[-2000:]}"
        if signame == "SIGINT":  # a Ctrl-C while the ranks start: no KeyboardInterrupt traceback from their imports
            assert proc.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pid in _left(run, timeout=0):
            os.kill(int(pid), signal.SIGKILL)


@pytest.mark.slow
def test_ctrl_c_to_the_launcher_under_deepspeed_ends_in_the_stop_checkpoint(prepared_cache, tmp_path):
    run = tmp_path / "run"
    proc = _start(run, prepared_cache, 29751, "zero2")
    try:
        f, deadline = run / "metrics.jsonl", time.time() + 400
        while not (f.exists() and '"perf/step_s"' in f.read_text()):  # training
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # to datc-launch's process alone: it used to be ignored, the run trained on
        _, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == 130, err[-3000:]
    stopped = [ln for ln in err.splitlines() if "stopped by SIGINT at step" in ln]
    assert stopped and "checkpoint of step" in stopped[0], err[-3000:]
    step = int(stopped[0].split("at step ")[1].split(":")[0])
    assert (run / "checkpoints" / f"step_{step:07d}" / "state.pt").is_file()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert _left(run) == []


def test_ctrl_c_while_datc_launch_checks_the_config_is_one_line(monkeypatch, capsys):
    from datc.commands import launch

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "build", interrupted)
    assert launch.main(["--nproc", "2", "deepspeed=zero2"]) == 130
    err = capsys.readouterr().err
    assert err == "datc-launch: interrupted (SIGINT) before the run started; nothing was started\n"
