"""Per-GPU memory plan of the paper presets under DeepSpeed ZeRO-2 and ZeRO-3, written to
<out>/presets.{md,json} (default runs/memory; the committed tables are regenerated on purpose
with ``--out results/memory``).

    python scripts/memory_plan.py [--presets qwen3_ultrafeedback ...] [--gpu-gib 80] [--credit datc] [--out DIR]

Everything is read from the composed config (parameter counts from the ``arch`` blocks, built on
the ``meta`` device; batch sizes, lengths and ZeRO stage from ``trainer``/``data``/``deepspeed``).
The arithmetic lives in small pure functions so the tests check it against hand numbers. It is
an estimate of the tensors the training step holds, per process, not a measurement: CUDA context,
allocator fragmentation and NCCL buffers are not included (see ``--reserve-gib``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRESETS = ("qwen3_ultrafeedback", "qwen3_hh_rlhf", "llama32_ultrafeedback", "llama32_hh_rlhf")
GPU_COUNTS = (1, 2, 4, 8)
FIT_COUNTS = (1, 2, 4, 8, 16)
STAGES = (2, 3)
GIB = 2**30
# DeepSpeed defaults the configs leave untouched (deepspeed/runtime/zero/config.py).
REDUCE_BUCKET = 500_000_000  # elements, zero_optimization.reduce_bucket_size


# ============================================================================================
# Pure arithmetic (bytes), checked by hand in tests/test_memory_plan.py
# ============================================================================================


@dataclass(frozen=True)
class Arch:
    """The fields of a policy/reward ``arch`` block that memory depends on."""

    model_type: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie: bool

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qk_norm(self) -> bool:  # Qwen3 normalizes q and k per head
        return self.model_type == "qwen3"


def arch_of(arch: dict[str, Any]) -> Arch:
    a = dict(arch)
    h, heads = a["hidden_size"], a["num_attention_heads"]
    return Arch(a["model_type"], a["num_hidden_layers"], h, a["intermediate_size"], heads,
                a.get("num_key_value_heads", heads), a.get("head_dim") or h // heads, a["vocab_size"],
                bool(a.get("tie_word_embeddings", False)))


def param_count_formula(a: Arch, kind: str) -> int:
    """Parameters of a Llama/Qwen3 decoder by hand: embedding V·h; per layer q/k/v/o projections
    (h·q + 2·h·kv + q·h, no biases), q/k norms (Qwen3: 2·head_dim), SwiGLU MLP 3·h·I and two
    RMSNorms 2·h; final norm h; then an untied LM head V·h (``causal_lm``) or a score head h
    (``reward``, one output, no bias)."""
    layer = a.hidden * a.q_dim + 2 * a.hidden * a.kv_dim + a.q_dim * a.hidden + 3 * a.hidden * a.intermediate + 2 * a.hidden
    layer += 2 * a.head_dim if a.qk_norm else 0
    n = a.vocab * a.hidden + a.layers * layer + a.hidden
    if kind == "causal_lm":
        return n + (0 if a.tie else a.vocab * a.hidden)
    return n + a.hidden


def param_count(arch: dict[str, Any], kind: str) -> int:
    """Exact parameter count of the model transformers builds from ``arch`` (``causal_lm`` or
    ``reward``: ...ForSequenceClassification with one output), instantiated on the meta device
    (no memory, no download). Tied weights are counted once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    a = dict(arch)
    extra = {"num_labels": 1} if kind == "reward" else {}
    conf = AutoConfig.for_model(a.pop("model_type"), **a, **extra)
    cls = AutoModelForCausalLM if kind == "causal_lm" else AutoModelForSequenceClassification
    with torch.device("meta"):
        model = cls.from_config(conf)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


def zero_memory(n_params: int, stage: int, n_gpus: int) -> dict[str, float]:
    """Bytes per GPU of the trained policy's model states under DeepSpeed with fp32 parameters
    (bf16 only through torch autocast) and AdamW:

    - ``weights``: the model's fp32 parameters, 4Φ (ZeRO-2, replicated) or 4Φ/N (ZeRO-3);
    - ``grads``: fp32 gradient partition, 4Φ/N (both stages);
    - ``optimizer``: AdamW's two fp32 moments 8Φ/N, plus under ZeRO-2 the optimizer's own fp32
      copy of its parameter partition 4Φ/N (DeepSpeed clones it even when the model is fp32;
      ZeRO-3 updates the fp32 partition in place).
    """
    shard = n_params / n_gpus
    return {"weights": 4 * (n_params if stage == 2 else shard), "grads": 4 * shard,
            "optimizer": (12 if stage == 2 else 8) * shard}


