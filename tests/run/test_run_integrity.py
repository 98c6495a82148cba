"""A run's files changing under its feet: a model, tokenizer or data file replaced between a kill
and the resume, ``config.yaml`` edited after the run, ``run.json`` deleted, garbage appended to
a finished run's metrics. Each test fails on the code before these guards."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from datc.config import ConfigError
from datc.run.fingerprint import changes, fingerprints
from tests.helpers.testbed import cfg_for

OVERRIDES = ("trainer.steps=4", "trainer.checkpoint_every=2", "trainer.eval_every=2")


# ---- fingerprints ---------------------------------------------------------------------------------


def test_fingerprints_see_content_not_times_for_small_files(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}')
    (d / "warm_start.json").write_text('{"seconds": 1}')  # a record of how it was made: not read
    before = fingerprints({"policy": str(d), "reward": None, "data": "some/hub-dataset"})
    assert set(before["inputs"]) == {"policy"}  # unset inputs and hub ids are left out
    assert set(before["inputs"]["policy"]["files"]) == {"config.json"}
    os.utime(d / "config.json", ns=(1, 1))  # a copy or a rebuilt cache entry: same bytes
    (d / "warm_start.json").write_text('{"seconds": 2}')
    assert changes(before, fingerprints({"policy": str(d)})) == []
    moved = tmp_path / "elsewhere"
    shutil.copytree(d, moved)  # the same files reached by another path
    assert changes(before, fingerprints({"policy": str(moved)})) == []
    (d / "config.json").write_text('{"a": 2}')
    assert changes(before, fingerprints({"policy": str(d)})) == [
        f"policy: {d / 'config.json'} changed content (same size, another hash)"]
    (d / "extra.bin").write_bytes(b"x")
    assert f"policy: {d / 'extra.bin'} is new" in changes(before, fingerprints({"policy": str(d)}))


def test_a_large_file_is_hashed_at_its_edges_and_its_time_counts(tmp_path, monkeypatch):
    import datc.run.fingerprint as fp

    monkeypatch.setattr(fp, "WHOLE_HASH_BYTES", 64)
    monkeypatch.setattr(fp, "EDGE_BYTES", 16)
    f = tmp_path / "weights.bin"
    f.write_bytes(bytes(range(200)))
    before = fingerprints({"reward": str(f)})
    assert before["inputs"]["reward"]["files"]["weights.bin"]["hashed"] == "edges"
    f.write_bytes(bytes(range(100)) + b"\xff" + bytes(range(101, 200)))  # the middle, same size
    now = fingerprints({"reward": str(f)})
    os.utime(f, ns=(before["inputs"]["reward"]["files"]["weights.bin"]["mtime_ns"] + 10**9,) * 2)
    now = fingerprints({"reward": str(f)})
    assert changes(before, now) == [f"reward: {f} was modified (its time changed; only its first and last 4 MiB are hashed)"]


# ---- a resume after an input changed --------------------------------------------------------------


@pytest.fixture(scope="module")
def own_cache(prepared_cache, tmp_path_factory):
    """A copy of the session's prepared cache, so its files can be changed."""
    out = tmp_path_factory.mktemp("own") / "cache"
    shutil.copytree(prepared_cache, out)
    return out


def _killed_after_step_2(cache, tmp_path, finished_run=None):
    """A 4-step run as a kill after its step-2 checkpoint leaves it: trained here, or a copy of
    ``finished_run`` (the same command's finished run) with what the kill would not have written
    removed."""
    from datc.training.trainer import train

    run = tmp_path / "run"
    if finished_run is None:
        train(cfg_for(cache, run, *OVERRIDES))
    else:
        shutil.copytree(finished_run, run)
    for p in ("summary.json", "final", "checkpoints/step_0000004"):
        shutil.rmtree(run / p) if (run / p).is_dir() else (run / p).unlink()
    return run


