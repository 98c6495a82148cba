"""Every config composes and validates; bad values stop with one message naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from datc.checks import validate
from datc.config import ConfigError
from datc.paths import CONFIG_DIR
from tests.helpers.testbed import HAS_VLLM, compose_train

# Every config group, read from configs/ (a folder of YAML options), so a new group is composed too.
# hydra/ holds Hydra's own settings (launcher, sweep dirs), not a group a run chooses.
GROUPS = sorted(p.name for p in Path(CONFIG_DIR).iterdir() if p.is_dir() and p.name != "hydra")
# Options that need a path the user must supply (no model is bundled for them).
NEEDS_PATH = {("policy", "pretrained"): "policy.path=/some/dir", ("reward", "pretrained"): "reward.path=/some/dir",
              # a real prompt dataset has no gold reward to train a testbed reward model on, nor a task to
              # warm-start the testbed policy on (the warm start failed with an AttributeError)
              ("data", "ultrafeedback"): ["reward=skywork_v2_qwen3_1_7b", "policy=qwen3_1_7b"],
              ("data", "hh_rlhf"): ["reward=skywork_v2_qwen3_1_7b", "policy=qwen3_1_7b"],
              ("backend", "deepspeed"): "deepspeed=zero2"}  # the stage is the deepspeed group's (refused without it)


def _options(group: str) -> list[str]:
    root = Path(CONFIG_DIR) / group
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))  # experiment/paper/* too


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_option_composes_and_validates(group, option):
    overrides = [f"{group}={option}"]
    if (group, option) in NEEDS_PATH:
        extra = NEEDS_PATH[(group, option)]
        overrides += extra if isinstance(extra, list) else [extra]
    cfg = compose_train(overrides)
    if (group, option) == ("rollout", "vllm") and not HAS_VLLM:  # composes; refused in one line where vLLM is missing
        with pytest.raises(ConfigError, match=r"^rollout.name: vllm is not installed in this environment; "):
            validate(cfg)
        return
    validate(cfg)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves


def test_the_groups_are_read_from_the_config_tree():
    assert {"policy", "reward", "credit", "data", "trainer", "logger", "deepspeed", "rollout", "experiment", "debug"} <= set(GROUPS)


def test_every_field_has_a_comment():
    for path in Path(CONFIG_DIR).rglob("*.yaml"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            s = line.split("#")[0].strip()
            if not s or s.startswith("-") or s.endswith(":"):  # blank, list items, block headers
                continue
            assert "#" in line, f"{path.relative_to(CONFIG_DIR)}:{n} has no comment: {line!r}"


@pytest.mark.parametrize(
    "override,field,hint",
    [
        ("trainer.lr=-1", "trainer.lr", "> 0"),
        ("trainer.num_generations=1", "trainer.num_generations", ">= 2"),
        ("trainer.max_new_tokens=0", "trainer.max_new_tokens", "> 0"),
        ("trainer.batch_size=60", "trainer.batch_size", "multiple of 8"),
        ("trainer.mini_batch_size=48", "trainer.mini_batch_size", "must divide"),
        ("trainer.loss_agg=mean", "trainer.loss_agg", "token-mean, seq-mean-token-mean"),
        ("trainer.scale_rewards=std", "trainer.scale_rewards", "group, batch, none"),
        ("trainer.decode=graph", "trainer.decode", "auto, dynamic, static"),
        ("trainer.decode_sync_every=0", "trainer.decode_sync_every", "> 0"),
        ("credit.name=nope", "credit.name", "grpo"),
        ("+trainer.learning_rate=1e-3", "trainer.learning_rate", "valid keys of trainer"),
        ("trainer.steps=many", "trainer.steps", "steps"),
        ("data.task=nope", "data.task", "arithmetic, keywords"),
        ("+credit.tau=2", "credit", "valid fields"),
        ("reward.rules=[{name:nope,weight:1}]", "reward.rules[0].name", "gold, length, truncated"),
    ],
)
def test_bad_values_name_the_field_and_the_choices(override, field, hint):
    with pytest.raises(ConfigError) as e:
        validate(compose_train([override]))
    msg = str(e.value)
    assert msg.startswith(field), msg
    assert hint in msg, msg
    assert "\n" not in msg


def test_credit_scheme_is_the_registry_key_and_name_the_label():
    from datc.credit import CREDIT_SCHEMES

    c = validate(compose_train(["credit=datc_unsigned", "credit.name=my_label"]))
    assert (c.credit["name"], c.credit["scheme"]) == ("my_label", "datc")  # the label changes, the scheme does not
    assert c.run_name.startswith("keywords-tiny_gpt2-my_label-s0-")
    with pytest.raises(ConfigError) as e:
        validate(compose_train(["credit=datc_unsigned", "credit.scheme=nope"]))
    assert str(e.value) == ("credit.scheme: 'nope' is not a registered credit scheme; choose one of "
                            f"{', '.join(CREDIT_SCHEMES.names())} or give a _target_")


def test_cli_bad_value_is_one_clear_line_and_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "datc.train", "trainer.num_generations=1", f"run_dir={tmp_path}/r"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "trainer.num_generations: must be >= 2" in r.stderr
    assert "Traceback" not in r.stderr
    written = {p.name for p in (tmp_path / "r").iterdir()} if (tmp_path / "r").exists() else set()
    assert written <= {".hydra", "train.log"}  # stopped before the run directory was opened


def test_cli_unknown_credit_scheme_stops_before_any_model_loads(tmp_path):
    r = subprocess.run([sys.executable, "-m", "datc.train", "credit=datc_identity", "credit.scheme=nope",
                        f"run_dir={tmp_path}/r", f"cache_dir={tmp_path}/cache"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "credit.scheme: 'nope' is not a registered credit scheme; choose one of datc, datc_magnitude" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "cache").exists()  # nothing prepared or loaded
    written = {p.name for p in (tmp_path / "r").iterdir()} if (tmp_path / "r").exists() else set()
    assert written <= {".hydra", "train.log"}


def test_cli_unknown_group_option_lists_the_choices(tmp_path):
    r = subprocess.run([sys.executable, "-m", "datc.train", "credit=nope", f"run_dir={tmp_path}/r"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("datc-train: credit=nope: no such option in credit/") and "grpo" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_default_cache_is_the_env_then_a_checkouts_own_then_the_users(tmp_path, monkeypatch):
    # DATC_CACHE wins; else an existing ./.cache/datc (the earlier default: a checkout's cache
    # keeps working); else the user's cache folder, so a run from any folder finds one cache.
    from datc.paths import default_cache_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DATC_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "datc")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == str(tmp_path / "xdg" / "datc")
    (tmp_path / ".cache" / "datc").mkdir(parents=True)
    assert default_cache_dir() == ".cache/datc"
    monkeypatch.setenv("DATC_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == str(tmp_path / "mine")
    # and the composed config reads it (configs/train.yaml: ${datc.cache_dir:})
    (tmp_path / ".cache" / "datc").rmdir()
    monkeypatch.delenv("DATC_CACHE")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train")
    assert cfg.cache_dir == str(tmp_path / "xdg" / "datc")
    assert validate(cfg).cache_dir == str(tmp_path / "xdg" / "datc")
