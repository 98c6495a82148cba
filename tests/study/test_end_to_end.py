"""datc-study end to end on the testbed (debug=fast, one-step runs, two schemes, the search's
limits narrowed for the test: the rule itself is tests/study/test_bracket.py's) through Hydra's
basic launcher, its joblib launcher and submitit's local executor."""

from __future__ import annotations

import json
import logging
import os

import pytest

import datc.study.protocol
import datc.training.job
from datc.compare import main as compare
from datc.study.cli import main as study

pytestmark = pytest.mark.slow
NARROW = {"rule": "bracket", "lr_exp": [0, 1], "knob_exp": [0, 1], "kl_tolerance": 0.05, "kl_max_rounds": 2}


def args(root, cache, schemes="grpo,datc_identity", stage="all", *extra):
    return ["--policy", "tiny_gpt2", "--data", "keywords", "--schemes", schemes, "--root", str(root), "--stage", stage,
            "--eval-draws", "0", "--eval-seeds", "200,201", "debug=fast", "trainer.steps=1", "trainer.threads=1",
            f"cache_dir={cache}", *extra]


def code(argv) -> int:
    with pytest.raises(SystemExit) as e:
        study(argv)
    return e.value.code


def log(folder) -> list[dict]:
    return [json.loads(x) for x in (folder / "study.jsonl").read_text().splitlines()]


def test_a_study_through_the_basic_launcher_runs_resumes_and_is_reported(prepared_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(datc.study.protocol, "SEARCH", NARROW)
    root = tmp_path / "tuned"
    folder = root / "keywords-tiny_gpt2"
    assert code(args(root, prepared_cache, stage="knob")) == 2  # the knob needs the rate search's runs first
    assert "the rate search is not complete (0 selection run(s) finished)" in capsys.readouterr().err
    real = datc.training.job.train_job

    def fail_one(cfg, run_dir, note=None):
        # a library that logs before the run directory is opened (vLLM does, on import): Hydra's job
        # log then exists in the run directory first, and must be the one a run directory may hold
        logging.getLogger("a.library").warning("logged on import")
        if "/eval/" in str(run_dir) and int(cfg.seed) == 201 and cfg.credit.name == "grpo":
            raise RuntimeError("a job that fails")
        return real(cfg, run_dir, note)

    monkeypatch.setattr(datc.training.job, "train_job", fail_one)
    assert code(args(root, prepared_cache)) == 1
    err = capsys.readouterr().err
    assert "grpo chosen draw 0 seed 201 failed" in err and "RuntimeError: a job that fails" in err
    assert "run the stage again: it resumes" in err
    assert len(list(folder.glob("select/*/summary.json"))) == 2 * 2 * 2 + 2  # rates x seeds x schemes, the other tau
    assert len(list(folder.glob("eval/*/summary.json"))) == 3  # the others finished
    monkeypatch.setattr(datc.training.job, "train_job", real)
    stamps = {p: p.stat().st_mtime_ns for p in folder.glob("*/*/metrics.jsonl")}
    assert code(args(root, prepared_cache)) == 0
    err = capsys.readouterr().err
    assert "stage eval, round 1: 1 to run (3 finished, skipped)" in err  # only the failed one
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert not list(folder.glob("*/*/checkpoints")) and not list(folder.glob("*/*/final"))  # finished: pruned
    assert all((p.parent / "train.log").is_file() for p in folder.glob("*/*/summary.json"))  # the job's log kept
    assert all(r["pid"] == os.getpid() for r in log(folder) if r.get("state"))  # basic: in this process
    m = json.loads((folder / "tuning.json").read_text())
    assert m["search"] == NARROW and m["schemes"]["datc_identity"]["knob"] == "credit.tau"
    compare(["--tuned", str(root), "--out", str(tmp_path / "out")])
    md = (tmp_path / "out" / "tuned.md").read_text()
    assert "| grpo | 2: ×1, ×2; " in md and "Search (METHOD §6, bracketing)" in md


def test_a_study_through_the_joblib_launcher_runs_two_at_a_time(prepared_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(datc.study.protocol, "SEARCH", NARROW)
    root = tmp_path / "tuned"
    assert code(args(root, prepared_cache, "grpo", "lr", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")) == 0
    rows = log(root / "keywords-tiny_gpt2")
    assert len(rows) == 4 and all(r["state"] == "finished" for r in rows)
    assert os.getpid() not in {r["pid"] for r in rows}  # loky workers
    assert all(r["job_id"].startswith("train_") for r in rows)
    assert code(args(root, prepared_cache, "grpo", "lr", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")) == 0
    assert "stage lr, round 1: 0 to run" in capsys.readouterr().err and len(log(root / "keywords-tiny_gpt2")) == 4


def test_a_study_through_submitits_local_executor_runs_each_job_in_its_own_process(prepared_cache, tmp_path, monkeypatch):
    monkeypatch.setattr(datc.study.protocol, "SEARCH", {**NARROW, "lr_exp": [0, 0]})  # one point: two jobs
    root = tmp_path / "tuned"
    assert code(args(root, prepared_cache, "grpo", "lr", "--batch-size", "2", "hydra/launcher=submitit_local")) == 0
    rows = log(root / "keywords-tiny_gpt2")
    assert len(rows) == 2 and all(r["state"] == "finished" for r in rows)
    assert len({r["pid"] for r in rows}) == 2 and os.getpid() not in {r["pid"] for r in rows}
    assert all(r["job_id"] and not r["job_id"].startswith("datc-study_") for r in rows)  # submitit's job id
    assert (root / "keywords-tiny_gpt2" / ".submitit").is_dir()