def frozen_memory(n_params: int, stage: int, n_gpus: int, bytes_per_param: int = 2) -> float:
    """A frozen bf16 model: replicated under ZeRO-2, sharded under ZeRO-3."""
    return bytes_per_param * n_params / (1 if stage == 2 else n_gpus)


def gathered_working_set(a: Arch, n_params: int, bytes_per_param: int) -> float:
    """ZeRO-3: the full parameters gathered while a forward runs through them, taken as the
    largest module (the embedding / LM head, V·h) plus two transformer layers (the current one and
    the prefetched next)."""
    layer = (n_params - a.vocab * a.hidden) / a.layers
    return bytes_per_param * (a.vocab * a.hidden + 2 * layer)


def kv_cache_bytes(a: Arch, batch: int, tokens: int, key_bytes: int = 4, value_bytes: int = 2) -> float:
    """KV cache of ``generate``: per layer, per token, kv_heads·head_dim keys and values. Under
    bf16 autocast with fp32 weights the values are bf16 but the keys are fp32 (RoPE multiplies the
    bf16 projection by fp32 cos/sin), hence 4 + 2 bytes by default."""
    return a.layers * batch * tokens * a.kv_dim * (key_bytes + value_bytes)


def activation_bytes(a: Arch, rows: int, seq: int, weight_grads: bool) -> float:
    """Tensors a forward saves for its backward (no recomputation, SDPA/flash attention so no
    seq² term, no dropout), per token:

    - trained policy (``weight_grads``; bf16 autocast over an fp32 residual stream), per layer
      2·(2h + 3q + 2kv + 4I) bytes of bf16 (the inputs of the q/k/v and gate/up projections,
      attention's q, k, v and output, the o_proj input, the SiLU input and output, up and the
      down_proj input) + 16h (two RMSNorms each keep their fp32 input and output) + Qwen3's
      q/k norms 8(q + kv); outside the layers 8h + 8·head_dim (final norm, fp32 RoPE tables);
    - frozen reward model differentiated to its inputs only (bf16 weights that need no
      gradient, so matmul inputs are not kept), per layer 8h + 2·(2q + 2kv + 3I) (+ Qwen3
      4(q + kv)); outside the layers 4h + 4·head_dim.

    h hidden, q = heads·head_dim, kv = kv_heads·head_dim, I intermediate. Checked against the
    tensors torch saves for tiny models in tests/test_memory_plan.py."""
    h, q, kv, i = a.hidden, a.q_dim, a.kv_dim, a.intermediate
    if weight_grads:
        layer = 2 * (2 * h + 3 * q + 2 * kv + 4 * i) + 16 * h + (8 * (q + kv) if a.qk_norm else 0)
        outside = 8 * h + 8 * a.head_dim
    else:
        layer = 8 * h + 2 * (2 * q + 2 * kv + 3 * i) + (4 * (q + kv) if a.qk_norm else 0)
        outside = 4 * h + 4 * a.head_dim
    return rows * seq * (a.layers * layer + outside)


def update_logits_bytes(rows: int, prompt: int, response: int, vocab: int) -> float:
    """Logits of one update micro-batch: the bf16 LM-head output over all P+T positions
    (2·m·(P+T)·V), then over the T response positions three fp32 (m, T, V) tensors at once: the
    ``[:, P-1:-1]`` fp32 copy, its temperature-scaled copy (kept by the log-softmax for
    backward) and, in backward, its gradient (3·4·m·T·V)."""
    return 2 * rows * (prompt + response) * vocab + 3 * 4 * rows * response * vocab


def entropy_pass_bytes(rows: int, response: int, vocab: int) -> float:
    """The no-grad entropy of a micro-batch's fp32 logits: the logits, log_softmax, its exp and
    their product, four fp32 (m, T, V) tensors."""
    return 4 * 4 * rows * response * vocab


