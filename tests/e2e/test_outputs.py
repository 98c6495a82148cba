"""Running things never dirties the checkout: default outputs go under the git-ignored runs/
(run directories, the memory plan, heatmaps); committed results are written only when an
output path in results/ is given on purpose."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from datc.paths import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[2]


def _ignored(path: str) -> bool:
    """Whether git ignores ``path`` (relative to the checkout)."""
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0


def test_default_outputs_are_git_ignored():
    for path in ("runs/keywords-tiny_gpt2-grpo-s0-ca33da/summary.json", "runs/memory/presets.md",
                 "runs/heatmaps/keywords-tiny_gpt2.png", "runs/credit_accuracy/keywords-tiny_gpt2.json",
                 "runs/multirun/x/final/model.safetensors"):
        assert _ignored(path), path
    assert not _ignored("results/demo/x.json")  # the committed copy is written only on purpose


def test_the_demo_writes_only_its_run_directory():
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        demo = compose(config_name="train", overrides=["experiment=demo"])
        published = compose(config_name="train", overrides=["experiment=demo", "results_dir=results/demo"])
    assert demo.results_dir is None and demo.run_dir.startswith("runs/")
    assert published.run_name == demo.run_name  # `make demo-results` reuses (or returns) the demo's run
    makefile = (ROOT / "Makefile").read_text()
    assert "\t$(BIN)/datc-train experiment=demo\n" in makefile
    assert "\t$(BIN)/datc-train experiment=demo results_dir=results/demo\n" in makefile


def test_memory_plan_writes_under_runs_by_default(tmp_path, monkeypatch):
    from datc.memory import plan as memory_plan
    monkeypatch.chdir(tmp_path)
    memory_plan.main(["--presets", "llama32_ultrafeedback"])
    assert (tmp_path / "runs" / "memory" / "presets.md").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


@pytest.mark.slow
def test_results_dir_is_written_for_a_finished_run_too(cache_dir, tmp_path):  # noqa: F811
    import json

    from datc.training.trainer import train
    from tests.helpers.testbed import cfg_for

    run = tmp_path / "run"
    summary = train(cfg_for(cache_dir, run))
    assert not (tmp_path / "results").exists()
    again = train(cfg_for(cache_dir, run, f"results_dir={tmp_path}/results"))  # finished: nothing retrained
    assert again == summary
    [published] = (tmp_path / "results").glob("keywords-tiny_gpt2-grpo-s0-*.json")
    assert json.loads(published.read_text()) == summary
