"""W&B logging: run ids, grouping and tags, and the completions table with per-token credit."""

from __future__ import annotations

import json

import pytest
import torch

from datc.run.logger import completions_of, completions_table, job_type, run_tags


def test_completions_table_colours_each_token_by_its_weight(tok):
    import wandb  # a dependency of the package (pyproject.toml)
    ids = torch.tensor([tok.convert_tokens_to_ids(["sports", "ocean", "the", "<eos>"]),
                        tok.convert_tokens_to_ids(["music", "<eos>", "<pad>", "<pad>"])])
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    weights = torch.tensor([[2.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    c = completions_of(tok, ["write about food :"] * 2, ids, mask, torch.tensor([0.5, -0.5]), torch.tensor([0.7, -0.7]),
                       weights, n=8)
    assert c.tokens[1] == ["music", "<eos>"] and c.weights[1] == [1.0, 1.0]  # padding dropped
    table = completions_table(c)
    assert table.columns == ["prompt", "completion", "reward", "advantage", "credit", "weights"]
    row = table.data[0]
    assert row[2:4] == [0.5, pytest.approx(0.7)] and row[5] == "2.000 0.000 1.000 1.000"
    page = row[4]
    assert isinstance(page, wandb.Html)
    # w = 2 is the scale's top (red), w = 0 its bottom (blue), w = 1 white
    cells = page.html.split("<span")[1:]
    assert "background:#b2182b" in cells[0] and "background:#2166ac" in cells[1] and "background:#ffffff" in cells[2]
    assert 'title="w = 2.0000"' in cells[0] and ">sports</span>" in cells[0]


def test_wandb_job_type_and_tags_slice_a_sweep():
    config = {"credit": {"name": "datc"}, "data": {"name": "keywords"}, "policy": {"name": "tiny_gpt2"},
              "deepspeed": {"name": "zero2"}, "seed": 1}
    assert job_type(config) == "datc"
    assert run_tags(config) == ["credit:datc", "data:keywords", "policy:tiny_gpt2", "deepspeed:zero2", "seed:1"]


@pytest.mark.slow
def test_an_offline_run_logs_the_completions_table_at_each_eval(cache_dir, tmp_path, monkeypatch):  # noqa: F811
    from datc.training.trainer import train
    from tests.helpers.testbed import cfg_for

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    train(cfg_for(cache_dir, run, "logger=wandb", "credit=datc"))
    [offline] = (run / "wandb").glob("offline-run-*")
    # The W&B run id is the one drawn for this run directory (run.json), not the config hash.
    ids = json.loads((run / "run.json").read_text())
    assert offline.name.endswith(ids["wandb_id"]) and ids["wandb_id"] != ids["run_id"]
    tables = sorted((offline / "files" / "media" / "table" / "rollout").glob("completions_*.table.json"))
    assert [int(p.name.split("_")[1]) for p in tables] == [2, 3]  # debug=fast evaluates at steps 2 and 3
    for p in tables:
        t = json.loads(p.read_text())
        assert t["columns"] == ["prompt", "completion", "reward", "advantage", "credit", "weights"]
        assert len(t["data"]) == 8  # logger.log_samples
        for prompt, *_, weights in t["data"]:
            w = [float(x) for x in weights.split()]
            assert prompt.startswith("write about") and all(x >= 0 for x in w)
            assert sum(w) / len(w) == pytest.approx(1.0, abs=1e-3)  # datc: mean 1 over each response
        group = [row[3] for row in t["data"][:4]]  # debug=fast: groups of 4
        assert sum(group) == pytest.approx(0.0, abs=1e-4)  # group advantages are centred