def no_grad_pass_bytes(rows: int, prompt: int, response: int, vocab: int, hidden: int, intermediate: int) -> float:
    """One no-grad policy pass of ``rows`` responses (old/reference log-probs, evaluation): the
    bf16 logits over P+T positions, the fp32 (m, T, V) working set of the log-softmax and the
    entropy (4 tensors), and one layer's transients (fp32 residual 4h, bf16 gate/up 2·2I)."""
    return (2 * rows * (prompt + response) * vocab + entropy_pass_bytes(rows, response, vocab)
            + rows * (prompt + response) * (4 * hidden + 4 * intermediate))


def datc_chunk_bytes(chunk: int | None, vocab: int) -> float:
    """DATC's closed forms per chunk of tokens: the gathered logits, π (then, in place, the
    two weightings of ρ) and ρ = E g, three fp32 (chunk, V) tensors; ``chunk`` None: the rows
    ``datc_math.chunk_rows`` sizes by memory."""
    from datc.credit.datc_math import chunk_rows

    return 3 * 4 * chunk_rows(chunk, vocab) * vocab


def zero_buffers(stage: int, overlap_comm: bool, reduce_bucket: int = REDUCE_BUCKET, grad_bytes: int = 4) -> float:
    """DeepSpeed's gradient-reduction buckets during backward: ZeRO-2 one contiguous bucket of
    reduce_bucket_size elements (two with overlap_comm), ZeRO-3 one."""
    n = (2 if overlap_comm else 1) if stage == 2 else 1
    return n * reduce_bucket * grad_bytes


# ============================================================================================
# The plan of one composed config
# ============================================================================================


def compose(preset: str, overrides: list[str] = ()):  # -> TrainConfig
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from datc.config import validate
    from datc.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=[f"experiment=paper/{preset}", *overrides])
    return validate(cfg)


def world_ok(c, n_gpus: int, stage: int) -> str | None:
    """None if the batch splits over ``n_gpus`` processes (``datc.distributed.check_world``),
    else its message."""
    import dataclasses

    from datc.config import ConfigError
    from datc.distributed import check_world

    c = dataclasses.replace(c, deepspeed=dataclasses.replace(c.deepspeed, stage=stage))
    try:
        check_world(c, n_gpus)
    except ConfigError as e:
        return str(e)
    return None


