"""The arithmetic of the per-GPU memory plan (:mod:`datc.memory.plan`, ``datc-memory-plan``), in
bytes: parameter counts of a Llama/Qwen3 decoder, DeepSpeed ZeRO-2/ZeRO-3 model states, KV cache,
activations, logits and buffers. Small pure functions, checked against hand numbers and the
tensors torch saves for tiny models in tests/memory/test_memory_plan.py; nothing here loads a model
(:func:`param_count` builds one on the ``meta`` device)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GIB = 2**30
# DeepSpeed defaults the configs leave untouched (deepspeed/runtime/zero/config.py).
REDUCE_BUCKET = 500_000_000  # elements, zero_optimization.reduce_bucket_size
FSDP2 = "fsdp2"  # the plan's stage for backend=fsdp2, beside None (plain PyTorch) and ZeRO's 2 and 3
# trainer.micro_batch_size: auto (datc.memory.micro_batch, and datc-memory-plan's tables)
RESERVE_BYTES = 4 * GIB  # kept free, as datc-memory-plan's --reserve-gib
MARGIN = 1.15  # the plan is within 15% of the measured peaks (tests/memory/test_memory_plan.py)
FALLBACK = 4  # largest micro-batch for a policy the plan does not cover (the paper presets' value)


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


def lora_param_count_formula(a: Arch, r: int) -> int:
    """Adapter parameters of LoRA rank ``r`` on every attention and MLP projection of a
    Llama/Qwen3 decoder (``datc.models.lora.DEFAULT_TARGETS``): a map of d_in -> d_out gets A (r, d_in)
    and B (d_out, r), r·(d_in + d_out); per layer q (h -> q), k and v (h -> kv), o (q -> h),
    gate and up (h -> I), down (I -> h): r·(7h + 2q + 2kv + 3I)."""
    return r * a.layers * (7 * a.hidden + 2 * a.q_dim + 2 * a.kv_dim + 3 * a.intermediate)


def lora_param_count(arch: dict[str, Any], lora) -> int:
    """Exact adapter parameter count: the ``arch`` model built on the meta device with
    ``policy.lora``'s adapters added (:func:`datc.models.lora.add_adapters`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from datc.models.lora import add_adapters

    a = dict(arch)
    conf = AutoConfig.for_model(a.pop("model_type"), **a)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf)
        add_adapters(model, lora)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def zero_memory(n_params: int, stage: int | None, n_gpus: int, param_bytes: int = 4,
                foreach_adam: bool = True) -> dict[str, float]:
    """Bytes per GPU of the trained policy's model states and AdamW, with its parameters in
    ``param_bytes`` (4: the fp32 master weights the trainer loads, bf16 only through torch autocast;
    2: a bf16 policy, what the H200 run of results/gpu/ trained, its loader then keeping the
    checkpoint's bf16). ``stage`` None: plain PyTorch (one process, fused AdamW); 2 or 3:
    DeepSpeed ZeRO with ``n_gpus`` processes. Re-fitted to that run's measured peaks
    (tests/memory/test_memory_plan.py replays every case it measured):

    - ``weights``: the model's parameters, pΦ (plain, ZeRO-2: replicated) or pΦ/N (ZeRO-3);
    - ``grads``: p bytes per parameter, Φ (plain) or the partition Φ/N (ZeRO; ZeRO-3 holds its
      flat gradient buffer for the whole run);
    - ``optimizer``: plain torch AdamW keeps its two moments in the parameters' dtype, 2pΦ (a bf16
      policy: 4Φ; the first fit counted 8Φ, 3.2 GiB of the 16 GiB it over-estimated there); under
      ZeRO the optimizer's fp32 copy of the partition 4Φ/N (``clone().float()``, at both stages
      and whatever p) and its fp32 moments 8Φ/N;
    - ``step``: what the ZeRO optimizer step adds for a moment, when no activation is held: the
      flattened gradient partition cast to fp32 (4Φ/N) and, with torch's AdamW
      (``foreach_adam``, ``deepspeed.optimizer_impl`` torch or auto's fallback), its foreach
      update's fp32 temporary (sqrt of the second moment, 4Φ/N); plain PyTorch's fused AdamW adds
      none. ZeRO-3's measured peak (44.95 GiB, first planned 42.30) is this phase: 24Φ of states
      and step plus the two frozen bf16 models.
    """
    p = param_bytes
    if stage is None:
        return {"weights": p * n_params, "grads": p * n_params, "optimizer": 2 * p * n_params, "step": 0.0}
    shard = n_params / n_gpus
    if stage == FSDP2:  # see fsdp2_memory
        return fsdp2_memory(n_params, n_gpus, p)
    return {"weights": p * (n_params if stage in (0, 1, 2) else shard), "grads": p * shard, "optimizer": 12 * shard,
            "step": (8 if foreach_adam else 4) * shard}


