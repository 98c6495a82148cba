"""Decode throughput of the dynamic-cache loop and the static-cache step side by side, the bound the
memory bandwidth sets on it, and whether a CUDA graph's replay computes what the eager step does:
the measurements of the GPU check's ``decode`` case (scripts/gpu_check/cases.py) and of
``python -m scripts.bench.decode`` (CPU).

Every call goes through :func:`datc.engines.generate.sample_tokens`, the rollout's own sampler, forced to
the full budget (``min_new_tokens = max_new_tokens``: random weights or a testbed policy stop
at different lengths, and the loops must do the same work). Modes: ``dynamic`` (today's loop;
GPT-2's lean step where it applies), ``static`` (the static-cache step run eagerly) and
``static_graph`` (the same step replayed as a captured CUDA graph; off CUDA it runs eagerly),
``static_graph_to_budget`` (the same without the host's every-``sync_every`` check: what the
checks cost when no row stops early).

Shapes: B rows, P prompt width, T = ``max_new_tokens``, V vocabulary.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import Tensor

from datc.engines.generate import prefill, sample_tokens
from datc.engines.static_decode import static_decoder

MODES: dict[str, dict[str, Any]] = {
    "dynamic": {"decode": "dynamic"},
    "static": {"decode": "static", "graph": False},
    "static_graph": {"decode": "static", "graph": True},
    "static_graph_to_budget": {"decode": "static", "graph": True, "sync_every": 2**31},  # no check: run to the budget
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_modes(policy, ids: Tensor, mask: Tensor, max_new_tokens: int, eos_id: int, pad_id: int, modes: list[str],
               repeats: int, prompt_repeats: int = 1, sync_every: int = 8) -> dict[str, dict[str, float]]:
    """Seconds per sampling call of each mode (interleaved, the order reversed every other round,
    after one warm-up round), and of the prefill alone (a call with ``max_new_tokens=1``: the
    prefill and one draw). Per mode: ``call_s`` (median), ``step_s`` = (call - prefill) / (T - 1),
    ``tokens_per_s`` = B·T / call and ``decode_tokens_per_s`` = B / step."""
    device = ids.device
    B, T = ids.shape[0], max_new_tokens

    def call(mode: str | None) -> float:
        n = 1 if mode is None else T
        kw = {"sync_every": sync_every, **(MODES[mode] if mode is not None else {})}
        _sync(device)
        t0 = time.perf_counter()
        sample_tokens(policy, ids, mask, n, 1.0, 1.0, eos_id, pad_id, min_new_tokens=n, prompt_repeats=prompt_repeats,
                      **kw)
        _sync(device)
        return time.perf_counter() - t0

    runs: list[str | None] = [None, *modes]
    times: dict[str | None, list[float]] = {m: [] for m in runs}
    for r in range(repeats + 1):
        for m in runs if r % 2 == 0 else list(reversed(runs)):
            s = call(m)
            if r > 0:  # the first round warms up (allocator, kernels, autocast casts)
                times[m].append(s)
    prefill_s = statistics.median(times[None])
    out: dict[str, dict[str, float]] = {"prefill": {"call_s": prefill_s}}
    for m in modes:
        c = statistics.median(times[m])
        step = max(c - prefill_s, 1e-12) / max(T - 1, 1)
        out[m] = {"call_s": c, "min_s": min(times[m]), "step_s": step, "tokens_per_s": B * T / c,
                  "decode_tokens_per_s": B / step}
    return out


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes per second of a device-to-device copy of ``nbytes`` (each byte read once and
    written once: 2·nbytes moved per copy), the median of ``repeats`` after one warm-up."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for r in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if r:
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


@torch.no_grad()
def kv_bytes_per_position(policy, ids: Tensor, mask: Tensor) -> int:
    """Bytes the KV cache holds per row and position, read off a one-row prefill (under the
    caller's autocast: keys after RoPE may be float32 while values are bfloat16)."""
    cache = prefill(policy, ids[:1], mask[:1]).cache
    layers = next(iter(cache.values())).layers
    return sum(x.element_size() * x.shape[1] * x.shape[3] for layer in layers for x in (layer.keys, layer.values))


def weight_bytes(policy, low_precision: bool) -> int:
    """Bytes of weights one decode step reads: every parameter but an input embedding that is not
    also the LM head (a lookup reads B rows of it). ``low_precision`` (bf16 or fp16 autocast):
    matrices are read as their 2-byte casts; vectors (norms, biases) at their own size."""
    model = getattr(policy, "module", policy)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = 0
    for p in model.parameters():
        if p is emb and emb is not head:
            continue
        total += p.numel() * (2 if low_precision and p.ndim >= 2 else p.element_size())
    return total


def hbm_bound(policy, ids: Tensor, mask: Tensor, max_new_tokens: int, low_precision: bool,
              bandwidth: float) -> dict[str, float]:
    """The memory-bandwidth bound of one decode step of B rows: the weights plus the KV cache at
    its mean live length over the T - 1 forwarded steps (P + T/2 positions: what a decode
    must read; the static cache also holds the masked positions past the current one), over
    ``bandwidth`` bytes/s. -> bytes and seconds per step."""
    B, P = ids.shape
    w = weight_bytes(policy, low_precision)
    kv = kv_bytes_per_position(policy, ids, mask) * B * (P + max_new_tokens / 2)
    return {"weight_bytes": w, "kv_bytes": kv, "step_bytes": w + kv, "bound_step_s": (w + kv) / bandwidth}


@torch.no_grad()
def graph_vs_eager(policy, ids: Tensor, mask: Tensor, max_new_tokens: int, eos_id: int, pad_id: int,
                   prompt_repeats: int = 1) -> dict[str, Any]:
    """The static step replayed as a CUDA graph against the same step run eagerly on the graph's
    own sampled tokens (fed back through :attr:`StaticDecoder.forced`): their kept logits
    (B, T, V). ``within_bf16``: every |graph - eager| <= 2^-7 · (|eager| + 1), two bfloat16 ulps
    (the logits leave the LM head in bf16 under autocast). Off CUDA both runs are eager."""
    kw = dict(temperature=1.0, top_p=1.0, eos_id=eos_id, pad_id=pad_id, min_new_tokens=max_new_tokens,
              keep_logits=True, synced_gpus=False)
    runs = []
    for forced in (None, "graph's"):
        pf = prefill(policy, ids, mask, prompt_repeats)
        dec = static_decoder(policy, pf.cache, mask, pf.logits, pf.next_pos, max_new_tokens, **kw)
        if dec is None:
            raise RuntimeError("the static decoder declined this model (see the log)")
        if forced is not None:
            dec.forced = runs[0][0]
        tokens, logits = dec.run(sync_every=max_new_tokens, graph=forced is None and ids.is_cuda)
        runs.append((tokens.clone(), logits.clone(), dec.captured))
        del dec, pf
    (_, lg, captured), (_, le, _) = runs
    diff = (lg - le).abs()
    return {"captured": captured, "max_abs_diff": float(diff.max()),
            "max_abs_logit": float(le.abs().max()), "bit_equal": bool(torch.equal(lg, le)),
            "within_bf16": bool((diff <= 2**-7 * (le.abs() + 1)).all()), "shape": list(lg.shape)}
