"""Run names tell apart runs whose configs differ; W&B ids are one per run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from datc.checks import validate
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


RECORD = (Path(__file__).resolve().parents[2] / "results" / "tuned" / "records" / "keywords-tiny_gpt2" / "select"
          / "keywords-tiny_gpt2-datc-p0-s100-464ff1")  # a run recorded before rollout.vllm had its node


def _identity(*overrides: str) -> dict:
    from omegaconf import OmegaConf

    from datc.config import TrainConfig
    from datc.run.identity import identity

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides))
    plain = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(TrainConfig), {k: cfg[k] for k in cfg if k != "hydra"}),
                                   resolve=True)
    return identity(plain)


def test_the_vllm_node_keeps_every_run_identity():
    """rollout.vllm.* sat in rollout itself before: a run's identity (and so its name and its
    resume) is the one it had, for the built-in engine and for vLLM; an old config still validates."""
    from datc.run.identity import identity

    old = json.loads((RECORD / "run.json").read_text())["identity"]["rollout"]
    assert "enforce_eager" in old and "vllm" not in old
    assert _identity()["rollout"] == old  # the run name's path: through the schema
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        resolved = _resolved(compose(config_name="train"))  # the run id's path: the config as composed
    assert "vllm" not in resolved["rollout"] and identity(resolved)["rollout"] == old
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        resolved = _resolved(compose(config_name="train", overrides=["rollout=vllm"]))
    assert identity(resolved)["rollout"] == {**old, "name": "vllm", "correction": "token_truncate"}
    assert _identity("rollout=vllm", "rollout.vllm.enforce_eager=true")["rollout"] == {
        **old, "name": "vllm", "correction": "token_truncate", "enforce_eager": True}
    # oneDNN's cache bound changes memory, not a number: never in the identity, whatever its value
    assert _identity("rollout=vllm", "rollout.vllm.onednn_cache_capacity=0")["rollout"] == \
        _identity("rollout=vllm", "rollout.vllm.onednn_cache_capacity=null")["rollout"] == {
        **old, "name": "vllm", "correction": "token_truncate"}
    # nor whether the engine trims the heap after each generation
    assert _identity("rollout=vllm", "rollout.vllm.trim_heap=false")["rollout"] == _identity("rollout=vllm")["rollout"]
    from omegaconf import OmegaConf

    recorded = OmegaConf.load(RECORD / "config.yaml")  # flat rollout keys
    assert recorded.rollout.dtype == "auto"
    recorded.rollout.dtype = "float32"
    c = validate(recorded)
    assert c.rollout.vllm.dtype == "float32" and not hasattr(c.rollout, "dtype")


def test_a_lora_run_is_marked_in_its_name_and_a_full_policy_run_keeps_its_name():
    from hydra import compose, initialize_config_dir

    from datc.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        full = compose(config_name="train").run_name
        lora = compose(config_name="train", overrides=["policy.lora.r=16"]).run_name
        real = compose(config_name="train", overrides=["experiment=real_smollm2", "policy.lora.r=8"]).run_name
    assert full.startswith("keywords-tiny_gpt2-grpo-s0-")  # as it always was
    assert lora.startswith("keywords-tiny_gpt2-lora16-grpo-s0-") and real.startswith("real-reviews-smollm2_135m-lora8-grpo-")


def test_a_field_a_run_leaves_at_its_default_is_labelled_with_the_default():
    from datc.report.grouping import split_by_config
    from datc.report.loading import Run

    def run(seed, config):
        return Run(run_name=f"r{seed}", run_id=f"i{seed}", source=f"r{seed}", data="keywords", policy="tiny_gpt2",
                   credit="grpo", seed=seed, steps=10, final_gold=0.1, gold_auc=None, final_rm_score=None, final_kl=None,
                   credit_accuracy=None, step_s=None, wall_time_s=None, git_commit=None, curve=(), mtime=0.0,
                   config=config)

    full = {"seed": 0, "trainer": {"lr": 1e-3}}
    lora = {"seed": 0, "trainer": {"lr": 1e-3}, "policy": {"lora": {"r": 16}}}
    out = split_by_config([run(0, full), run(1, lora)])
    assert sorted(r.variant for r in out.runs) == ["policy.lora.r=0", "policy.lora.r=16"], out.warnings