def fsdp2_memory(n_params: int, n_gpus: int, param_bytes: int = 4) -> dict[str, float]:
    """Bytes per GPU of the policy's states under FSDP2 (:mod:`datc.backends.fsdp2`): every state
    is a DTensor shard, with no second copy: the parameters pΦ/N, their reduce-scattered gradients
    pΦ/N, torch AdamW's two moments in the parameters' dtype 2pΦ/N, and its foreach step's
    temporary (the second moment's square root) pΦ/N. Not yet fitted to a measured peak (the GPU
    check's ``/fsdp2`` cases record one beside this plan)."""
    shard = param_bytes * n_params / n_gpus
    return {"weights": shard, "grads": shard, "optimizer": 2 * shard, "step": shard}


def fsdp2_reduce_bytes(a: Arch, n_params: int, grad_bytes: int) -> float:
    """FSDP2's reduce-scatter input during the backward: a block's whole gradient, and the root's
    (embedding, final norm, LM head), whole until the root's own reduce-scatter at the end."""
    layer = (n_params - a.vocab * a.hidden) / a.layers
    return grad_bytes * (a.vocab * a.hidden + layer)


def frozen_memory(n_params: int, stage: int, n_gpus: int, bytes_per_param: int = 2) -> float:
    """A frozen bf16 model: replicated without DeepSpeed (``stage`` None) and under ZeRO-2, sharded under ZeRO-3."""
    return bytes_per_param * n_params / (n_gpus if stage == 3 else 1)


def gathered_working_set(a: Arch, n_params: int, bytes_per_param: int) -> float:
    """ZeRO-3: the full parameters gathered while a forward runs through them, taken as the
    largest module (the embedding / LM head, V·h) plus two transformer layers (the current one and
    the prefetched next). FSDP2 the same: its root (embedding, norm, tied head) whole from its
    forward to its backward, a block unsharded and the next one prefetched."""
    layer = (n_params - a.vocab * a.hidden) / a.layers
    return bytes_per_param * (a.vocab * a.hidden + 2 * layer)


def kv_cache_bytes(a: Arch, batch: int, tokens: int, key_bytes: int = 4, value_bytes: int = 2) -> float:
    """KV cache of ``generate``: per layer, per token, kv_heads·head_dim keys and values. Under
    bf16 autocast with fp32 weights the values are bf16 but the keys are fp32 (RoPE multiplies the
    bf16 projection by fp32 cos/sin), hence 4 + 2 bytes by default."""
    return a.layers * batch * tokens * a.kv_dim * (key_bytes + value_bytes)


