"""Run names tell apart runs whose configs differ; W&B ids are one per run directory."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from datc.config import validate
from datc.paths import CONFIG_DIR
from datc.run.rundir import RunDir, release_run_locks
from datc.training.lifecycle import resolved_config as _resolved


def _name(*overrides: str) -> str:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides))
    name = cfg.run_name
    assert validate(cfg).run_name == name  # the same before and after the schema merge
    return name


def test_runs_whose_configs_differ_get_different_names():
    base = _name()
    assert base.startswith("keywords-tiny_gpt2-grpo-s0-") and len(base.rsplit("-", 1)[1]) == 6
    differ = {o: _name(o) for o in ("debug=fast", "deepspeed=zero2", "deepspeed=zero3", "experiment=sparse_llama",
                                    "trainer.steps=101", "prepare_seed=1")}
    assert base not in differ.values() and len(set(differ.values())) == len(differ), differ
    assert _name("debug=fast", "deepspeed=zero2") not in (differ["debug=fast"], differ["deepspeed=zero2"])
    # Settings that do not change what a run computes keep its name (and so resume it).
    for same in ("trainer.threads=1", "logger=wandb", "trainer.progress=false", "experiment=demo", "trainer.resume=never",
                 "trainer.decode=static", "trainer.decode_sync_every=1"):
        assert _name(same) == base, same
    assert _name("trainer.lr=1e-4") == _name("trainer.lr=0.0001")  # values, not spellings


def test_the_name_hash_follows_the_run_identity(tmp_path):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["debug=fast"])
    a = RunDir.open(tmp_path / "a", _resolved(cfg), "auto")
    b = RunDir.open(tmp_path / "b", _resolved(cfg), "auto")
    assert a.run_id == b.run_id  # the same config ...
    assert a.wandb_id != b.wandb_id  # ... in two directories: two W&B runs
    a.lock.release()  # the run in "a" ends (its process would release the lock on exit)
    again = RunDir.open(tmp_path / "a", _resolved(cfg), "auto")
    assert again.resumable and again.wandb_id == a.wandb_id  # a resumed run continues its W&B run
    assert json.loads((tmp_path / "a" / "run.json").read_text())["wandb_id"] == a.wandb_id
    release_run_locks()


@pytest.mark.parametrize("preset", ["qwen3_ultrafeedback", "llama32_hh_rlhf"])
def test_paper_presets_are_named_with_their_hash(preset):
    name = _name(f"experiment=paper/{preset}")
    assert name.startswith("paper-") and name != _name(f"experiment=paper/{preset}", "deepspeed=zero3")
