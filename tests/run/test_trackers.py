"""Trackers (datc/run/trackers/): a tracker gets every row ``metrics.jsonl`` gets, read back here
from what it wrote; a resume leaves one value per step; a finished run asked again with a tracker
it was not sent to is sent there; a tracker added in code plugs in by name."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from datc.config import ConfigError, LoggerConfig
from datc.run.trackers import TRACKERS, Tracker
from tests.helpers.runs import copy_as_killed, kill_at_checkpoint, metric_rows
from tests.helpers.testbed import cfg_for, train_cmd

TEXT_TAGS = ("config", "eval/samples", "rollout/completions", "summary")


def read_events(run_dir) -> tuple[dict[str, dict[int, list[float]]], dict[str, dict[int, list[str]]]]:
    """What TensorBoard shows of ``<run_dir>/tensorboard/``: scalars and texts, tag -> step -> every
    value logged at that step, after the purges a resume wrote (read as the dashboard's loader reads
    them: every summary as a tensor, purged alike)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    out: dict[str, dict[str, dict[int, list]]] = {"scalars": {}, "text": {}}
    for tag in acc.Tags()["tensors"]:
        kind = acc.SummaryMetadata(tag).plugin_data.plugin_name
        if kind in out:
            for e in acc.Tensors(tag):
                v = tensor_util.make_ndarray(e.tensor_proto).item()
                out[kind].setdefault(tag.removesuffix("/text_summary"), {}).setdefault(e.step, []).append(
                    v.decode() if kind == "text" else v)
    return out["scalars"], out["text"]


def expected_scalars(run_dir) -> dict[str, dict[int, list[float]]]:
    """Every number of every row of the run's ``metrics.jsonl``, as TensorBoard keeps it (float32;
    the file's null is a NaN, its "inf" an infinity)."""
    out: dict[str, dict[int, list[float]]] = {}
    for row in metric_rows(run_dir):
        for k, v in row.items():
            if k != "step":
                v = math.nan if v is None else float(v)
                out.setdefault(k, {}).setdefault(row["step"], []).append(float(np.float32(v)))
    return out


def assert_tensorboard_holds_the_metrics(run_dir) -> dict[str, dict[int, list[str]]]:
    """Every key at every step of metrics.jsonl, once, with its value; nothing else. Returns the texts."""
    scalars, texts = read_events(run_dir)
    want = expected_scalars(run_dir)
    assert set(scalars) == set(want), sorted(set(scalars) ^ set(want))
    for tag, steps in want.items():  # one value per step, equal to the file's (NaN where it says null)
        assert scalars[tag].keys() == steps.keys(), (tag, scalars[tag], steps)
        for step, values in steps.items():
            np.testing.assert_array_equal(scalars[tag][step], values, err_msg=f"{tag} at step {step}")
    return texts


@pytest.fixture(scope="module")
def tb_run(cache_dir, tmp_path_factory) -> Path:
    """A finished ``debug=fast logger=tensorboard`` run (3 steps, evals at 0, 2 and 3)."""
    from datc.training.trainer import train

    run = tmp_path_factory.mktemp("tb") / "run"
    train(cfg_for(cache_dir, run, "logger=tensorboard"))
    return run


@pytest.fixture(scope="module")
def plain_run(cache_dir, tmp_path_factory) -> Path:
    """A finished ``debug=fast`` run logged to no tracker (``logger=none``, as ``make demo``)."""
    from datc.training.trainer import train

    run = tmp_path_factory.mktemp("plain") / "run"
    train(cfg_for(cache_dir, run))
    return run


@pytest.mark.slow
def test_a_tensorboard_run_holds_every_metric_row_the_tables_and_the_config(tb_run):
    texts = assert_tensorboard_holds_the_metrics(tb_run)
    assert set(texts) == set(TEXT_TAGS)
    assert {tag: sorted(steps) for tag, steps in texts.items()} == {
        "config": [0], "eval/samples": [0, 2, 3], "rollout/completions": [2, 3], "summary": [3]}
    completions = texts["rollout/completions"][3][0].splitlines()
    assert completions[0] == "| prompt | completion | reward | advantage | credit: token (w) |"
    assert len(completions) == 2 + 8  # header, rule, logger.log_samples rows
    assert all(line.startswith("| write about") for line in completions[2:])
    assert texts["eval/samples"][0][0].startswith("| prompt | response | rm\\_score | gold |")
    assert "credit:\n  name: grpo" in texts["config"][0][0] and texts["config"][0][0].startswith("```yaml")
    final = json.loads((tb_run / "summary.json").read_text())["eval"]["final"]
    assert f"| eval/gold | {final['eval/gold']:.4g} |" in texts["summary"][3][0]
    assert json.loads((tb_run / "run.json").read_text())["trackers"] == ["tensorboard"]


