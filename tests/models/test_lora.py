"""LoRA policies (``policy.lora``, :mod:`datc.models.lora`): validated before training; the reference is
the policy with its adapters disabled, equal to a separately loaded base model, and no second
model is loaded; only the adapters train (every one of them) and the checkpoints hold them and
their optimizer state alone; every credit scheme, the shared trunk (a step with it and without:
tests/step/test_performance_switches.py) and the zero-advantage skip keep working; a killed run resumes to the same metrics; ``final/`` holds the adapter
(``PeftModel.from_pretrained``) and ``datc-export --merge`` a plain merged model, both giving the
trained policy's logits; the memory plan counts the adapters exactly."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from datc.checks import validate
from datc.config import ConfigError, LoraConfig
from datc.credit import CREDIT_SCHEMES
from datc.forward.passes import rollout_policy_pass
from datc.models.build import load_pretrained
from datc.models.lora import AdaptersOff, GradOnlyDropout, add_adapters, alpha_of, trunk_tensors
from datc.run.checkpoint import checkpoint_dirs, load_checkpoint
from datc.step import train_step
from datc.training.session import build_session
from datc.training.trainer import train
from tests.helpers import cli
from tests.helpers.runs import comparable, kill_at_checkpoint, metric_rows
from tests.helpers.testbed import cfg_for, train_cmd

LORA = ["policy.lora.r=4"]


@pytest.fixture
def cache(cache_dir):
    return cache_dir  # the session's (assets are keyed by their config)


def _session(cache, tmp_path, *overrides):
    return build_session(validate(cfg_for(cache, tmp_path / "unused", "trainer.warmup_steps=0", *overrides)))


def _adapters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _frozen(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


# ---- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "message"), [
    (["policy.lora.r=-1"], r"policy.lora.r: must be >= 0"),
    (["policy.lora.r=4", "policy.lora.alpha=0"], r"policy.lora.alpha: must be > 0"),
    (["policy.lora.r=4", "policy.lora.dropout=1.0"], r"policy.lora.dropout: must be in \[0, 1\)"),
    (["policy.lora.r=4", "policy.lora.target_modules=[]"], r"policy.lora.target_modules: an empty list"),
    (["policy.lora.r=4", "policy.lora.target_modules=[q_proj]"],
     r"^policy.lora.target_modules: q_proj not a module of the policy \(gpt2\); choose from c_attn, c_fc, c_proj, lm_head, wpe, wte$"),
    (["policy=tiny_llama", "policy.lora.r=4", "policy.lora.target_modules=[q_proj,qkv]"],
     r"^policy.lora.target_modules: qkv not a module of the policy \(llama\); choose from down_proj, embed_tokens, "
     r"gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj$"),
    (["experiment=paper/qwen3_ultrafeedback_lora", "policy.lora.target_modules=[c_attn]"],
     r"c_attn not a module of the policy \(qwen3\)"),  # the real preset's arch, built on the meta device
])
def test_bad_lora_values_are_one_line_naming_the_field(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_for(tmp_path / "cache", tmp_path / "run", *overrides))
    assert not (tmp_path / "cache").exists()  # before anything was prepared or loaded


def test_lora_is_off_by_default_and_leaves_full_policy_run_names_alone(tmp_path):
    from datc.run.naming import config_id

    c = validate(cfg_for(tmp_path, tmp_path / "run"))
    assert c.policy.lora.r == 0
    on = cfg_for(tmp_path, tmp_path / "run", *LORA)
    assert config_id(on) != config_id(cfg_for(tmp_path, tmp_path / "run"))
    assert alpha_of(validate(on).policy.lora) == 8.0  # alpha null: 2 r


def test_dropout_acts_only_where_a_graph_is_built():
    drop = GradOnlyDropout(0.5).eval()  # the trainer keeps the policy in eval mode throughout
    x = torch.ones(4, 100)
    with torch.no_grad():
        assert torch.equal(drop(x), x)  # sampling, old / reference log-probs, evaluation
    y = drop(x.requires_grad_())
    assert (y == 0).any() and torch.allclose(y[y != 0], torch.tensor(2.0))  # the update's forward


# ---- the reference is the base -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["tiny_gpt2", "tiny_llama"])
def test_the_reference_is_the_policy_with_adapters_off_equal_to_the_base_model(cache, tmp_path, policy):
    s = _session(cache, tmp_path, f"policy={policy}", *LORA, "credit=datc")
    m = s.m
    assert isinstance(m.ref, AdaptersOff) and m.ref._policy is m.policy  # no second model
    assert s.plan.with_ref  # the reference pass runs, through the policy with its adapters off
    assert m.adapter is not None and m.adapter.base_model.model is m.policy
    base_before = _frozen(m.policy)
    before = _adapters(m.policy)
    assert before and all("lora_" in n for n in before)
    torch.manual_seed(0)
    train_step(s, 0)
    after = _adapters(m.policy)
    assert all(not torch.equal(after[n], before[n]) for n in before if ".lora_B." in n)  # every B left zero
    assert all(torch.equal(p, base_before[n]) for n, p in _frozen(m.policy).items())  # the base is frozen

    torch.manual_seed(1)
    from datc.engines.generate import sample_groups

    t = s.c.trainer
    ro = sample_groups(m.policy, m.tok, [s.assets.train[i] for i in range(4)], 4, t.max_new_tokens, t.temperature,
                       t.top_p, s.c.data.prompt_field, encoder=m.encoder)
    base = load_pretrained("causal_lm", s.assets.policy_path, "policy.path").eval()  # loaded apart
    for share in (True, False):
        ref = rollout_policy_pass(m.ref, ro, t.temperature, 8, False, with_entropy=False, share=share)[0]
        want = rollout_policy_pass(base, ro, t.temperature, 8, False, with_entropy=False, share=share)[0]
        assert torch.equal(ref, want), share
        pol = rollout_policy_pass(m.policy, ro, t.temperature, 8, False, with_entropy=False, share=share)[0]
        assert not torch.equal(pol[ro.response_mask], want[ro.response_mask])  # the adapters are on again after


def test_the_shared_trunk_still_applies_with_the_reference_from_adapters_off(tok):
    """The trunk compares the reference's blocks with the reward model's: with LoRA the reference
    is the base (adapters off), so a reward model made from the policy shares its lower blocks,
    and one pass gives what the unadapted base's trunk gives."""
    from datc.forward.trunk import reference_and_score, shared_trunk_depth
    from tests.helpers.shared_prompt import grouped_rollout
    from tests.helpers.trunk import LAYERS, trunk_pair

    ref, rm = trunk_pair(tok)
    policy = copy.deepcopy(ref)
    add_adapters(policy, LoraConfig(r=4))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_()  # trained adapters: the adapted policy is not the base
    off = AdaptersOff(policy)
    assert trunk_tensors(policy.base_model.layers[0]).keys() == trunk_tensors(ref.base_model.layers[0]).keys()
    depth = shared_trunk_depth(ref, rm)
    assert depth == LAYERS - 1 and shared_trunk_depth(off, rm) == depth
    assert shared_trunk_depth(policy, rm) == depth  # by base weights: the adapters are not the reference's
    ro = grouped_rollout(len(tok))
    lp, out = reference_and_score(off, rm, depth, ro, 0.7, 5, with_grad=True)
    lp0, out0 = reference_and_score(ref, rm, depth, ro, 0.7, 5, with_grad=True)
    assert torch.equal(lp, lp0) and torch.equal(out.scores, out0.scores) and torch.equal(out.grad, out0.grad)
    assert policy.base_model.layers[0].self_attn.q_proj.lora_A["default"].weight.grad is None  # no adapter gradient


