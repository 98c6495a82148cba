"""Per-GPU memory plan of the paper presets under DeepSpeed ZeRO-2 and ZeRO-3 and FSDP2, written to
<out>/presets.{md,json} (default runs/memory; the committed tables are regenerated on purpose
with ``--out results/memory``).

    datc-memory-plan [--presets qwen3_ultrafeedback ...] [--gpu-gib 80] [--credit datc] [--out DIR]
    python -m datc.memory.plan ...   # the same command

Everything is read from the composed config (parameter counts from the ``arch`` blocks, built on
the ``meta`` device; batch sizes, lengths and ZeRO stage from ``trainer``/``data``/``deepspeed``).
The arithmetic lives in small pure functions (:mod:`datc.memory.formulas`) so the tests check it
against hand numbers. It is an estimate of the tensors the training step holds, per process, not
a measurement: CUDA context, allocator fragmentation and NCCL buffers are not included (see
``--reserve-gib``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from datc.memory.formulas import (
    FSDP2,
    GIB,
    activation_bytes,
    arch_of,
    choose_micro_batch,
    datc_chunk_bytes,
    entropy_pass_bytes,
    frozen_memory,
    fsdp2_reduce_bytes,
    gathered_working_set,
    kv_cache_bytes,
    lora_param_count,
    no_grad_pass_bytes,
    param_count,
    update_logits_bytes,
    zero_buffers,
    zero_memory,
)

COMMAND = "datc-memory-plan"
FULL_PRESETS = ("qwen3_ultrafeedback", "qwen3_hh_rlhf", "llama32_ultrafeedback", "llama32_hh_rlhf")
PRESETS = FULL_PRESETS + tuple(f"{p}_lora" for p in FULL_PRESETS)  # each with a LoRA policy (datc.models.lora)
GPU_COUNTS = (1, 2, 4, 8)
FIT_COUNTS = (1, 2, 4, 8, 16)
STAGES = (2, 3, FSDP2)
STAGE_KEY = {2: "zero2", 3: "zero3", FSDP2: "fsdp2"}  # presets.json's keys
LABEL = {"zero2": ("ZeRO-2", "Z2"), "zero3": ("ZeRO-3", "Z3"), "fsdp2": ("FSDP2", "FSDP2")}  # the tables' (long, short)


def plan_stage(c):
    """The plan's stage of a run's config: None (plain PyTorch), 2 (ZeRO-0/1/2), 3 or :data:`FSDP2`."""
    from datc.backends.checks import backend_name

    if backend_name(c) == "fsdp2":
        return FSDP2
    stage = c.deepspeed.stage
    return None if stage is None else 3 if stage == 3 else 2


# ============================================================================================
# The plan of one composed config
# ============================================================================================


def compose(preset: str, overrides: list[str] = ()):  # -> TrainConfig
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from datc.checks import validate
    from datc.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=[f"experiment=paper/{preset}", *overrides])
    return validate(cfg)


def world_ok(c, n_gpus: int, stage: int) -> str | None:
    """None if the batch splits over ``n_gpus`` processes (``datc.backends.distributed.check_world``),
    else its message."""
    import dataclasses

    from datc.backends.distributed import check_world
    from datc.config import ConfigError

    if stage == FSDP2:
        c = dataclasses.replace(c, deepspeed=dataclasses.replace(c.deepspeed, stage=None),
                                backend=dataclasses.replace(c.backend, name="fsdp2"))
    else:
        c = dataclasses.replace(c, deepspeed=dataclasses.replace(c.deepspeed, stage=stage))
    try:
        check_world(c, n_gpus)
    except ConfigError as e:
        return str(e)
    return None


def plan(c, counts: dict[str, int], stage: int | None, n_gpus: int, policy_bytes: int = 4) -> dict[str, Any]:
    """Bytes per GPU, per item and per phase of one training step, for ``c`` run with ZeRO
    ``stage`` (None: plain PyTorch, one process; :data:`FSDP2`: backend=fsdp2) on ``n_gpus`` processes. ``counts``:
    {"policy": Φ_p, "reward": Φ_r, "adapter": Φ_a (LoRA)}. ``policy_bytes``: bytes per parameter of
    the trained policy, 4 (fp32 master weights, what the trainer loads) or 2 (a bf16 policy: the
    H200 run of results/gpu/, whose peaks tests/memory/test_memory_plan.py replays)."""
    from datc.backends.distributed import micro_batch_per_rank
    from datc.credit import resolve_scheme
    from datc.credit.base import POLICY_LOGITS, RM_EMBEDDING, RM_GRAD
    from datc.engines import ENGINES
    from datc.step.plan import build_plan

    t = c.trainer
    pa, ra = arch_of(c.policy.arch), arch_of(c.reward.arch)
    phi_p, phi_r = counts["policy"], counts["reward"]
    scheme = resolve_scheme(c.credit)[0]
    needs = scheme.needs
    rows = t.batch_size // n_gpus  # responses per rank (whole groups)
    micro = micro_batch_per_rank(c, n_gpus)  # update micro-batch
    pass_micro = t.micro_batch_size  # no-grad passes and the reward model use it uncapped
    P, T, V = c.data.max_prompt_tokens, t.max_new_tokens, pa.vocab
    # the trainer's own decision, with the run's engine's declarations (one that keeps no logits:
    # vLLM, or the built-in sampler on its own copy under rollout.max_staleness > 0)
    engine = ENGINES.get(c.rollout.name).declared(c)
    reuse = build_plan(t, scheme, V, with_ref=t.beta > 0, engine=engine, staleness=c.rollout.max_staleness).reuse
    # (rows, T, V) fp32: generate's logits when reused; else a row-local scheme (the DATC family)
    # gets them one micro-batch of rows at a time, any other scheme for all rows at once
    logit_rows = rows if reuse or not scheme.row_local else min(pass_micro, rows)
    held_logits = 4 * logit_rows * T * V if (reuse or POLICY_LOGITS in needs) else 0

    lora = c.policy.lora.r > 0
    phi_a = counts.get("adapter", 0) if lora else 0
    pb = 4 if lora else policy_bytes  # LoRA: fp32 adapters over a bf16 base
    # LoRA: fp32 states of the adapters alone, the base frozen in bf16, the reference = the base
    z = zero_memory(phi_a if lora else phi_p, stage, n_gpus, pb, foreach_adam=c.deepspeed.optimizer_impl != "deepspeed")
    sharded = stage in (3, FSDP2)  # the policy's parameters partitioned over ranks
    base_stage = 3 if stage == FSDP2 else stage  # FSDP2 shards a LoRA policy's frozen base with it; frozen models are replicas
    static = {
        "policy_weights": z["weights"] + (frozen_memory(phi_p, base_stage, n_gpus) if lora else 0.0),
        "grads": z["grads"], "optimizer": z["optimizer"],
        "reference": frozen_memory(phi_p, stage, n_gpus) if t.beta > 0 and not lora else 0.0,
        "reward_model": frozen_memory(phi_r, stage, n_gpus),
        "rm_embedding": 4 * ra.vocab * ra.hidden if RM_EMBEDDING in needs else 0.0,  # gathered, fp32
    }
    gather_p = gathered_working_set(pa, phi_p, 2 if lora else pb) if sharded else 0.0
    gather_f = gathered_working_set(ra, phi_r, 2) if stage == 3 else 0.0
    # FSDP2 over ranks samples with the policy unsharded once per call: its whole parameters
    gather_gen = (2 * phi_p + 4 * phi_a if lora else pb * phi_p) if stage == FSDP2 and n_gpus > 1 else gather_p
    rm_grad = 4 * rows * T * ra.hidden if RM_GRAD in needs else 0.0  # (rows, T, d) fp32
    gen_rows = min(t.generation_batch_size or rows, rows)  # responses per sampling call
    kv = kv_cache_bytes(pa, gen_rows, P + T)
    kv_eval = kv_cache_bytes(pa, t.eval_batch_size, P + T)  # every rank evaluates whole batches
    prefill = gen_rows * P * (4 * pa.hidden + 4 * pa.intermediate)
    # the trainer turns checkpointing off under ZeRO-3 and FSDP2, and the chunked head too (datc.training.session)
    checkpointed = t.gradient_checkpointing and not sharded
    head_chunk = t.lm_head_chunk if not sharded else None
    act_policy = activation_bytes(pa, micro, P + T, weight_grads=True, checkpointed=checkpointed)
    act_rm = activation_bytes(ra, min(pass_micro, rows), P + T, weight_grads=False) if RM_GRAD in needs else 0.0
    logits_update = max(update_logits_bytes(micro, P, T, V, head_chunk),
                        entropy_pass_bytes(micro, min(T, head_chunk or T), V))
    pass_bytes = no_grad_pass_bytes(min(pass_micro, rows), P, T, V, pa.hidden, pa.intermediate)
    credit_chunk = datc_chunk_bytes(c.credit.get("chunk_size"), V) if POLICY_LOGITS in needs else 0.0
    # autocast's bf16 weight casts, saved for backward (no cast cache under DeepSpeed); a bf16
    # LoRA base, or a bf16 policy, is not cast
    weight_copy = 2 * (phi_a if lora else phi_p) if pb == 4 else 0.0
    buffers = (fsdp2_reduce_bytes(pa, phi_p, pb) if not lora else 4.0 * phi_a) if stage == FSDP2 else \
        zero_buffers(stage, c.deepspeed.overlap_comm, grad_bytes=pb)
    phases = {
        "generate": kv + prefill + (2 * held_logits if reuse else 0.0) + gather_gen,
        "eval": kv_eval + t.eval_batch_size * P * (4 * pa.hidden + 4 * pa.intermediate) + gather_gen,
        "reward": act_rm + rm_grad + (held_logits if reuse else 0.0) + gather_f,
        "logprob_passes": held_logits + rm_grad + pass_bytes + max(gather_p, gather_f),
        "credit": held_logits + rm_grad + credit_chunk,
        # the trainer frees the credit's inputs (logits, RM gradients) before the update
        "update": act_policy + logits_update + weight_copy + buffers + gather_p,
        # ZeRO's optimizer step, after the backward (no activations): fp32 gradients, AdamW's temporaries
        "optimizer_step": z["step"],
    }
    peak_phase = max(phases, key=phases.get)
    total = sum(static.values()) + phases[peak_phase]
    return {
        "static": static, "phases": phases, "peak_phase": peak_phase, "total": total,
        "items": {**static, "kv_cache": kv, "activations_policy": act_policy, "activations_rm": act_rm,
                  "logits_update": logits_update, "autocast_weight_copy": weight_copy, "zero_buffers": buffers,
                  "zero3_gathered": max(gather_p, gather_f), "optimizer_step": z["step"], "held_logits": held_logits,
                  "rm_grad": rm_grad, "datc_chunk": credit_chunk},
        "rows_per_rank": rows, "micro_per_rank": micro, "reuse_rollout_logits": reuse, "policy_bytes": pb,
    }


def auto_micro(c, counts: dict[str, int], stage: int | None, n_gpus: int, budget_bytes: float):
    """``c`` with ``trainer.micro_batch_size: auto`` resolved as a run on such GPUs would
    (:func:`datc.memory.micro_batch.choose_micro_batch`); ``c`` itself when it is a number."""
    import dataclasses

    if c.trainer.micro_batch_size != "auto":
        return c

    def with_micro(m: int):
        return dataclasses.replace(c, trainer=dataclasses.replace(c.trainer, micro_batch_size=m))

    m, _ = choose_micro_batch(c.trainer.mini_batch_size // n_gpus,
                              lambda k: plan(with_micro(k), counts, stage, n_gpus)["total"], budget_bytes)
    return with_micro(m)


def plan_preset(preset: str, gpu_gib: float, reserve_gib: float, overrides: list[str] = (),
                _counts: dict | None = None) -> dict[str, Any]:
    c = compose(preset, list(overrides))
    cache = _counts if _counts is not None else {}
    counts = {}
    for role, arch, kind in (("policy", c.policy.arch, "causal_lm"), ("reward", c.reward.arch, "reward")):
        key = (kind, tuple(sorted((k, str(v)) for k, v in arch.items())))
        if key not in cache:
            cache[key] = param_count(arch, kind)
        counts[role] = cache[key]
    if c.policy.lora.r > 0:
        key = ("lora", str(c.policy.lora), tuple(sorted((k, str(v)) for k, v in c.policy.arch.items())))
        if key not in cache:
            cache[key] = lora_param_count(c.policy.arch, c.policy.lora)
        counts["adapter"] = cache[key]
    out: dict[str, Any] = {"preset": preset, "policy": c.policy.name, "reward": c.reward.name,
                           "credit": c.credit.get("name"), "params": counts,
                           "batch": {"batch_size": c.trainer.batch_size, "num_generations": c.trainer.num_generations,
                                     "mini_batch_size": c.trainer.mini_batch_size,
                                     "micro_batch_size": c.trainer.micro_batch_size,
                                     "max_prompt_tokens": c.data.max_prompt_tokens,
                                     "max_new_tokens": c.trainer.max_new_tokens, "beta": c.trainer.beta},
                    "default_stage": c.deepspeed.stage, "stages": {}}
    for stage in STAGES:
        per_n, needed = {}, None
        for n in sorted(set(GPU_COUNTS) | set(FIT_COUNTS)):
            refused = world_ok(c, n, stage)
            if refused is not None:
                per_n[n] = {"allowed": False, "reason": refused}
                continue
            p = plan(auto_micro(c, counts, stage, n, (gpu_gib - reserve_gib) * GIB), counts, stage, n)
            p["allowed"] = True
            p["fits"] = p["total"] <= (gpu_gib - reserve_gib) * GIB
            per_n[n] = p
            if needed is None and n in FIT_COUNTS and p["fits"]:
                needed = n
        out["stages"][STAGE_KEY[stage]] = {"per_gpus": per_n, "gpus_needed": needed}
    return out


# ============================================================================================
# Output
# ============================================================================================


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


ITEM_ROWS = (("policy_weights", "policy weights"), ("grads", "gradients"), ("optimizer", "optimizer state"),
             ("reference", "reference model"), ("reward_model", "reward model"), ("kv_cache", "KV cache (generate)"),
             ("activations_policy", "policy activations (1 micro-batch)"), ("logits_update", "update logits (fp32)"),
             ("autocast_weight_copy", "bf16 weight casts (update)"),
             ("zero_buffers", "ZeRO reduce buckets / FSDP2 reduce-scatter input"),
             ("zero3_gathered", "ZeRO-3 gathered / FSDP2 unsharded params"), ("optimizer_step", "optimizer step (ZeRO, FSDP2)"),
             ("activations_rm", "RM activations (input grad)"),
             ("held_logits", "rollout logits held for credit"), ("rm_grad", "RM input gradients"),
             ("rm_embedding", "RM embedding (fp32)"), ("datc_chunk", "DATC chunk"))


def render(plans: list[dict[str, Any]], command: str, gpu_gib: float, reserve_gib: float) -> str:
    lines = [
        "# Per-GPU memory of the paper presets",
        "",
        f"Written by `{command}`. Estimates of the tensors one training step holds per process",
        f"(GiB = 2^30 bytes), not measurements; \"GPUs\" is the smallest N of {', '.join(map(str, FIT_COUNTS))} whose peak",
        f"fits {gpu_gib:g} GiB less a {reserve_gib:g} GiB reserve (CUDA context, allocator fragmentation, NCCL), among",
        "the N the batch splits over (`datc.backends.distributed.check_world`). \"-\": N not allowed; \"none\": no N fits.",
        "",
        "| preset | backend | policy / RM params (B) | N=1 | N=2 | N=4 | N=8 | GPUs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        for stage, s in p["stages"].items():
            cells = [(_gib(s["per_gpus"][n]["total"]) if s["per_gpus"][n]["allowed"] else "-") for n in GPU_COUNTS]
            params = f"{p['params']['policy'] / 1e9:.3f} / {p['params']['reward'] / 1e9:.3f}"
            if "adapter" in p["params"]:
                params += f" (LoRA {p['params']['adapter'] / 1e6:.1f}M)"
            lines.append(f"| {p['preset']} | {LABEL[stage][0]} | {params} | {' | '.join(cells)} | {s['gpus_needed'] or 'none'} |")
    lines += ["", "## How the numbers are computed", "",
              "Φ = parameter count (exact: the `arch` block built with transformers on the meta device), N = processes,",
              "B = trainer.batch_size, rows = B/N responses per process, m = micro-batch per process",
              "(min(micro_batch_size, mini_batch_size/N)), P = data.max_prompt_tokens (prompts padded to at most this),",
              "T = max_new_tokens, V = vocabulary, h/I/L = hidden/intermediate/layers, q = heads·head_dim,",
              "kv = kv_heads·head_dim. Peak = static + the largest phase.", "",
              "Static (whole run):",
              "- policy weights fp32: 4Φ (ZeRO-2) or 4Φ/N (ZeRO-3); gradients fp32: 4Φ/N;",
              "- optimizer: AdamW moments 8Φ/N, plus DeepSpeed's fp32 copy of the partition 4Φ/N (both stages);",
              "- reference policy (trainer.beta > 0) and reward model in bf16: 2Φ each, /N under ZeRO-3;",
              "- DATC: the reward model's input embedding gathered in fp32, 4·V·h;",
              "- LoRA presets (`*_lora`, policy.lora.r > 0, Φa adapter parameters counted exactly on the meta",
              "  device): the states above for Φa instead of Φ, plus the frozen base in bf16, 2Φ (/N under",
              "  ZeRO-3), and no reference model (the base with its adapters disabled is the reference);",
              "  autocast's weight casts 2Φa; activations as the full policy's (the adapters' A keeps each",
              "  targeted projection's input, which the full policy's weight gradient keeps too).", "",
              "Phases (each adds to the static part; the peak is the largest):",
              "- generate, in calls of g = min(trainer.generation_batch_size, rows) responses: KV cache",
              "  L·g·(P+T)·kv·(4+2) bytes (keys come out of RoPE in fp32 under autocast, values bf16) + prefill",
              "  transients g·P·(4h+4I) (+ kept generate logits 2·4·rows·T·V when reused);",
              "- eval: every process generates eval_batch_size prompts at once: the same KV cache for those rows;",
              "- reward: the reward model differentiated to its input embeddings on micro_batch_size rows of P+T",
              "  tokens: per layer per token 8h + 2(2q + 2kv + 3I) bytes (+4(q+kv) for Qwen3's q/k norms);",
              "  frozen weights need no gradient, so matmul inputs are not kept; plus dR/dh, 4·rows·T·h;",
              "- log-prob passes (old policy, reference) and credit: no-grad micro-batches; DATC's schemes are",
              "  row-local, so the fp32 rollout logits are held one micro-batch at a time, 4·micro_batch_size·T·V",
              "  (a scheme that is not row-local would hold all rows', 4·rows·T·V);",
              "- credit: DATC's closed forms per 256-token chunk, 4 fp32 (chunk, V) tensors;",
              "- update: activations of one micro-batch without recomputation (SDPA attention, no seq² term),",
              "  per layer per token 2(2h + 3q + 2kv + 4I) + 16h bytes (+8(q+kv) for Qwen3), times m·(P+T)·L;",
              "  logits 2·m·(P+T)·V (bf16 LM head) + 3·4·m·T·V (fp32 slice, /temperature copy kept by the",
              "  log-softmax, its gradient); autocast's bf16 weight casts saved for backward, 2Φ (also under",
              "  ZeRO-3); DeepSpeed's reduce buckets, 5e8 fp32 elements (two with overlap_comm under ZeRO-2);",
              "  under ZeRO-3 the gathered working set, the embedding plus two layers, in every forward;",
              "  `trainer.lm_head_chunk` k: one chunk's logits, 2·m·k·V + 3·4·m·k·V; `trainer.gradient_checkpointing`:",
              "  each block's fp32 input, 4h per layer per token, plus one block's activations (neither under ZeRO-3);",
              "- optimizer step (ZeRO, after the backward): the gradient partition flattened to fp32 4Φ/N and torch",
              "  AdamW's foreach temporary 4Φ/N (optimizer_impl torch, or auto, which may fall back to it).", "",
              "FSDP2 (`backend=fsdp2`, datc.backends.fsdp2): weights, gradients and torch AdamW's two moments all sharded,",
              "4Φ/N + 4Φ/N + 8Φ/N, and its foreach step's temporary 4Φ/N; the reference and reward model replicated",
              "(2Φ each), a LoRA policy's frozen base sharded with it (2Φ/N); in each forward the root (embedding,",
              "norm, tied head) and two blocks unsharded (as ZeRO-3's working set), over ranks the whole policy",
              "unsharded while it samples (4Φ); the backward's reduce-scatter input, the root's and one block's",
              "gradients; checkpointing and the chunked head off, as under ZeRO-3. Not yet fitted to a measurement.", "",
              "Re-fitted to the peaks measured on one H200 (results/gpu/, a bf16 policy there): replayed at that run's",
              "shapes, the plan is within 15% of every measured case (tests/memory/test_memory_plan.py; +0.5% to +6.2%).", "",
              "Not included: CUDA context and caching-allocator slack (the reserve), NCCL buffers, tokenizer and",
              "host memory, DeepSpeed's all-gather buckets, the score head's negligible (rows, P+T, 1) output.",
              "The activation formulas are checked against the tensors torch saves for tiny models of both",
              "families in tests/memory/test_memory_plan.py.", ""]
    for p in plans:
        lines += [f"## {p['preset']}: breakdown (GiB per GPU)", "",
                  f"credit={p['credit']}, batch {p['batch']['batch_size']} responses "
                  f"({p['batch']['batch_size'] // p['batch']['num_generations']} prompts x {p['batch']['num_generations']}), "
                  f"mini-batch {p['batch']['mini_batch_size']}, micro-batch {p['batch']['micro_batch_size']}, "
                  f"P={p['batch']['max_prompt_tokens']}, T={p['batch']['max_new_tokens']}, beta={p['batch']['beta']}.", "",
                  "| item | " + " | ".join(f"{LABEL[st][1]} N={n}" for st in p["stages"] for n in GPU_COUNTS) + " |",
                  "|---|" + "---|" * (len(p["stages"]) * len(GPU_COUNTS))]
        cols = [p["stages"][st]["per_gpus"][n] for st in p["stages"] for n in GPU_COUNTS]
        if p["batch"]["micro_batch_size"] == "auto":
            lines[-2:-2] = ["micro-batch per GPU (auto, datc.memory.micro_batch): " + ", ".join(
                f"{LABEL[st][1]} N={n}: {p['stages'][st]['per_gpus'][n]['micro_per_rank']}" for st in p["stages"] for n in GPU_COUNTS
                if p["stages"][st]["per_gpus"][n]["allowed"]), ""]
        for key, label in ITEM_ROWS:
            lines.append(f"| {label} | " + " | ".join(_gib(col["items"][key]) if col["allowed"] else "-" for col in cols) + " |")
        lines.append("| **peak** (phase) | " + " | ".join(f"**{_gib(col['total'])}** ({col['peak_phase']})" if col["allowed"]
                                                      else "-" for col in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="device memory, GiB")
    ap.add_argument("--reserve-gib", type=float, default=4.0, help="kept free for CUDA context and fragmentation")
    ap.add_argument("--credit", default="datc", help="credit scheme (configs/credit/); the presets are run with datc")
    ap.add_argument("--out", default="runs/memory",
                    help="directory of presets.md and presets.json (default runs/memory, git-ignored; "
                         "--out results/memory refreshes the committed tables)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides applied to every preset")
    a = ap.parse_args(argv)
    from datc.atomic import atomic_write_json, atomic_write_text
    from datc.run.provenance import provenance

    overrides = [f"credit={a.credit}", *a.overrides]
    cache: dict = {}
    plans = [plan_preset(p, a.gpu_gib, a.reserve_gib, overrides, cache) for p in a.presets]
    command = " ".join([COMMAND, *(argv if argv is not None else sys.argv[1:])]).strip()
    text = render(plans, command, a.gpu_gib, a.reserve_gib)
    out = Path(a.out)
    atomic_write_text(out / "presets.md", text)
    atomic_write_json(out / "presets.json", {**provenance(command), "gpu_gib": a.gpu_gib, "reserve_gib": a.reserve_gib,
                                             "unit": "bytes per GPU", "plans": plans})
    print(text)
    return plans


def cli() -> None:
    """The ``datc-memory-plan`` console command (``main``'s plans are for callers in Python)."""
    main()


if __name__ == "__main__":
    cli()