@pytest.mark.slow
def test_a_resumed_tensorboard_run_keeps_one_value_per_step(cache_dir, tb_run, tmp_path):
    from datc.training.trainer import train

    # Killed after step 3 was logged but before its checkpoint: the event files hold step 3, the
    # resume from the checkpoint of step 2 redoes it, and TensorBoard shows the redone value only.
    run = tmp_path / "run"
    time.sleep(1)  # the resumed run's event file is named a later second than the first run's
    copy_as_killed(tb_run, run, last_checkpoint=2, rows_through=3)
    assert 3 in read_events(run)[0]["loss/total"]
    train(cfg_for(cache_dir, run, "logger=tensorboard"))
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2  # the same folder, continued
    texts = assert_tensorboard_holds_the_metrics(run)
    assert {tag: sorted(steps) for tag, steps in texts.items()}["summary"] == [3]
    assert all(len(v) == 1 for steps in texts.values() for v in steps.values())


@pytest.mark.slow
def test_a_tensorboard_run_killed_at_a_checkpoint_resumes_with_one_value_per_step(prepared_cache, tmp_path):
    from datc.training.trainer import train

    # SIGKILL as soon as the checkpoint of step 2 exists: what was logged before it is on disk
    run = tmp_path / "run"
    kill_at_checkpoint(train_cmd(prepared_cache, run, "logger=tensorboard"), run, 2)
    time.sleep(1)  # the resumed run's event file is named a later second than the killed run's
    train(cfg_for(prepared_cache, run, "logger=tensorboard"))
    texts = assert_tensorboard_holds_the_metrics(run)
    assert {tag: sorted(steps) for tag, steps in texts.items()} == {
        "config": [0], "eval/samples": [0, 2, 3], "rollout/completions": [2, 3], "summary": [3]}
    assert all(len(v) == 1 for steps in texts.values() for v in steps.values())


@pytest.mark.slow
def test_a_run_resumed_with_a_new_tracker_sends_it_the_rows_before_the_resume(cache_dir, plain_run, tmp_path, capfd):
    from datc.training.trainer import train

    run = tmp_path / "run"
    copy_as_killed(plain_run, run, last_checkpoint=2, rows_through=2)
    train(cfg_for(cache_dir, run, "logger=tensorboard"))
    err = capfd.readouterr().err
    n = len([r for r in metric_rows(run) if r["step"] <= 2])
    assert f"sent the {n} metric rows this run logged before its resume to TensorBoard" in err, err[-2000:]
    assert_tensorboard_holds_the_metrics(run)  # steps 0-2 sent on resuming, 3 as it ran


@pytest.mark.slow
def test_a_finished_run_asked_with_a_tracker_it_was_not_sent_to_is_sent_there(cache_dir, plain_run, tmp_path, capfd):
    from datc.training.trainer import train

    run = tmp_path / "run"
    shutil.copytree(plain_run, run)
    before = (run / "metrics.jsonl").read_bytes()
    summary = train(cfg_for(cache_dir, run, "logger=tensorboard"))
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if "sent this finished run" in ln]
    n = len(metric_rows(run))
    assert len(lines) == 1 and f"sent this finished run's {n} metric rows to TensorBoard ({run / 'tensorboard'}" in lines[0], err
    assert "nothing retrained" in err
    assert (run / "metrics.jsonl").read_bytes() == before  # read, never rewritten
    assert summary == json.loads((run / "summary.json").read_text())
    texts = assert_tensorboard_holds_the_metrics(run)
    assert sorted(texts["summary"]) == [3]
    assert json.loads((run / "run.json").read_text())["trackers"] == ["tensorboard"]
    # asked again: it was sent already, nothing more is written
    train(cfg_for(cache_dir, run, "logger=tensorboard"))
    assert "sent this finished run" not in capfd.readouterr().err
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1


@pytest.mark.slow
def test_a_finished_run_is_sent_to_an_offline_wandb_run(cache_dir, plain_run, tmp_path, monkeypatch, capfd):
    from datc.training.trainer import train

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    shutil.copytree(plain_run, run)
    train(cfg_for(cache_dir, run, "logger=wandb"))
    err = capfd.readouterr().err
    assert f"sent this finished run's {len(metric_rows(run))} metric rows to W&B (offline" in err, err[-2000:]
    wandb_id = json.loads((run / "run.json").read_text())["wandb_id"]
    assert list((run / "wandb").glob(f"offline-run-*-{wandb_id}"))
    assert json.loads((run / "run.json").read_text())["trackers"] == ["wandb"]