# ---- every scheme, the skip ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", CREDIT_SCHEMES.names())
def test_every_credit_scheme_trains_the_adapters(cache, tmp_path, name):
    s = _session(cache, tmp_path, f"credit={name}", *LORA, "trainer.steps=2")
    before, base = _adapters(s.m.policy), _frozen(s.m.policy)
    torch.manual_seed(0)
    for it in range(2):  # B = 0 at the start: the first step moves B alone, the second A as well
        metrics = train_step(s, it).metrics
    assert torch.isfinite(torch.tensor(metrics["loss/total"])) and metrics["loss/grad_norm"] > 0
    after = _adapters(s.m.policy)
    assert all(not torch.equal(after[n], before[n]) for n in before), name  # every adapter parameter moved
    assert all(torch.equal(p, base[n]) for n, p in _frozen(s.m.policy).items())


@pytest.mark.slow
def test_the_zero_advantage_skip_is_exact_under_lora(cache, tmp_path, forced):
    from tests.helpers.zero_advantage import same_update

    same_update(cache, tmp_path, "credit=datc", *LORA, ops=forced["ops"])


# ---- runs: checkpoints, resume, final/, export -----------------------------------------------------




@pytest.mark.slow
def test_a_killed_lora_run_resumes_to_the_same_metrics(cache, tmp_path):
    overrides = ["trainer.steps=4", "trainer.checkpoint_every=2", "trainer.eval_every=3", *LORA]
    train(cfg_for(cache, tmp_path / "full", *overrides))
    state = load_checkpoint(checkpoint_dirs(tmp_path / "full")[-1])
    assert state["policy"] and all("lora_" in k for k in state["policy"])  # the adapters, not the frozen base
    assert len(state["optimizer"]["state"]) == len(state["policy"])  # AdamW moments for each adapter tensor only

    killed = tmp_path / "killed"
    kill_at_checkpoint(train_cmd(cache, killed, *overrides), killed, 2)
    train(cfg_for(cache, killed, *overrides))
    assert comparable(metric_rows(killed)) == comparable(metric_rows(tmp_path / "full"))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["tiny_gpt2", "tiny_llama"])
