"""What a hostile user still hit (issue 57): a run killed before its first checkpoint, a resume
that changes the thread count, ``datc-export`` racing on one ``--out``, ``datc-compare``'s lock
files and a stale ``default/``. Each test fails on the code before its fix; the launcher's
signal cases are in tests/e2e/test_kills.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from datc.config import ConfigError
from tests.helpers import cli
from tests.helpers.runs import comparable, metric_rows
from tests.helpers.testbed import cfg_for, train_cmd

ROOT = Path(__file__).resolve().parents[2]


# ---- 1. a run killed before its first checkpoint --------------------------------------------------


def _as_killed_after_run_json(cache, run, *overrides) -> None:
    """``run`` as a kill leaves it between ``run.json`` and ``inputs.json``: the directory opened
    for the run (``run.json``, ``config.yaml``, its lock), nothing else."""
    from datc.run.rundir import RunDir, release_run_locks
    from datc.training.lifecycle import resolved_config

    RunDir.open(run, resolved_config(cfg_for(cache, run, *overrides)), "auto")
    release_run_locks()
    assert (run / "run.json").exists() and not (run / "inputs.json").exists()


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_starts_again(prepared_cache, tmp_path, capfd):
    from datc.training.trainer import train

    ref = tmp_path / "ref"
    train(cfg_for(prepared_cache, ref))  # uninterrupted

    run = tmp_path / "run"
    _as_killed_after_run_json(prepared_cache, run)
    capfd.readouterr()
    summary = train(cfg_for(prepared_cache, run))  # it was refused: "cannot be checked: its inputs.json is missing"
    assert "no checkpoint yet (it stopped before its first): starting it again from step 0" in capfd.readouterr().err
    assert "accepted_input_changes" not in summary
    assert comparable(metric_rows(run)) == comparable(metric_rows(ref))
    assert json.loads((run / "inputs.json").read_text())["inputs"]

    # the way out the refusal suggested wrote a false "accepted input change" into the summary
    run2 = tmp_path / "run2"
    _as_killed_after_run_json(prepared_cache, run2)
    (run2 / "metrics.jsonl").write_text((ref / "metrics.jsonl").read_text().splitlines()[0] + "\n")  # step 0's eval
    summary = train(cfg_for(prepared_cache, run2, "trainer.accept_changed_inputs=true"))
    assert "accepted_input_changes" not in summary
    assert "accepted_input_changes" not in json.loads((run2 / "run.json").read_text())
    assert comparable(metric_rows(run2)) == comparable(metric_rows(ref))


@pytest.mark.slow
def test_a_run_killed_in_a_cold_prepare_step_starts_again_with_the_same_command(tmp_path):
    cache, run = tmp_path / "cache", tmp_path / "run"  # a cold cache: seconds of prepare after run.json
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(train_cmd(cache, run), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (run / "run.json").exists():
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.01)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert not (run / "inputs.json").exists() and not (run / "checkpoints").exists()
    r = cli.run(train_cmd(cache, run), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "starting it again from step 0" in r.stderr
    assert (run / "summary.json").exists()


@pytest.mark.slow
def test_inputs_json_that_is_empty_or_a_directory_is_one_line(prepared_cache, tmp_path):
    import shutil

    from datc.training.trainer import train

    run = tmp_path / "run"
    train(cfg_for(prepared_cache, run))
    for p in ("summary.json", "final", "checkpoints/step_0000003"):  # as a kill after step 2's checkpoint leaves it
        shutil.rmtree(run / p) if (run / p).is_dir() else (run / p).unlink()
    (run / "inputs.json").write_text("{}")  # it said "policy (...) was not a local file when the run started"
    with pytest.raises(ConfigError, match=r"cannot be checked: its inputs.json holds no fingerprints \(not the file datc "
                                          r"writes\), so nothing says"):
        train(cfg_for(prepared_cache, run))
    (run / "inputs.json").unlink()
    (run / "inputs.json").mkdir()  # it was an IsADirectoryError traceback
    for extra in ((), ("trainer.accept_changed_inputs=true",)):
        r = cli.run(train_cmd(prepared_cache, run, *extra))
        assert r.returncode == 2, r.stderr[-2000:]
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("datc-train:")]
        assert lines == [f"datc-train: run_dir: {run / 'inputs.json'} is a directory, not the run's record of its "
                         "inputs; move it aside and run the same command again"], r.stderr[-2000:]
        assert "Traceback" not in r.stderr
    assert (run / "inputs.json").is_dir() and (run / "checkpoints" / "step_0000002").is_dir()


# ---- 3a. datc-export: one writer per --out; a link, a read-only place, a Ctrl-C -------------------


@pytest.fixture(scope="module")
def trained(prepared_cache, tmp_path_factory):
    from datc.training.trainer import train

    run = tmp_path_factory.mktemp("exported") / "run"
    train(cfg_for(prepared_cache, run))
    return run


def _left_beside(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.slow
def test_two_exports_racing_to_one_out_the_loser_is_refused(trained, tmp_path, monkeypatch, capsys):
    from datc.commands import export

    out = tmp_path / "out"
    real = export.load_policy_weights
    second: list[int] = []

    def racing(model, state):  # the other export starts while this one is writing
        if not second:
            second.append(-1)
            second[0] = export.main([str(trained), "--checkpoint", "2", "--out", str(out)])
        real(model, state)

    monkeypatch.setattr(export, "load_policy_weights", racing)
    assert export.main([str(trained), "--checkpoint", "3", "--out", str(out)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert second == [2], err  # it exited 0 and printed the path, holding the other export
    assert len(err) == 1 and "is being written by another datc-export now" in err[0], err
    assert json.loads((out / "datc_export.json").read_text())["checkpoint"] == 3
    assert _left_beside(tmp_path) == []  # no lock file, no temporary folder


@pytest.mark.slow
def test_export_out_a_link_a_read_only_place_or_a_ctrl_c_is_one_line(trained, tmp_path, monkeypatch, capsys):
    import errno
    import tempfile

    from datc.commands import export

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert export.main([str(trained), "--out", str(tmp_path / "link")]) == 0  # it was a FileExistsError traceback
    assert (tmp_path / "real" / "config.json").exists() and (tmp_path / "link").is_symlink()
    assert capsys.readouterr().out.strip() == str(tmp_path / "link")

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "mnt"))

    with monkeypatch.context() as m:
        m.setattr(tempfile, "mkdtemp", read_only)
        assert export.main([str(trained), "--out", str(tmp_path / "ro")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("datc-export: --out: cannot write") and "Read-only file system" in err[0]

    def ctrl_c(model, state):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "load_policy_weights", ctrl_c)
    assert export.main([str(trained), "--out", str(tmp_path / "cut" / "out")]) == 130  # it was a traceback
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["datc-export: interrupted (SIGINT); nothing was written (what --out held is as it was)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # nothing of ro/ or cut/ stays


# ---- 3b. a stale default/ beside another sweep's tuned.md; 5. lock files left ---------------------


def _sweep_without_default_runs(root: Path) -> None:
    """A tuned sweep whose schemes all chose another rate than the default, and whose evaluation
    ran the chosen configurations alone: no default-configuration runs."""
    import shutil

    from tests.helpers.tuning import EVAL, LR, SELECT, sweep, write_run

    folder = sweep(root)
    for seed in SELECT:  # grpo: twice the rate is now best
        write_run(folder / "select", "grpo", seed, 2 * LR, 0.50)
    for d in (folder / "eval").iterdir():
        if "-lr0.0005-" in d.name:  # the default rate's evaluation runs
            shutil.rmtree(d)
    for draw, seeds in EVAL.items():
        for seed in seeds:
            write_run(folder / "eval", "grpo", seed, 2 * LR, 0.3, draw=int(draw))


def test_a_tuned_comparison_without_default_runs_leaves_no_stale_default_tables(tmp_path, capsys):
    from datc.compare import main
    from tests.helpers.tuning import sweep

    sweep(tmp_path / "A")
    _sweep_without_default_runs(tmp_path / "B")
    out = tmp_path / "out"
    main(["--tuned", str(tmp_path / "A"), "--out", str(out)])
    assert (out / "default" / "table.md").exists()
    capsys.readouterr()
    main(["--tuned", str(tmp_path / "B"), "--out", str(out)])
    err = capsys.readouterr().err
    assert not (out / "default").exists(), "A's default tables stayed beside B's tuned.md"
    assert f"removed {out / 'default'}: an earlier comparison's tables" in err
    assert (out / "evaluation" / "table.md").exists() and (out / "tuned.md").exists()

    (out / "default").mkdir()
    (out / "default" / "notes.txt").write_text("mine")  # not datc-compare's: never removed
    before = (out / "tuned.md").read_text()
    with pytest.raises(SystemExit) as e:
        main(["--tuned", str(tmp_path / "B"), "--out", str(out)])
    assert e.value.code == 2
    assert "holds files datc-compare did not write" in capsys.readouterr().err
    assert (out / "default" / "notes.txt").read_text() == "mine" and (out / "tuned.md").read_text() == before


def test_datc_compare_leaves_no_lock_files(tmp_path, monkeypatch, capsys):
    from datc.compare import main
    from tests.helpers.tuning import sweep

    sweep(tmp_path / "sweep")
    runs = tmp_path / "runs"
    runs.mkdir()
    main(["--tuned", str(tmp_path / "sweep"), "--out", str(runs / "compare")])
    main([str(tmp_path / "sweep"), "--out", str(runs / "plain")])
    monkeypatch.chdir(runs / "plain")
    main([str(tmp_path / "sweep"), "--out", "."])  # written in place, its lock inside
    locks = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.lock"))
    assert locks == [], locks  # .default.lock, .evaluation.lock, runs/.compare.lock stayed after every run


def test_a_removed_lock_file_never_lets_two_holders_in(tmp_path):
    import threading

    from datc.atomic import held_lock

    path, inside, overlaps = tmp_path / ".out.lock", [0], []
    guard = threading.Lock()

    def worker() -> None:
        for _ in range(30):
            with held_lock(path):
                with guard:
                    inside[0] += 1
                    overlaps.append(inside[0])
                time.sleep(0.001)
                with guard:
                    inside[0] -= 1

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(overlaps) == 180 and max(overlaps) == 1  # one holder at a time, though each removes the file
    assert not path.exists()
    with held_lock(path), pytest.raises(BlockingIOError), held_lock(path, wait=False):
        pass  # busy: refused at once where asked


# ---- 4. a resume that changes the thread count -----------------------------------------------------


@pytest.mark.slow
def test_a_resume_with_another_thread_count_is_refused_unless_asked_and_then_recorded(prepared_cache, tmp_path):
    from datc.training.trainer import train
    from tests.helpers.runs import copy_as_killed

    ref = tmp_path / "ref"  # as a 1-process datc-launch on 2 cores runs it
    train(cfg_for(prepared_cache, ref, "trainer.threads=2"))
    assert json.loads((ref / "inputs.json").read_text())["threads"] == 2
    run = tmp_path / "run"
    copy_as_killed(ref, run, last_checkpoint=2, rows_through=2)
    # resumed by datc-train (threads 1): it trained on, differing from its first resumed step
    with pytest.raises(ConfigError, match=r"^trainer.threads: .* was trained with trainer.threads=2 and is resumed with "
                                          r"1; .*resume with trainer.threads=2 \(datc-launch: --threads 2\)"):
        train(cfg_for(prepared_cache, run))
    assert not (run / "summary.json").exists()
    train(cfg_for(prepared_cache, run, "trainer.threads=2"))  # the same count: the uninterrupted run's numbers
    assert comparable(metric_rows(run)) == comparable(metric_rows(ref))

    asked = tmp_path / "asked"
    copy_as_killed(ref, asked, last_checkpoint=2, rows_through=2)
    summary = train(cfg_for(prepared_cache, asked, "trainer.accept_changed_inputs=true"))
    assert summary["accepted_input_changes"] == ["trainer.threads 2 -> 1"]
    assert json.loads((asked / "inputs.json").read_text())["threads"] == 1