def activation_bytes(a: Arch, rows: int, seq: int, weight_grads: bool, checkpointed: bool = False) -> float:
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
    tensors torch saves for tiny models in tests/memory/test_memory_plan.py. ``checkpointed``
    (``trainer.gradient_checkpointing``, the trained policy only): each decoder block keeps its
    fp32 input, 4h per layer per token, and one block's tensors exist while it is recomputed.

    Under a bf16 policy (the H200 run's) the residual stream is bf16 and these are upper bounds;
    that run's peaks are not in this phase, so it does not test them."""
    h, q, kv, i = a.hidden, a.q_dim, a.kv_dim, a.intermediate
    if weight_grads and checkpointed:  # each block keeps its fp32 input; one block's own set while recomputed
        layer = 2 * (2 * h + 3 * q + 2 * kv + 4 * i) + 16 * h + (8 * (q + kv) if a.qk_norm else 0)
        return rows * seq * (a.layers * 4 * h + layer + 8 * h + 8 * a.head_dim)
    if weight_grads:
        layer = 2 * (2 * h + 3 * q + 2 * kv + 4 * i) + 16 * h + (8 * (q + kv) if a.qk_norm else 0)
        outside = 8 * h + 8 * a.head_dim
    else:
        layer = 8 * h + 2 * (2 * q + 2 * kv + 3 * i) + (4 * (q + kv) if a.qk_norm else 0)
        outside = 4 * h + 4 * a.head_dim
    return rows * seq * (a.layers * layer + outside)


def update_logits_bytes(rows: int, prompt: int, response: int, vocab: int, head_chunk: int | None = None) -> float:
    """Logits of one update micro-batch: the bf16 LM-head output over all P+T positions
    (2·m·(P+T)·V), then over the T response positions three fp32 (m, T, V) tensors at once: the
    ``[:, P-1:-1]`` fp32 copy, its temperature-scaled copy (kept by the log-softmax for
    backward) and, in backward, its gradient (3·4·m·T·V). With ``trainer.lm_head_chunk`` k
    (:func:`datc.math.logprobs.chunked_head_logps`) the head runs on k response positions at a time
    under checkpointing, so only one chunk's bf16 and three fp32 (m, k, V) tensors exist."""
    if head_chunk is not None:
        k = min(head_chunk, response)
        return 2 * rows * k * vocab + 3 * 4 * rows * k * vocab
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


def zero_buffers(stage: int | None, overlap_comm: bool, reduce_bucket: int = REDUCE_BUCKET, grad_bytes: int = 4) -> float:
    """DeepSpeed's gradient-reduction buckets during backward, in the gradients' dtype (the
    parameters'): ZeRO-2 one contiguous bucket of reduce_bucket_size elements (two with
    overlap_comm), ZeRO-3 one; none without DeepSpeed."""
    if stage is None:
        return 0.0
    n = (2 if overlap_comm else 1) if stage in (0, 1, 2) else 1
    return n * reduce_bucket * grad_bytes


# ============================================================================================
# trainer.micro_batch_size: auto (datc.memory.micro_batch resolves it for a run)
# ============================================================================================


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_micro_batch(per_rank_mini: int, planned_peak: Callable[[int], float] | None,
                       budget_bytes: float | None) -> tuple[int, str]:
    """(micro-batch, why): the largest divisor n of ``per_rank_mini`` with ``planned_peak(n) *
    MARGIN <= budget_bytes``; ``budget_bytes`` None (the CPU): ``per_rank_mini``; ``planned_peak``
    None (a model the plan does not cover): the largest divisor <= :data:`FALLBACK`."""
    if budget_bytes is None:
        return per_rank_mini, f"no device memory to plan for (CPU): the whole per-process mini-batch, {per_rank_mini}"
    options = divisors(per_rank_mini)
    if planned_peak is None:
        n = max(d for d in options if d <= FALLBACK)
        return n, (f"the memory plan does not cover this policy's architecture: the largest divisor of the "
                   f"per-process mini-batch {per_rank_mini} up to {FALLBACK}")
    peaks = {d: planned_peak(d) for d in options}
    fits = [d for d in options if peaks[d] * MARGIN <= budget_bytes]
    budget = f"{budget_bytes / GIB:.1f} GiB (device memory less {RESERVE_BYTES / GIB:g} GiB)"
    if not fits:
        return 1, (f"not even 1 response fits: planned peak {peaks[1] / GIB:.1f} GiB x {MARGIN} over {budget}; "
                   "1, and the run may run out of memory")
    n = max(fits)
    nxt = next((d for d in options if d > n), None)
    more = f"; {nxt} would plan {peaks[nxt] / GIB:.1f} GiB" if nxt is not None else ""
    return n, (f"largest divisor of the per-process mini-batch {per_rank_mini} whose planned peak "
               f"({peaks[n] / GIB:.1f} GiB) x {MARGIN} fits {budget}{more}")