def test_final_holds_the_adapter_and_the_merged_export_loads_with_plain_transformers(cache, tmp_path, policy):
    from peft import PeftModel

    from datc.prepare.assets import ensure_assets

    run = tmp_path / "run"
    cfg = cfg_for(cache, run, f"policy={policy}", *LORA, "credit=datc")
    train(cfg)
    base_path = ensure_assets(validate(cfg)).policy_path
    final = run / "final"
    assert (final / "adapter_config.json").exists() and (final / "adapter_model.safetensors").exists()
    assert not list(final.glob("model*.safetensors"))  # no copy of the base

    # the trained policy as the run left it: the base with the last checkpoint's adapters (loaded as a
    # user would: datc's own loader swaps GPT-2's GELU for an equal formula that rounds differently)
    trained = AutoModelForCausalLM.from_pretrained(base_path)
    add_adapters(trained, validate(cfg).policy.lora)
    trained.load_state_dict(load_checkpoint(checkpoint_dirs(run)[-1])["policy"], strict=False)
    ids = torch.randint(4, 100, (3, 12), generator=torch.Generator().manual_seed(0))
    want = logits_of(trained, ids)
    assert not torch.equal(want, logits_of(AutoModelForCausalLM.from_pretrained(base_path), ids))  # it trained

    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), final)
    torch.testing.assert_close(logits_of(adapted, ids), want, rtol=0, atol=0)

    out = tmp_path / "merged"
    proc = cli.run([sys.executable, "-m", "datc.commands.export", str(run), "--merge", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out)  # plain transformers, no peft
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits_of(merged, ids), want, rtol=1e-5, atol=1e-5)  # W + (alpha/r) BA: rounding

    proc = cli.run([sys.executable, "-m", "datc.commands.export", str(run), "--out", str(tmp_path / "adapter")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), tmp_path / "adapter")
    torch.testing.assert_close(logits_of(again, ids), want, rtol=0, atol=0)
    # the export stands on its own: its base travels in base/, moved with the folder, and its
    # adapter config names that copy, not the run's cache
    import json
    import shutil

    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str((tmp_path / "adapter" / "base").resolve()), conf
    moved = shutil.move(str(tmp_path / "adapter"), str(tmp_path / "elsewhere"))
    alone = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(Path(moved) / "base"), moved)
    torch.testing.assert_close(logits_of(alone, ids), want, rtol=0, atol=0)