def plan(c, counts: dict[str, int], stage: int, n_gpus: int) -> dict[str, Any]:
    """Bytes per GPU, per item and per phase of one training step, for ``c`` run with ZeRO
    ``stage`` on ``n_gpus`` processes. ``counts``: {"policy": Φ_p, "reward": Φ_r}."""
    from datc.credit import resolve_scheme
    from datc.credit.base import POLICY_LOGITS, RM_EMBEDDING, RM_GRAD
    from datc.distributed import micro_batch_per_rank
    from datc.trainer import pass_plan

    t = c.trainer
    pa, ra = arch_of(c.policy.arch), arch_of(c.reward.arch)
    phi_p, phi_r = counts["policy"], counts["reward"]
    scheme = resolve_scheme(c.credit)[0]
    needs = scheme.needs
    rows = t.batch_size // n_gpus  # responses per rank (whole groups)
    micro = micro_batch_per_rank(c, n_gpus)  # update micro-batch
    pass_micro = t.micro_batch_size  # no-grad passes and the reward model use it uncapped
    P, T, V = c.data.max_prompt_tokens, t.max_new_tokens, pa.vocab
    reuse = pass_plan(t, needs, V).reuse  # the trainer's own decision
    # (rows, T, V) fp32: generate's logits when reused; else a row-local scheme (the DATC family)
    # gets them one micro-batch of rows at a time, any other scheme for all rows at once
    logit_rows = rows if reuse or not scheme.row_local else min(pass_micro, rows)
    held_logits = 4 * logit_rows * T * V if (reuse or POLICY_LOGITS in needs) else 0

    z = zero_memory(phi_p, stage, n_gpus)
    static = {
        "policy_weights": z["weights"], "grads": z["grads"], "optimizer": z["optimizer"],
        "reference": frozen_memory(phi_p, stage, n_gpus) if t.beta > 0 else 0.0,
        "reward_model": frozen_memory(phi_r, stage, n_gpus),
        "rm_embedding": 4 * ra.vocab * ra.hidden if RM_EMBEDDING in needs else 0.0,  # gathered, fp32
    }
    gather_p = gathered_working_set(pa, phi_p, 4) if stage == 3 else 0.0
    gather_f = gathered_working_set(ra, phi_r, 2) if stage == 3 else 0.0
    rm_grad = 4 * rows * T * ra.hidden if RM_GRAD in needs else 0.0  # (rows, T, d) fp32
    gen_rows = min(t.generation_batch_size or rows, rows)  # responses per sampling call
    kv = kv_cache_bytes(pa, gen_rows, P + T)
    kv_eval = kv_cache_bytes(pa, t.eval_batch_size, P + T)  # every rank evaluates whole batches
    prefill = gen_rows * P * (4 * pa.hidden + 4 * pa.intermediate)
    act_policy = activation_bytes(pa, micro, P + T, weight_grads=True)
    act_rm = activation_bytes(ra, min(pass_micro, rows), P + T, weight_grads=False) if RM_GRAD in needs else 0.0
    logits_update = max(update_logits_bytes(micro, P, T, V), entropy_pass_bytes(micro, T, V))
    pass_bytes = no_grad_pass_bytes(min(pass_micro, rows), P, T, V, pa.hidden, pa.intermediate)
    credit_chunk = datc_chunk_bytes(c.credit.get("chunk_size"), V) if POLICY_LOGITS in needs else 0.0
    weight_copy = 2 * phi_p  # autocast's bf16 weight casts, saved for backward (no cast cache under DeepSpeed)
    buffers = zero_buffers(stage, c.deepspeed.overlap_comm)
    phases = {
        "generate": kv + prefill + (2 * held_logits if reuse else 0.0) + gather_p,
        "eval": kv_eval + t.eval_batch_size * P * (4 * pa.hidden + 4 * pa.intermediate) + gather_p,
        "reward": act_rm + rm_grad + (held_logits if reuse else 0.0) + gather_f,
        "logprob_passes": held_logits + rm_grad + pass_bytes + max(gather_p, gather_f),
        "credit": held_logits + rm_grad + credit_chunk,
        # the trainer frees the credit's inputs (logits, RM gradients) before the update
        "update": act_policy + logits_update + weight_copy + buffers + gather_p,
    }
    peak_phase = max(phases, key=phases.get)
    total = sum(static.values()) + phases[peak_phase]
    return {
        "static": static, "phases": phases, "peak_phase": peak_phase, "total": total,
        "items": {**static, "kv_cache": kv, "activations_policy": act_policy, "activations_rm": act_rm,
                  "logits_update": logits_update, "autocast_weight_copy": weight_copy, "zero_buffers": buffers,
                  "zero3_gathered": max(gather_p, gather_f), "held_logits": held_logits, "rm_grad": rm_grad,
                  "datc_chunk": credit_chunk},
        "rows_per_rank": rows, "micro_per_rank": micro, "reuse_rollout_logits": reuse,
    }


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
            p = plan(c, counts, stage, n)
            p["allowed"] = True
            p["fits"] = p["total"] <= (gpu_gib - reserve_gib) * GIB
            per_n[n] = p
            if needed is None and n in FIT_COUNTS and p["fits"]:
                needed = n
        out["stages"][f"zero{stage}"] = {"per_gpus": per_n, "gpus_needed": needed}
    return out


# ============================================================================================
# Output
# ============================================================================================


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


ITEM_ROWS = (("policy_weights", "policy weights"), ("grads", "gradients"), ("optimizer", "optimizer state"),
             ("reference", "reference model"), ("reward_model", "reward model"), ("kv_cache", "KV cache (generate)"),
             ("activations_policy", "policy activations (1 micro-batch)"), ("logits_update", "update logits (fp32)"),
             ("autocast_weight_copy", "bf16 weight casts (update)"), ("zero_buffers", "ZeRO reduce buckets"),
             ("zero3_gathered", "ZeRO-3 gathered params"), ("activations_rm", "RM activations (input grad)"),
             ("held_logits", "rollout logits held for credit"), ("rm_grad", "RM input gradients"),
             ("rm_embedding", "RM embedding (fp32)"), ("datc_chunk", "DATC chunk"))


