"""scripts/tuned_sweep.py end to end on the testbed with debug=fast and one-step runs: the three
stages, a batch run again that redoes nothing, and datc-compare --tuned reading the result."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import scripts.tuned_sweep
from datc.compare import main as compare
from scripts.tuned_sweep import main as tuned_sweep
from tests import cli

pytestmark = pytest.mark.slow


def test_the_sweep_runs_its_stages_resumes_and_is_reported(cache_dir, tmp_path, capsys, monkeypatch):
    # each stage's `datc-train -m` grid forked from the command server (tests/cli.py): a process of its own
    monkeypatch.setattr(scripts.tuned_sweep, "subprocess", SimpleNamespace(run=lambda cmd: cli.run(cmd, timeout=900)))
    root = tmp_path / "tuned"
    args = ["--policy", "tiny_gpt2", "--data", "keywords", "--schemes", "datc_identity", "--root", str(root),
            "--eval-draws", "0", "--eval-seeds", "200,201", "debug=fast", "trainer.steps=1", "trainer.eval_every=1",
            f"cache_dir={cache_dir}"]
    # the knob search needs the rate search's runs first: refused in one line, nothing run
    assert tuned_sweep([*args, "--stage", "knob"]) == 2
    assert "the rate search is not complete (0 selection run(s) finished)" in capsys.readouterr().err
    assert tuned_sweep([*args, "--stage", "all"]) == 0
    folder = root / "keywords-tiny_gpt2"
    select = sorted(p.parent for p in (folder / "select").glob("*/summary.json"))
    assert len(select) == 3 * 2 + 2 * 2  # rates x seeds, then the two other taus x seeds
    m = json.loads((folder / "tuning.json").read_text())
    assert m["schemes"]["datc_identity"]["knob"] == "credit.tau"
    rows = [json.loads(x) for x in (select[0] / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "rollout/response_len" in r]
    assert train and train[0]["rollout/length_collapse"] in (0, 1) and "rollout/first_token_end_frac" in train[0]
    assert "length_collapse" in json.loads((select[0] / "summary.json").read_text())
    assert not list(folder.glob("*/*/checkpoints")) and all((d / "final").is_dir() for d in select)  # finished: pruned
    # a batch again: every run is found finished, none retrained
    stamps = {p: p.stat().st_mtime_ns for p in folder.glob("*/*/metrics.jsonl")}
    assert tuned_sweep([*args, "--stage", "lr"]) == 0
    assert {p: p.stat().st_mtime_ns for p in folder.glob("*/*/metrics.jsonl")} == stamps
    # a protocol change in the same folder is refused
    assert tuned_sweep([*args[:-5], "201,202", *args[-4:], "--stage", "lr"]) == 2
    capsys.readouterr()
    compare(["--tuned", str(root), "--out", str(tmp_path / "out")])
    md = (tmp_path / "out" / "tuned.md").read_text()
    assert "| datc_identity | lr " in md and "draw 0: 200, 201" in md
    evaluated = json.loads((tmp_path / "out" / "evaluation" / "report.json").read_text())
    assert [tuple(r["seeds"]) for r in evaluated["rows"]] == [(200, 201)]