# ---- memory plan -------------------------------------------------------------------------------------


def test_the_memory_plan_counts_the_adapters_and_drops_the_reference():
    from datc.memory.formulas import GIB, arch_of, lora_param_count, lora_param_count_formula
    from datc.memory.plan import compose, plan_preset

    for preset in ("qwen3_ultrafeedback_lora", "llama32_ultrafeedback_lora"):
        c = compose(preset)
        assert lora_param_count(c.policy.arch, c.policy.lora) == lora_param_count_formula(arch_of(c.policy.arch), 16)
    cache: dict = {}
    full = plan_preset("qwen3_ultrafeedback", 80, 4, ["credit=datc"], cache)["stages"]["zero2"]["per_gpus"][1]
    lora = plan_preset("qwen3_ultrafeedback_lora", 80, 4, ["credit=datc"], cache)
    one = lora["stages"]["zero2"]["per_gpus"][1]
    phi, phi_a = lora["params"]["policy"], lora["params"]["adapter"]
    assert phi_a == 17_432_576  # 16 · 28 · (7·2048 + 2·2048 + 2·1024 + 3·6144), by hand
    assert one["items"]["reference"] == 0 and full["items"]["reference"] == 2 * phi
    assert one["items"]["policy_weights"] == 2 * phi + 4 * phi_a  # bf16 base + fp32 adapters
    assert one["items"]["optimizer"] == 12 * phi_a and one["items"]["grads"] == 4 * phi_a
    assert one["total"] < full["total"] - 20 * GIB


def test_a_string_for_target_modules_says_to_write_a_list_and_alpha_at_its_default_is_the_same_run():
    from hydra import compose, initialize_config_dir

    from datc.checks import validate
    from datc.config import ConfigError
    from datc.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        with pytest.raises(ConfigError, match=r"^policy.lora.target_modules: a list, not one value: write "
                                              r"policy.lora.target_modules=\[c_attn\]$"):
            validate(compose(config_name="train", overrides=["policy.lora.r=8", "policy.lora.target_modules=c_attn"]))
        names = {o: compose(config_name="train", overrides=["policy.lora.r=8", *o]).run_name
                 for o in ((), ("policy.lora.alpha=16",), ("policy.lora.alpha=8",))}
    assert names[()] == names[("policy.lora.alpha=16",)] != names[("policy.lora.alpha=8",)]  # 16 = 2 r: the default



def test_a_testbed_lora_config_checks_without_transformers_warning_about_special_ids(capfd, caplog):
    # The adapters' target check builds the testbed policy on the meta device: with GPT-2's
    # default special ids (50256) outside its stand-in vocabulary transformers warned twice per run.
    import logging

    from hydra import compose, initialize_config_dir
    from transformers.utils import logging as hf_logging

    from datc.checks import validate
    from datc.paths import CONFIG_DIR

    caplog.set_level(logging.WARNING)
    hf_logging.set_verbosity_warning()  # as a command line has it when the config is checked
    try:
        for policy in ("tiny_gpt2", "tiny_llama"):
            with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
                validate(compose(config_name="train", overrides=[f"policy={policy}", "policy.lora.r=4"]))
    finally:
        hf_logging.set_verbosity_error()  # tests/conftest.py's quiet_libraries()
    out = capfd.readouterr()
    said = out.out + out.err + caplog.text
    assert "token_id must be" not in said, said