@pytest.mark.slow
def test_a_resume_refuses_when_the_reward_model_or_the_data_changed(own_cache, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    from datc.training.trainer import train

    cache = tmp_path / "cache"
    shutil.copytree(own_cache, cache)
    run = _killed_after_step_2(cache, tmp_path)
    inputs = json.loads((run / "inputs.json").read_text())["inputs"]
    assert set(inputs) == {"policy", "reward", "tokenizer", "data"}

    def recorded(label: str, name: str) -> Path:  # the run's own file (the cache may hold other draws' too)
        path = Path(inputs[label]["path"])
        return path / name if path.is_dir() else path

    rm_weights = recorded("reward", "model.safetensors")
    original = rm_weights.read_bytes()
    state = load_file(rm_weights)
    save_file({k: v + 0.01 for k, v in state.items()}, rm_weights, metadata={"format": "pt"})  # another reward model
    with pytest.raises(ConfigError) as e:
        train(cfg_for(cache, run, *OVERRIDES))
    assert str(e.value).startswith(f"trainer.accept_changed_inputs: {run} was started with other inputs: reward: {rm_weights} ")
    assert "trainer.accept_changed_inputs=true" in str(e.value)
    assert not (run / "summary.json").exists()

    rm_weights.write_bytes(original)  # restored: the same bytes resume (its time moved, its content did not)
    data = recorded("data", "train.jsonl")
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[1:] + lines[:1]))  # the same prompts in another order
    with pytest.raises(ConfigError, match=f"data: {data} changed content"):
        train(cfg_for(cache, run, *OVERRIDES))

    # fingerprints that cannot be read prove nothing: the resume refuses as for a change
    (run / "inputs.json").unlink()
    with pytest.raises(ConfigError, match=r"^trainer.accept_changed_inputs: .* cannot be checked: its inputs.json is missing"):
        train(cfg_for(cache, run, *OVERRIDES))
    (run / "inputs.json").write_text('{"inputs": {"policy": ')
    with pytest.raises(ConfigError, match=r"cannot be checked: its inputs.json is damaged, so nothing says the models"):
        train(cfg_for(cache, run, *OVERRIDES))

    with caplog.at_level("WARNING", logger="datc.training.lifecycle"):
        summary = train(cfg_for(cache, run, *OVERRIDES, "trainer.accept_changed_inputs=true"))  # deliberate
    assert any("resuming" in r.getMessage() and "could not be checked" in r.getMessage() for r in caplog.records)
    assert summary["steps"] == 4  # the acceptance is on record: run.json and the summary
    said = ["inputs.json is damaged: the inputs could not be checked"]
    assert summary["accepted_input_changes"] == said
    assert json.loads((run / "run.json").read_text())["accepted_input_changes"] == said
    recorded = json.loads((run / "inputs.json").read_text())  # now the new inputs
    assert changes(recorded, fingerprints({k: v["path"] for k, v in recorded["inputs"].items()})) == []


@pytest.mark.slow
def test_a_resume_with_unchanged_inputs_equals_an_uninterrupted_run(own_cache, tmp_path):
    from datc.training.trainer import train
    from tests.helpers.runs import comparable, metric_rows

    cache = tmp_path / "cache"
    shutil.copytree(own_cache, cache)
    full = train(cfg_for(cache, tmp_path / "full", *OVERRIDES))
    run = _killed_after_step_2(cache, tmp_path, tmp_path / "full")
    for p in Path(cache).rglob("*"):  # every file touched (as a copy or `cp -r` of the cache would)
        if p.is_file():
            os.utime(p)
    assert train(cfg_for(cache, run, *OVERRIDES))["eval"]["final"] == full["eval"]["final"]
    assert comparable(metric_rows(run)) == comparable(metric_rows(tmp_path / "full"))


# ---- a finished run's files edited or deleted -----------------------------------------------------


@pytest.fixture(scope="module")
def finished(own_cache, tmp_path_factory):
    from datc.training.trainer import train

    run = tmp_path_factory.mktemp("finished") / "run"
    return run, train(cfg_for(own_cache, run, *OVERRIDES))