def test_logger_tensorboard_without_the_package_is_one_line_and_exit_2(tmp_path):
    # sys.modules[name] = None: importlib finds no such package, as in an environment without it
    code = ("import sys; sys.modules['tensorboard'] = None; from datc.train import main; "
            f"sys.argv = ['datc-train', 'logger=tensorboard', 'run_dir={tmp_path}/run', 'cache_dir={tmp_path}/cache']; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "datc-train: logger.name: tensorboard needs the tensorboard package, which is not installed; install it with "
        "pip install 'datc[tensorboard]' (or pip install tensorboard), or use logger=none"]
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()  # before anything was made


def test_an_unknown_tracker_name_lists_the_registered_ones(tmp_path):
    from datc.checks import validate

    with pytest.raises(ConfigError, match=r"^logger.name: 'mlflow' is not valid; choose one of none, tensorboard, wandb$"):
        validate(cfg_for(tmp_path, tmp_path / "run", "logger.name=mlflow"))


class Recording(Tracker):
    """A tracker added in code: it keeps what it is sent."""

    label = "Recording"
    sent: list = []

    def log(self, metrics, step):
        self.sent.append(("log", step, dict(metrics)))

    def log_samples(self, rows, step):
        self.sent.append(("samples", step, len(rows)))

    def finish(self, summary):
        self.sent.append(("finish", summary))


class Broken(Recording):
    label = "Broken"

    def log(self, metrics, step):
        raise ConnectionError("the tracker is down")


def _run_dir(tmp_path, name: str):
    from datc.run.rundir import RunDir
    from datc.training.lifecycle import resolved_config

    return RunDir.open(tmp_path / "run", resolved_config(cfg_for(tmp_path, tmp_path / "run", f"logger.name={name}")), "auto")


def test_a_tracker_added_in_code_is_chosen_by_its_name_and_gets_every_row(tmp_path, monkeypatch):
    from datc.checks import validate
    from datc.run.logger import RunLogger
    from datc.run.rundir import release_run_locks

    monkeypatch.setitem(TRACKERS._items, "recording", Recording)
    monkeypatch.setattr(Recording, "sent", [])
    assert validate(cfg_for(tmp_path, tmp_path / "run", "logger.name=recording")).logger.name == "recording"
    run = _run_dir(tmp_path, "recording")
    try:
        logger = RunLogger(run, LoggerConfig(name="recording"), "r", {})
        logger.log({"eval/gold": 0.5}, 0)
        logger.log_samples([{"prompt": "p", "response": "r"}], 0)
        logger.log_completions(None, 0)  # no completions kept: nothing sent
        logger.log({"loss/total": float("inf")}, 1)
        logger.finish({"eval/gold": 0.5})
    finally:
        release_run_locks()
    assert Recording.sent == [("log", 0, {"eval/gold": 0.5}), ("samples", 0, 1), ("log", 1, {"loss/total": float("inf")}),
                              ("finish", {"eval/gold": 0.5})]
    assert [r["step"] for r in metric_rows(run.path)] == [0, 1] and metric_rows(run.path)[1]["loss/total"] == "inf"
    assert run.trackers() == ["recording"]


def test_a_failing_tracker_is_said_once_and_every_row_still_reaches_metrics_jsonl(tmp_path, monkeypatch, capsys):
    from datc.run.logger import RunLogger
    from datc.run.rundir import release_run_locks

    monkeypatch.setitem(TRACKERS._items, "broken", Broken)
    monkeypatch.setattr(Broken, "sent", [])
    run = _run_dir(tmp_path, "broken")
    try:
        logger = RunLogger(run, LoggerConfig(name="broken"), "r", {})
        for step in range(3):
            logger.log({"loss/total": 1.0}, step)
        logger.finish({})
    finally:
        release_run_locks()
    err = capsys.readouterr().err.splitlines()
    assert err == [f"Broken logging failed (ConnectionError: the tracker is down); training continues, metrics are in "
                   f"{run.metrics_file}"]
    assert [r["step"] for r in metric_rows(run.path)] == [0, 1, 2]
    assert Broken.sent == []  # dropped after its failure: finish never reached it