def render(plans: list[dict[str, Any]], command: str, gpu_gib: float, reserve_gib: float) -> str:
    lines = [
        "# Per-GPU memory of the paper presets",
        "",
        f"Written by `{command}`. Estimates of the tensors one training step holds per process",
        f"(GiB = 2^30 bytes), not measurements; \"GPUs\" is the smallest N of {', '.join(map(str, FIT_COUNTS))} whose peak",
        f"fits {gpu_gib:g} GiB less a {reserve_gib:g} GiB reserve (CUDA context, allocator fragmentation, NCCL), among",
        "the N the batch splits over (`datc.distributed.check_world`). \"-\": N not allowed; \"none\": no N fits.",
        "",
        "| preset | ZeRO | policy / RM params (B) | N=1 | N=2 | N=4 | N=8 | GPUs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        for stage, s in p["stages"].items():
            cells = [(_gib(s["per_gpus"][n]["total"]) if s["per_gpus"][n]["allowed"] else "-") for n in GPU_COUNTS]
            params = f"{p['params']['policy'] / 1e9:.3f} / {p['params']['reward'] / 1e9:.3f}"
            lines.append(f"| {p['preset']} | {stage[-1]} | {params} | {' | '.join(cells)} | {s['gpus_needed'] or 'none'} |")
    lines += ["", "## How the numbers are computed", "",
              "Φ = parameter count (exact: the `arch` block built with transformers on the meta device), N = processes,",
              "B = trainer.batch_size, rows = B/N responses per process, m = micro-batch per process",
              "(min(micro_batch_size, mini_batch_size/N)), P = data.max_prompt_tokens (prompts padded to at most this),",
              "T = max_new_tokens, V = vocabulary, h/I/L = hidden/intermediate/layers, q = heads·head_dim,",
              "kv = kv_heads·head_dim. Peak = static + the largest phase.", "",
              "Static (whole run):",
              "- policy weights fp32: 4Φ (ZeRO-2) or 4Φ/N (ZeRO-3); gradients fp32: 4Φ/N;",
              "- optimizer: AdamW moments 8Φ/N, plus DeepSpeed's fp32 copy of the partition 4Φ/N under ZeRO-2",
              "  (ZeRO-3 with an fp32 model updates the partition in place);",
              "- reference policy (trainer.beta > 0) and reward model in bf16: 2Φ each, /N under ZeRO-3;",
              "- DATC: the reward model's input embedding gathered in fp32, 4·V·h.", "",
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
              "  under ZeRO-3 the gathered working set, the embedding plus two layers, in every forward.", "",
              "Not included: CUDA context and caching-allocator slack (the reserve), NCCL buffers, tokenizer and",
              "host memory, DeepSpeed's all-gather buckets, the score head's negligible (rows, P+T, 1) output.",
              "The activation formulas are checked against the tensors torch saves for tiny models of both",
              "families in tests/test_memory_plan.py.", ""]
    for p in plans:
        lines += [f"## {p['preset']}: breakdown (GiB per GPU)", "",
                  f"credit={p['credit']}, batch {p['batch']['batch_size']} responses "
                  f"({p['batch']['batch_size'] // p['batch']['num_generations']} prompts x {p['batch']['num_generations']}), "
                  f"mini-batch {p['batch']['mini_batch_size']}, micro-batch {p['batch']['micro_batch_size']}, "
                  f"P={p['batch']['max_prompt_tokens']}, T={p['batch']['max_new_tokens']}, beta={p['batch']['beta']}.", "",
                  "| item | " + " | ".join(f"Z{st[-1]} N={n}" for st in p["stages"] for n in GPU_COUNTS) + " |",
                  "|---|" + "---|" * (len(p["stages"]) * len(GPU_COUNTS))]
        cols = [p["stages"][st]["per_gpus"][n] for st in p["stages"] for n in GPU_COUNTS]
        for key, label in ITEM_ROWS:
            lines.append(f"| {label} | " + " | ".join(_gib(col["items"][key]) if col["allowed"] else "-" for col in cols) + " |")
        lines.append("| **peak** (phase) | " + " | ".join(f"**{_gib(col['total'])}** ({col['peak_phase']})" if col["allowed"]
                                                      else "-" for col in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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

    overrides = [f"credit={a.credit}", *a.overrides]
    cache: dict = {}
    plans = [plan_preset(p, a.gpu_gib, a.reserve_gib, overrides, cache) for p in a.presets]
    command = " ".join(["python scripts/memory_plan.py", *(argv if argv is not None else sys.argv[1:])]).strip()
    text = render(plans, command, a.gpu_gib, a.reserve_gib)
    out = Path(a.out)
    atomic_write_text(out / "presets.md", text)
    atomic_write_json(out / "presets.json", {"command": command, "gpu_gib": a.gpu_gib, "reserve_gib": a.reserve_gib,
                                             "unit": "bytes per GPU", "plans": plans})
    print(text)
    return plans


if __name__ == "__main__":
    main()
