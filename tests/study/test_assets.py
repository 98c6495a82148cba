"""A study resumed on another machine is refused before its first run where that machine prepares
other files than its finished runs trained on (another reward model: every new run another study's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from datc.study import assets
from datc.study.cli import main as study
from datc.study.protocol import Refused

RECORDS = Path(__file__).resolve().parents[2] / "results" / "tuned" / "records"


def _run(folder: Path, name: str, draw: int, reward: str, done: bool = True) -> None:
    run = folder / "select" / name
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"identity": {"prepare_seed": draw}}))
    (run / "inputs.json").write_text(json.dumps({"version": 1, "inputs": {
        "reward": {"path": "/elsewhere/reward", "files": {"model.safetensors": {"sha256": reward, "size": 1}}},
        "data": {"path": "/elsewhere/data", "files": {"train.jsonl": {"sha256": "d" * 64, "size": 1}}}}}))
    if done:
        (run / "summary.json").write_text("{}")


def test_the_finished_runs_files_are_compared_per_draw_and_a_difference_named(tmp_path):
    _run(tmp_path, "a", 0, "a" * 64)
    _run(tmp_path, "b", 1, "b" * 64)
    _run(tmp_path, "c", 2, "c" * 64, done=False)  # still running: its draw is not checked
    (tmp_path / "select" / "d").mkdir()  # no records at all: passed over
    (tmp_path / "select" / "d" / "summary.json").write_text("{}")
    assert {d: h["reward/model.safetensors"][0] for d, (_, h) in assets.finished_assets(tmp_path).items()} == {0: "a", 1: "b"}
    drawn, said = [], []
    same = {0: "a" * 64, 1: "b" * 64}
    assets.check_assets(tmp_path, lambda d: drawn.append(d) or d,
                        lambda d: {"reward/model.safetensors": same[d], "data/train.jsonl": "d" * 64}, said.append)
    assert drawn == [0, 1] and len(said) == 2 and "2 compared" in said[0]
    with pytest.raises(Refused, match=r"draw 1, e.g. select/b\): reward/model.safetensors eeeeeeeeeeee != bbbbbbbbbbbb"):
        assets.check_assets(tmp_path, lambda d: d,
                            lambda d: {"reward/model.safetensors": same[d] if d == 0 else "e" * 64}, said.append)


def test_datc_study_refuses_before_its_first_run_on_other_prepared_files(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "keywords-tiny_gpt2"
    shutil.copytree(RECORDS / "keywords-tiny_gpt2", folder)
    for run in folder.glob("eval/*-grpo-*-s202-*"):  # GRPO's evaluation at seed 202 to do
        shutil.rmtree(run)
    landed = next(iter(assets.finished_assets(folder).values()))[1]
    other = {**landed, "reward/model.safetensors": "f" * 64}
    monkeypatch.setattr(assets, "prepared_assets", lambda cfg: other if cfg.prepare_seed == 0 else landed)
    from datc.study.launch import StudyLauncher

    monkeypatch.setattr(StudyLauncher, "launch", lambda self, jobs: pytest.fail("a run was started"))
    m = json.loads((folder / "tuning.json").read_text())
    with pytest.raises(SystemExit) as e:
        study(["--policy", "tiny_gpt2", "--data", "keywords", "--root", str(tmp_path), "--schemes", ",".join(m["schemes"]),
               "--stage", "eval", "trainer.threads=1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "this machine prepares other files than the study's finished runs" in err, err
    assert "reward/model.safetensors ffffffffffff" in err


def test_a_cache_folder_other_than_the_one_in_the_finished_runs_names_is_refused(tmp_path):
    from types import SimpleNamespace

    _run(tmp_path, "a", 0, "a" * 64)
    run = tmp_path / "select" / "a"
    (run / "run.json").write_text(json.dumps({"identity": {"prepare_seed": 0, "policy": {"path": "/c1/wheels/w"}}}))
    (run / "config.yaml").write_text("cache_dir: /c1\n")
    assert assets.cache_in_names(tmp_path) == ("select/a", "/c1", "policy.path")
    files = {"reward/model.safetensors": "a" * 64}
    with pytest.raises(Refused, match=r"cache folder /c1 \(policy.path in select/a's identity\) and this study's "
                                      r"cache folder is /c2: .*Set DATC_CACHE=/c1"):
        assets.check_assets(tmp_path, lambda d: SimpleNamespace(cache_dir="/c2"), lambda cfg: pytest.fail("prepared"))
    said = []
    assets.check_assets(tmp_path, lambda d: SimpleNamespace(cache_dir="/c1"), lambda cfg: files, said.append)
    assert "1 compared" in said[0]
    (run / "config.yaml").write_text("cache_dir: /c3\n")  # a name that holds no path inside its cache folder
    assert assets.cache_in_names(tmp_path) is None
    assets.check_assets(tmp_path, lambda d: SimpleNamespace(cache_dir="/c2"), lambda cfg: files, said.append)
