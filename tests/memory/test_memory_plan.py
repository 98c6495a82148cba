"""The memory plan (datc.memory.formulas, datc.memory.plan: ``datc-memory-plan``): its arithmetic
against hand numbers, its activation formulas against the tensors torch saves for tiny models,
and the plan of every paper preset."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from datc.memory import formulas as mf
from datc.memory import plan as mp

TINY = dict(model_type="llama", num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=2, head_dim=4, vocab_size=100, tie_word_embeddings=True)


def test_param_count_by_hand():
    # per layer: q 16·16 + k,v 2·16·8 + o 16·16 + MLP 3·16·32 + 2 norms 2·16 = 256+256+256+1536+32 = 2336
    # model: embedding 100·16 = 1600, 2 layers 4672, final norm 16 -> 6288 (LM head tied)
    assert mf.param_count(TINY, "causal_lm") == 6288
    assert mf.param_count(dict(TINY, tie_word_embeddings=False), "causal_lm") == 6288 + 1600  # own LM head
    assert mf.param_count(TINY, "reward") == 6288 + 16  # score head h -> 1, no bias
    # Qwen3 adds q/k norms (2·head_dim = 8 per layer)
    assert mf.param_count(dict(TINY, model_type="qwen3"), "causal_lm") == 6288 + 2 * 8
    for kind in ("causal_lm", "reward"):
        for mt in ("llama", "qwen3"):
            arch = dict(TINY, model_type=mt)
            assert mf.param_count_formula(mf.arch_of(arch), kind) == mf.param_count(arch, kind)


def test_zero_arithmetic_by_hand():
    # Φ = 1e9 on 4 GPUs, fp32 policy: ZeRO-2 weights 4e9 (replicated), grads 4e9/4, optimizer (fp32 copy +
    # 2 moments) 12e9/4, the step's fp32 gradients and foreach AdamW temporary 8e9/4 (4e9/4 with FusedAdam)
    assert mf.zero_memory(10**9, 2, 4) == {"weights": 4e9, "grads": 1e9, "optimizer": 3e9, "step": 2e9}
    assert mf.zero_memory(10**9, 2, 4, foreach_adam=False)["step"] == 1e9
    # ZeRO-3: everything /4, the fp32 copy too
    assert mf.zero_memory(10**9, 3, 4) == {"weights": 1e9, "grads": 1e9, "optimizer": 3e9, "step": 2e9}
    # a bf16 policy: weights and gradients in 2 bytes, the ZeRO optimizer's states fp32 all the same
    assert mf.zero_memory(10**9, 3, 4, param_bytes=2) == {"weights": 0.5e9, "grads": 0.5e9, "optimizer": 3e9, "step": 2e9}
    # plain PyTorch: torch's AdamW keeps its moments in the parameters' dtype; fused, no step temporaries
    assert mf.zero_memory(10**9, None, 1) == {"weights": 4e9, "grads": 4e9, "optimizer": 8e9, "step": 0.0}
    assert mf.zero_memory(10**9, None, 1, param_bytes=2) == {"weights": 2e9, "grads": 2e9, "optimizer": 4e9, "step": 0.0}
    assert mf.frozen_memory(10**9, 2, 4) == 2e9 and mf.frozen_memory(10**9, 3, 4) == 0.5e9
    assert mf.frozen_memory(10**9, None, 1) == 2e9
    assert mf.zero_buffers(2, True) == 2 * 5e8 * 4 and mf.zero_buffers(2, False) == 5e8 * 4 == mf.zero_buffers(3, True)
    assert mf.zero_buffers(2, False, grad_bytes=2) == 5e8 * 2 and mf.zero_buffers(None, True) == 0
    # FSDP2 on 4 GPUs: weights 4e9/4, gradients 4e9/4, torch AdamW's moments 8e9/4 (no fp32 copy),
    # its foreach step's temporary 4e9/4; the frozen models stay replicas (as under ZeRO-2)
    assert mf.zero_memory(10**9, mf.FSDP2, 4) == {"weights": 1e9, "grads": 1e9, "optimizer": 2e9, "step": 1e9}
    assert mf.zero_memory(10**9, mf.FSDP2, 4, param_bytes=2) == {"weights": 0.5e9, "grads": 0.5e9, "optimizer": 1e9,
                                                                  "step": 0.5e9}
    assert mf.frozen_memory(10**9, mf.FSDP2, 4) == 2e9
    # the reduce-scatter input: the root's V·h gradient and one block's, (Φ - V·h) / L
    a = mf.arch_of(TINY)  # V=100, h=16, 2 layers
    assert mf.fsdp2_reduce_bytes(a, 100 * 16 + 2 * 300, 4) == 4 * (100 * 16 + 300)


def test_the_fsdp2_plan_of_a_preset_by_hand():
    """One FSDP2 column of the Qwen3 preset checked item by item against the formulas' inputs: sharded
    states, replicated frozen models, the whole policy unsharded while sampling over ranks."""
    c = mp.compose("qwen3_ultrafeedback", ["credit=grpo"])
    pa = mf.arch_of(c.policy.arch)
    counts = {"policy": 10**9, "reward": 5 * 10**8}
    for n in (1, 4):
        p = mp.plan(c, counts, mf.FSDP2, n)
        s = p["items"]
        assert (s["policy_weights"], s["grads"], s["optimizer"], s["optimizer_step"]) == (4e9 / n, 4e9 / n, 8e9 / n, 4e9 / n)
        assert s["reference"] == 2e9 and s["reward_model"] == 1e9  # replicas, bf16
        assert s["zero_buffers"] == mf.fsdp2_reduce_bytes(pa, 10**9, 4)
        working = mf.gathered_working_set(pa, 10**9, 4)
        assert s["zero3_gathered"] == working
        unsharded = 4e9 if n > 1 else working  # over ranks the policy is unsharded whole for each sampling call
        z3 = mp.plan(c, counts, 3, n)
        assert p["phases"]["generate"] - z3["phases"]["generate"] == pytest.approx(unsharded - working)
        # over ranks FSDP2's sampling holds the whole policy as ZeRO-2 does, beside states it shards
        assert p["total"] <= mp.plan(c, counts, 2, n)["total"] or n == 1


GPU_RUNS = ("results/gpu/qwen3_gpu_check.json", "results/gpu/llama32_gpu_check.json")


def _measured_cases():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for f in GPU_RUNS:
        run = json.loads((root / f).read_text())
        for name, r in run["cases"].items():
            if name.startswith("train/") and r["status"] == "ok":
                yield pytest.param(run, name, r, id=name)


@pytest.mark.parametrize("run,name,case", list(_measured_cases()))
def test_plan_replays_every_measured_gpu_peak_within_15_percent(run, name, case):
    """Each training case the H200 run measured (results/gpu/*.json, committed), replayed through
    the plan at its own shape: its scaled-down batch, prompt length, ZeRO stage and AdamW, the
    LM head whole (that run predates trainer.lm_head_chunk), and a bf16 policy (its loader kept the
    random checkpoint's bf16: transformers >= 5 loads the stored dtype when none is given). The
    plan is within 15% of torch.cuda.max_memory_allocated in every case."""
    from scripts.gpu_check.cases import plan_memory

    _, family, credit, stage = name.split("/")
    sc, batch = run["scale"], run["scale"]["prompts"] * 8
    overrides = [f"credit={credit}", f"deepspeed={stage}", "data.path=gpu_check/data",
                 f"data.max_prompt_tokens={run['prompt_tokens'][family]}", f"trainer.batch_size={batch}",
                 f"trainer.mini_batch_size={sc['mini_batch']}", f"trainer.micro_batch_size={sc['micro_batch']}",
                 f"trainer.generation_batch_size={batch}", f"trainer.max_new_tokens={sc['max_new_tokens']}",
                 f"trainer.eval_size={sc['eval_prompts']}", f"trainer.eval_batch_size={sc['eval_prompts']}",
                 "trainer.lm_head_chunk=null", *([f"deepspeed.optimizer_impl={run['ds_optimizer']}"] if stage != "none" else [])]
    planned = plan_memory(family, overrides, stage, case["plan"]["params"], policy_bytes=2)["gib"]
    measured = case["max_allocated_gib"]
    assert abs(planned - measured) <= 0.15 * measured, (name, planned, measured)


def test_head_chunk_and_checkpointing_by_hand():
    # chunked LM head, k=2 of T=4 response positions: one chunk's bf16 2·2·2·10 and fp32 3·4·2·2·10
    assert mf.update_logits_bytes(2, 3, 4, 10, head_chunk=2) == 80 + 480
    assert mf.update_logits_bytes(2, 3, 4, 10, head_chunk=64) == 2 * 2 * 4 * 10 + 3 * 4 * 2 * 4 * 10  # k capped at T
    a = mf.arch_of(TINY)  # h=16, q=16, kv=8, I=32, head_dim 4, 2 layers
    layer = 2 * (2 * 16 + 3 * 16 + 2 * 8 + 4 * 32) + 16 * 16
    assert mf.activation_bytes(a, 1, 1, True, checkpointed=True) == 2 * 4 * 16 + layer + 8 * 16 + 8 * 4
    assert mf.activation_bytes(a, 1, 1, True, checkpointed=True) < mf.activation_bytes(a, 1, 1, True)


def test_kv_cache_by_hand():
    a = mf.arch_of(TINY)  # 2 layers, kv = 2·4 = 8
    # 3 responses x 10 tokens: 2 layers · 3 · 10 · 8 · (4 + 2) bytes = 2880
    assert mf.kv_cache_bytes(a, 3, 10) == 2880
    assert mf.kv_cache_bytes(a, 3, 10, key_bytes=2) == 2 * 3 * 10 * 8 * 4


def test_kv_cache_dtypes_under_autocast():
    """The KV cache's keys are fp32 and values bf16 with fp32 weights under bf16 autocast."""
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        cache = m(input_ids=torch.randint(0, 100, (2, 5)), use_cache=True).past_key_values
    layer = cache.layers[0]
    assert layer.keys.dtype == torch.float32 and layer.values.dtype == torch.bfloat16


def _saved_bytes(model, ids, input_grad: bool) -> int:
    """Bytes of the tensors autograd saves for backward (parameters excluded, storages once)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if input_grad:
            model(inputs_embeds=model.get_input_embeddings()(ids).detach().requires_grad_(True))
        else:
            model(input_ids=ids, use_cache=False)
    return sum(n for p, n in seen.items() if p not in params)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_activation_formula_matches_saved_tensors(model_type):
    """Per layer and token (differences over layers and lengths cancel everything else), the
    formula is within 10% of what torch keeps: the policy under autocast with weight gradients,
    the bf16 reward model differentiated to its inputs only."""
    torch.manual_seed(0)
    base = dict(model_type=model_type, hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, vocab_size=8, pad_token_id=0, attn_implementation="sdpa")
    measured = {}
    for layers in (1, 2):
        conf = AutoConfig.for_model(**base, num_hidden_layers=layers, num_labels=1)
        pol = AutoModelForCausalLM.from_config(conf)
        rm = AutoModelForSequenceClassification.from_config(conf).to(torch.bfloat16).requires_grad_(False)
        for seq in (40, 80):
            ids = torch.randint(1, 8, (2, seq))
            measured[layers, seq] = (_saved_bytes(pol, ids, False), _saved_bytes(rm, ids, True))
    a = mf.arch_of(dict(base, num_hidden_layers=1))
    for i, weight_grads in ((0, True), (1, False)):
        per = (measured[2, 80][i] - measured[2, 40][i] - measured[1, 80][i] + measured[1, 40][i]) / 80
        formula = mf.activation_bytes(a, 1, 1, weight_grads) - mf.activation_bytes(
            mf.arch_of(dict(base, num_hidden_layers=0)), 1, 1, weight_grads)
        assert abs(formula - per) <= 0.10 * per, (weight_grads, formula, per)


def test_logits_by_hand():
    # m=2, P=3, T=4, V=10: bf16 2·2·7·10 = 280, fp32 3·4·2·4·10 = 960
    assert mf.update_logits_bytes(2, 3, 4, 10) == 1240
    assert mf.entropy_pass_bytes(2, 4, 10) == 4 * 4 * 2 * 4 * 10
    assert mf.datc_chunk_bytes(256, 10) == 3 * 4 * 256 * 10
    assert mf.datc_chunk_bytes(None, 49152) == 3 * 4 * 341 * 49152  # sized by memory: 341 fp32 rows in 64 MiB


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory")
    plans = mp.main(["--out", str(out)])
    return out, plans


def test_every_preset_plans_and_files_are_written(written):
    out, plans = written
    assert [p["preset"] for p in plans] == list(mp.PRESETS)
    md = (out / "presets.md").read_text()
    data = json.loads((out / "presets.json").read_text())
    assert data["command"] == "datc-memory-plan --out " + str(out)
    assert len(data["plans"]) == len(mp.PRESETS) == 8 and "| preset | backend |" in md and "| FSDP2 |" in md
    for p in plans:
        pol = mf.arch_of(mp.compose(p["preset"]).policy.arch)
        assert p["params"]["policy"] == mf.param_count_formula(pol, "causal_lm")
        for stage in ("zero2", "zero3", "fsdp2"):
            per = p["stages"][stage]["per_gpus"]
            # FSDP2 on one rank samples block by block, over ranks with the whole policy unsharded for
            # the call: a LoRA preset's N=2 can need more than N=1 (its states are few, the base is not)
            totals = [per[n]["total"] for n in mp.GPU_COUNTS if n > 1 or stage != "fsdp2"]
            assert all(x > y for x, y in zip(totals, totals[1:], strict=False))  # more GPUs, less memory per GPU
            assert p["stages"][stage]["gpus_needed"] in (*mp.FIT_COUNTS, None)
        if "adapter" in p["params"]:  # LoRA: states of a few adapters, so ZeRO-3's gathers can cost more than it saves
            continue
        # ZeRO-3 needs less memory than ZeRO-2 on several GPUs; on one it partitions nothing and
        # adds its gathers (the H200 run measured 44.95 GiB under ZeRO-3, 42.24 under ZeRO-2)
        assert all(p["stages"]["zero3"]["per_gpus"][n]["total"] <= p["stages"]["zero2"]["per_gpus"][n]["total"]
                   for n in mp.GPU_COUNTS if n > 1)


def test_world_sizes_that_do_not_split_the_batch_are_refused():
    c = mp.compose("qwen3_ultrafeedback")
    assert mp.world_ok(c, 8, 2) is None
    assert "do not split" in mp.world_ok(c, 3, 2)  # 64 prompts over 3 processes