def _copy(finished, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(finished[0], run)
    return run


@pytest.mark.slow
def test_an_edited_config_yaml_is_said_and_restored_and_export_refuses_it(own_cache, finished, tmp_path, capfd):
    from datc.commands.export import main as export_main
    from datc.training.trainer import train

    run = _copy(finished, tmp_path)
    original = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(original.replace("steps: 4", "steps: 80", 1))
    assert export_main([str(run), "--out", str(tmp_path / "x")]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"datc-export: {run / 'config.yaml'} was edited: it differs from run.json at trainer.steps, ")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x").exists()

    summary = train(cfg_for(own_cache, run, *OVERRIDES))  # the same command again
    err = capfd.readouterr().err
    assert "was edited: it differs from run.json at trainer.steps; rewritten" in err
    assert "already holds this run, finished" in err
    assert summary == finished[1]
    assert "steps: 80" not in (run / "config.yaml").read_text()  # this run's config again (run_dir: the copy's)
    assert export_main([str(run), "--out", str(tmp_path / "x")]) == 0


@pytest.mark.slow
def test_a_deleted_run_json_is_rebuilt_from_this_runs_config_yaml(own_cache, finished, tmp_path, capfd):
    from datc.training.trainer import train

    run = _copy(finished, tmp_path)
    identity = json.loads((run / "run.json").read_text())["identity"]
    (run / "run.json").unlink()
    with pytest.raises(ConfigError, match="has no run.json, and its config.yaml is another run's .it differs at trainer.lr"):
        train(cfg_for(own_cache, run, *OVERRIDES, "trainer.lr=1e-3"))
    assert not (run / "run.json").exists()
    capfd.readouterr()
    assert train(cfg_for(own_cache, run, *OVERRIDES)) == finished[1]
    assert "run.json was missing; rebuilt from config.yaml" in capfd.readouterr().err
    assert json.loads((run / "run.json").read_text())["identity"] == identity


@pytest.mark.slow
def test_garbage_in_a_finished_runs_metrics_is_said(own_cache, finished, tmp_path, capfd):
    from datc.training.trainer import train

    run = _copy(finished, tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write("\x00\x00 garbage\n")
    n = (run / "metrics.jsonl").read_text().count("\n")
    capfd.readouterr()
    assert train(cfg_for(own_cache, run, *OVERRIDES)) == finished[1]
    assert f"metrics.jsonl: unreadable line(s) {n} in a finished run" in capfd.readouterr().err


@pytest.mark.slow
def test_a_resumed_run_says_from_which_step_and_logs_each_step_without_a_bar(own_cache, finished, tmp_path, capfd,
                                                                            caplog):
    import logging

    from datc.training.trainer import train

    run = _killed_after_step_2(own_cache, tmp_path, finished[0])
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="datc.training.trainer"):
        train(cfg_for(own_cache, run, *OVERRIDES))  # debug=fast: trainer.progress=false
    assert f"datc: resumed {run} from its checkpoint of step 2 of 4" in capfd.readouterr().err
    steps = [r.getMessage().split(":")[0] for r in caplog.records if r.getMessage().startswith("step ") and "/" in r.getMessage()]
    assert steps == ["step 3/4", "step 4/4"]


@pytest.mark.slow
def test_the_logged_learning_rate_is_the_one_the_step_used(own_cache, tmp_path, capfd):
    # debug=fast: one optimizer update per step. constant_with_warmup over 4 updates: step 1 uses
    # lr * 0/4 = 0, step 2 lr * 1/4 (the log showed the next step's, which hid the zero).
    from datc.training.trainer import train
    from tests.helpers.runs import metric_rows

    train(cfg_for(own_cache, tmp_path / "r", "trainer.steps=2", "trainer.warmup_steps=4", "trainer.lr=0.01"))
    lrs = [r["loss/lr"] for r in metric_rows(tmp_path / "r") if "loss/lr" in r]
    assert lrs == [0.0, pytest.approx(0.0025)]
    capfd.readouterr()
    train(cfg_for(own_cache, tmp_path / "one", "trainer.steps=1", "trainer.warmup_steps=4"))
    assert "trainer.steps=1: a warm-up's first optimizer update has learning rate 0" in capfd.readouterr().err
