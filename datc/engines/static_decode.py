"""Decoding on a static KV cache, one decode step written to be captured as a CUDA graph.

:func:`datc.engines.generate.sample_tokens` decodes on a ``DynamicCache`` that grows by one position per
token, with an attention mask re-built every step and the host reading whether any row is still
sampling after every token. On a GPU that loop is host-bound: one decode step of a 1.7B model
whose weights stream in about 1 ms took 27-36 ms. Here, after the same prefill, the keys and
values move into transformers' ``StaticCache`` pre-allocated for the call's prompt width plus
``max_new_tokens``, and one decode step (sample from the last logits, keep them, bookkeep EOS,
forward the token, write the next logits) works in place on buffers of fixed address, reading
nothing on the host. On CUDA that step is captured once per sampling call as a
``torch.cuda.CUDAGraph`` and replayed; on CPU the same Python function runs eagerly (what the
tests compare with the dynamic loop). The host reads whether every row is done once every
``sync_every`` steps, so a call may run up to ``sync_every - 1`` steps past its last EOS: those
steps sample pads and are cut off, and draw more random numbers than the dynamic loop (the same
distribution, another continuation of the random stream).

Same distribution, same logits to float rounding: a token's logits are the model's forward
over the static cache, whose keys past the current position are masked (the keys attended to
are the dynamic cache's, in a longer masked row: the attention's sums run over other blocks,
so logits agree to a few float32 ulps, pinned by tests/engines/test_static_decode.py), then the
dynamic loop's float32 copy, EOS ban before ``min_new_tokens``, temperature, top-p, softmax and
:func:`datc.engines.sampling.sample_categorical`.

Shapes: B rows, P prompt width, T = ``max_new_tokens``, V vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from datc.backends.plugins import partitioned
from datc.engines.sampling import sample_categorical, top_p_filter

log = logging.getLogger(__name__)

DECODE_MODES = ("auto", "dynamic", "static")
WARMUP_STEPS = 2  # eager steps on a side stream before the capture (cuBLAS handles, lazy allocations)
_said: set[str] = set()  # fallback reasons already logged (one line each per process)


def decode_mode(setting: str, cuda: bool, synced_gpus: bool) -> str:
    """The decode loop for ``trainer.decode`` = ``setting`` on a CUDA device or not:
    ``"static"`` or ``"dynamic"``. ``auto`` is static on CUDA and dynamic on CPU, where the
    dynamic loop (with GPT-2's lean step) measured faster (results/bench/decode_cpu.md).
    ``synced_gpus`` (ZeRO-3 over several ranks: every forward gathers parameters, and a rank
    keeps forwarding until all are done) takes the dynamic loop."""
    if setting not in DECODE_MODES:
        raise ValueError(f"decode={setting!r}; choose one of {', '.join(DECODE_MODES)}")
    mode = "static" if setting == "static" or (setting == "auto" and cuda) else "dynamic"
    if mode == "static" and synced_gpus:
        _fall_back("synced_gpus (ZeRO-3 over several ranks: every rank forwards until all are done)")
        return "dynamic"
    return mode


def _fall_back(reason: str) -> None:
    if reason not in _said:
        _said.add(reason)
        log.info("decode: the dynamic-cache loop instead of the static one: %s", reason)


def static_reason(policy, synced_gpus: bool = False) -> str | None:
    """Why ``policy`` cannot decode on a static cache, or None if it can: synced_gpus, partitioned
    (ZeRO-3) parameters, or a model class that declares no static-cache support
    (transformers' ``_can_compile_fullgraph``). :func:`static_decoder` also declines caches with
    layers other than full attention."""
    if synced_gpus:
        return "synced_gpus (ZeRO-3 over several ranks: every rank forwards until all are done)"
    model = getattr(policy, "module", policy)
    if partitioned(model):
        return "partitioned parameters (ZeRO-3, FSDP2): each forward gathers them"
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"{type(model).__name__} declares no static-cache support"
    return None


def static_decoder(policy, cache: dict[str, DynamicCache], mask: Tensor, logits: Tensor, next_pos: Tensor,
                   max_new_tokens: int, *, temperature: float, top_p: float, eos_id: int, pad_id: int,
                   min_new_tokens: int, keep_logits: bool, synced_gpus: bool) -> StaticDecoder | None:
    """A :class:`StaticDecoder` continuing the prefill that filled ``cache`` (``{kwarg: DynamicCache}``,
    the forward's name for it) under ``mask`` (B, P) bool, with its next-token ``logits`` (B, V)
    at positions ``next_pos`` (B, 1); or None, after one log line saying why, where the dynamic
    loop must decode."""
    reason = static_reason(policy, synced_gpus)
    (key, dynamic), = cache.items()
    if reason is None and not all(type(layer) is DynamicLayer for layer in dynamic.layers):
        reason = "a layer of the prefill's cache is not a plain DynamicLayer"
    static = None
    if reason is None:
        try:
            static = StaticCache(config=getattr(policy, "module", policy).config, max_cache_len=mask.shape[1] + max_new_tokens)
            if len(static.layers) != len(dynamic.layers) or not all(type(layer) is StaticLayer for layer in static.layers):
                reason = "a layer of its StaticCache is not full attention (sliding window, linear attention, ...)"
        except Exception as e:  # noqa: BLE001 - any failure to build it is a reason to decode dynamically
            reason = f"StaticCache: {type(e).__name__}: {e}"
    if reason is not None:
        _fall_back(reason)
        return None
    for src, dst in zip(dynamic.layers, static.layers, strict=True):  # positions [0, P) of the static buffers
        dst.update(src.keys, src.values)
    return StaticDecoder(policy, key, static, mask, logits, next_pos, max_new_tokens, temperature, top_p, eos_id, pad_id,
                         min_new_tokens, keep_logits)


class StaticDecoder:
    """One sampling call's decode state, every tensor at a fixed address, and its decode step
    (:meth:`step`), which reads nothing on the host: the function a CUDA graph captures."""

    def __init__(self, policy, cache_key: str, cache: StaticCache, mask: Tensor, logits: Tensor, next_pos: Tensor,
                 max_new_tokens: int, temperature: float, top_p: float, eos_id: int, pad_id: int, min_new_tokens: int,
                 keep_logits: bool, forced: Tensor | None = None) -> None:
        B, V = logits.shape
        T, dev = max_new_tokens, logits.device
        self.policy, self.cache, self.T = policy, {cache_key: cache}, T
        self.temperature, self.top_p, self.eos_id, self.pad_id = temperature, top_p, eos_id, pad_id
        # every position the static cache holds; causality (the cache's offset) masks the future
        self.attention_mask = torch.cat([mask.long(), mask.new_ones(B, T, dtype=torch.long)], 1)  # (B, P + T)
        self.logits = logits.clone()  # (B, V) the next token's logits, in the model's output dtype
        self.pos = next_pos.clone()  # (B, 1) the next token's position (padding skipped)
        self.t = torch.zeros(1, dtype=torch.long, device=dev)  # the step: the index of the next token
        self.length = torch.zeros((), dtype=torch.long, device=dev)  # steps drawn while any row was sampling
        self.unfinished = torch.ones(B, dtype=torch.bool, device=dev)
        self.tokens = torch.full((B, T), pad_id, dtype=torch.long, device=dev)
        self.raw = torch.empty((B, T, V), dtype=torch.float32, device=dev) if keep_logits else None
        # EOS is banned while t < min_new_tokens: a (V,) column mask and the bound on the device
        self.ban = torch.arange(V, device=dev) == eos_id if min_new_tokens > 0 else None
        self.min_new = torch.tensor(min_new_tokens, device=dev)
        self.forced = forced  # (B, T) long: tokens fed instead of the draws (the GPU check's replay), or None
        self.captured = False  # whether the last run replayed a CUDA graph

    def draw(self) -> Tensor:
        """Token ``t`` of every row from :attr:`logits`, as the dynamic loop draws it. -> (B,) long"""
        z = self.logits.to(torch.float32)
        if self.raw is not None:
            self.raw.index_copy_(1, self.t, z[:, None])  # raw[:, t] = z
        s = z
        if self.ban is not None:
            s = s.masked_fill(self.ban & (self.t < self.min_new), -float("inf"))
        if self.temperature != 1.0:
            s = s / self.temperature
        if self.top_p < 1.0:
            s = top_p_filter(s, self.top_p)
        nxt = sample_categorical(torch.softmax(s, dim=-1), sync_free=True)
        if self.forced is not None:
            nxt = self.forced.index_select(1, self.t).squeeze(1)
        nxt = torch.where(self.unfinished, nxt, torch.full_like(nxt, self.pad_id))
        self.length += self.unfinished.any()
        self.tokens.index_copy_(1, self.t, nxt[:, None])
        self.unfinished &= nxt != self.eos_id
        return nxt

    def advance(self, nxt: Tensor) -> None:
        """Forward the tokens just drawn (B,) through the static cache: the next logits."""
        out = self.policy(input_ids=nxt[:, None], attention_mask=self.attention_mask, position_ids=self.pos,
                          use_cache=True, **self.cache)
        self.logits.copy_(out.logits[:, -1])
        self.pos += 1
        self.t += 1

    def step(self) -> None:
        """One decode step: draw token t, forward it. The function a CUDA graph captures."""
        self.advance(self.draw())

    def run(self, sync_every: int, graph: bool,
            capture: Callable[[Callable[[], None], int], Callable[[], None] | None] | None = None) -> tuple[Tensor, Tensor | None]:
        """Decode to the budget or until every row has sampled EOS (read every ``sync_every``
        steps); ``graph``: replay :meth:`step` as a captured CUDA graph (``capture``, by default
        :func:`capture_graph`, runs the first :data:`WARMUP_STEPS` steps and returns the replay,
        or None where the capture failed). Returns the sampled ids (B, n) and, if kept, the raw
        logits (B, n, V), n <= T as the dynamic loop's."""
        step: Callable[[], None] = self.step
        i, live = 0, True
        if graph and self.T - 1 > WARMUP_STEPS:
            replay = (capture or capture_graph)(self.step, WARMUP_STEPS)
            self.captured = replay is not None
            step = replay or self.step
            i, live = WARMUP_STEPS, bool(self.unfinished.any())
        while live and i < self.T - 1:
            step()
            i += 1
            if i % sync_every == 0:
                live = bool(self.unfinished.any())
        if live:
            self.draw()  # the last token: nothing forwards it
        n = int(self.length)
        return self.tokens[:, :n], (self.raw[:, :n] if self.raw is not None else None)


def capture_graph(step: Callable[[], None], warmup: int) -> Callable[[], None] | None:
    """``warmup`` eager calls of ``step`` on a side stream (real decode steps: cuBLAS handles,
    lazy allocations and autocast's weight casts happen there, outside the graph), then ``step``
    captured as a ``torch.cuda.CUDAGraph`` (the capture runs nothing); its replay. None, after
    one log line, where the capture fails (an operation the model runs that a graph cannot
    hold): the caller steps eagerly, which computes the same. The replay keeps the graph and
    its memory pool alive."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            step()
    except Exception as e:  # noqa: BLE001 - the eager step computes the same
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        reason = f"CUDA graph capture failed ({type(e).__name__}: {first})"
        if reason not in _said:
            _said.add(reason)
            log.warning("decode: static cache without a graph: %s", reason)
        return None
    return g.replay
