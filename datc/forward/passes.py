"""No-grad passes of the policy over a sampled batch, and the plan of which a step makes.

Shapes: B responses, T response positions (right-padded), V vocabulary, d the policy's hidden
size. Logits are divided by the sampling temperature, so log-probs are the sampler's.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch

from datc.batch import Rollout, position_ids, with_prompts
from datc.math.logprobs import chunked_head_logps, entropy_from_logits, selective_log_softmax
from datc.models.build import decoder_layers
from datc.models.shared_prompt import forward_after_prompts, prompt_groups


@dataclass(frozen=True)
class Passes:
    """The policy-side passes of a run with its sampling temperature, micro-batch size and
    shared-prompt switch bound once (the functions below take them explicitly)."""

    temperature: float
    micro: int  # rows per forward (trainer.micro_batch_size)
    share: bool  # each distinct prompt forwarded once (datc.models.shared_prompt)

    def logits(self, model, ro: Rollout, rows: slice | torch.Tensor) -> torch.Tensor:
        """:func:`policy_logits` (with a graph where grad is enabled)."""
        return policy_logits(model, ro, rows, self.temperature, self.share)

    def token_logps(self, model, ro: Rollout, rows: slice | torch.Tensor, head_chunk: int | None):
        """The policy's log-probs of the sampled ids (b, T) with a graph, and its entropies (b, T,
        no graph). ``head_chunk`` positions at a time through the LM head
        (:func:`datc.math.logprobs.chunked_head_logps`: no (b, T, V) logits held), or None: the whole
        logits at once, as :func:`policy_logits`."""
        if head_chunk is None:
            z = self.logits(model, ro, rows)
            return selective_log_softmax(z, ro.response_ids[rows]), entropy_from_logits(z.detach())
        _, h = policy_forward(model, ro, rows, share=self.share, head=False)
        head = getattr(model, "module", model).get_output_embeddings()
        return chunked_head_logps(head, h, ro.response_ids[rows], self.temperature, head_chunk)

    def rollout_pass(self, model, ro: Rollout, keep_logits: bool = False, keep_hidden: bool = False,
                     with_entropy: bool = True) -> PolicyPass:
        """:func:`rollout_policy_pass`."""
        return rollout_policy_pass(model, ro, self.temperature, self.micro, keep_logits, keep_hidden, with_entropy,
                                   self.share)

    def logps_under(self, model, tok, ro: Rollout, encoder=None):
        """:func:`logps_under_prompts`."""
        return logps_under_prompts(model, tok, ro, self.temperature, self.micro, encoder, self.share)


def policy_forward(model, ro: Rollout, rows: slice | torch.Tensor, hidden: bool = False, share: bool = True,
                   head: bool = True):
    """The policy's raw logits over the response positions (b, T, V), each position's logits
    predicting its token, and with ``hidden`` the LM-head inputs there (b, T, d; the last
    hidden state after the final norm), else None. With ``share`` each distinct prompt of the
    rows is forwarded once (:mod:`datc.models.shared_prompt`; with gradients as well); otherwise, or
    for a one-token prompt width, one forward of ``prompt + response``. ``head=False``: the LM
    head runs at one position only and the logits returned are None (the caller applies the
    head itself, :meth:`Passes.token_logps`)."""
    if not head:
        _, h = policy_forward(_OneLogit(model), ro, rows, True, share)
        return None, h
    P, T = ro.prompt_ids.shape[1], ro.response_ids.shape[1]
    pids, pmask = ro.prompt_ids[rows], ro.prompt_mask[rows]
    groups = prompt_groups(pids, pmask) if share and P > 1 else None
    if groups is None:
        ids, am = ro.input_ids[rows], ro.attention_mask[rows]
        # the LM head only at the T positions that predict a response token (not at the prompt's)
        out = model(input_ids=ids, attention_mask=am.long(), position_ids=position_ids(am), logits_to_keep=T + 1,
                    output_hidden_states=hidden, use_cache=False)
        return out.logits[:, :-1], (out.hidden_states[-1][:, P - 1 : -1] if hidden else None)
    # The prompts but their last token go through once; each row's continuation is its prompt's
    # last token (whose logits predict the first response token) and its response but the last:
    # T positions, so the LM head runs over all B·T of them in one product, as in the plain forward.
    cont_ids = torch.cat([pids[:, -1:], ro.response_ids[rows][:, : T - 1]], 1)
    cont_mask = torch.cat([pmask[:, -1:], ro.response_mask[rows][:, : T - 1]], 1)
    _, out = forward_after_prompts(model, pmask[:, :-1], cont_mask, groups, prompt_ids=pids[:, :-1], cont_ids=cont_ids,
                                   prompt_kwargs={"logits_to_keep": 1}, output_hidden_states=hidden)
    return out.logits, (out.hidden_states[-1] if hidden else None)


@contextmanager
def checkpointed_layers(model):
    """Activation checkpointing of the policy's decoder blocks while the context is open (the
    update's forwards and backwards): each block's activations are recomputed in the backward
    instead of kept (``torch.utils.checkpoint``, non-reentrant). Unlike transformers' own switch
    it does not need the model in training mode (the policy stays in eval mode: dropout off, so
    the loss sees the distribution that sampled). A block called with a KV cache (the shared-prompt
    forward's continuation) is not checkpointed: recomputing it would append to the cache again;
    the plan turns shared prompts off for the update when checkpointing (``StepPlan.update_passes``)."""
    from torch.utils.checkpoint import checkpoint

    layers = decoder_layers(model)
    if layers is None:
        raise ValueError("trainer.gradient_checkpointing: the policy has no base_model.layers or base_model.h")
    originals = [(blk.forward, "forward" in vars(blk), vars(blk).get("forward")) for blk in layers]

    def wrap(fwd):
        def forward(*args, **kwargs):
            cached = any(kwargs.get(k) is not None for k in ("past_key_values", "past_key_value", "cache", "layer_past"))
            if not torch.is_grad_enabled() or cached:
                return fwd(*args, **kwargs)
            return checkpoint(fwd, *args, use_reentrant=False, **kwargs)

        return forward

    try:
        for blk, (fwd, _, _) in zip(layers, originals, strict=True):
            blk.forward = wrap(fwd)
        yield
    finally:
        for blk, (_, own, fwd) in zip(layers, originals, strict=True):
            if own:
                blk.forward = fwd  # an instance's own forward (a hook's wrapper), as it was
            else:
                del blk.forward  # the class's forward again


class _OneLogit:
    """A model whose forwards compute the LM head at their last position only (``logits_to_keep=1``):
    for a caller that wants the hidden states and applies the head itself."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, **kw):
        kw["logits_to_keep"] = 1
        return self.model(**kw)

    def __getattr__(self, name):
        return getattr(self.model, name)


def policy_logits(model, ro: Rollout, rows: slice | torch.Tensor, temperature: float, share: bool = True) -> torch.Tensor:
    """Logits over the response positions, divided by the sampling temperature. (b, T, V)"""
    return scaled(policy_forward(model, ro, rows, share=share)[0], temperature)


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 ``logits / temperature``; at temperature 1 the logits themselves (no (b, T, V)
    copy, no extra backward op)."""
    z = logits.float()
    return z if temperature == 1.0 else z / temperature


class PolicyPass(NamedTuple):
    """What one no-grad pass of the policy over a batch gives (:func:`rollout_policy_pass`)."""

    logps: torch.Tensor  # (B, T) log-probs of the sampled ids, at the sampling temperature
    entropy: torch.Tensor | None  # (B, T); None without ``with_entropy``
    logits: torch.Tensor | None  # (B, T, V) float32, divided by the temperature; None without ``keep_logits``
    hidden: torch.Tensor | None  # (B, T, d) float32 LM-head inputs; None without ``keep_hidden``


@torch.no_grad()
def rollout_policy_pass(model, ro: Rollout, temperature: float, micro: int, keep_logits: bool,
                        keep_hidden: bool = False, with_entropy: bool = True, share: bool = True) -> PolicyPass:
    """One no-grad pass of a frozen or pre-update policy: log-probs, entropies (without
    ``with_entropy``: None) and (when a credit scheme declares them) the logits and the LM-head
    inputs (the last hidden state, after the final norm: logits = lm_head(hidden) / temperature),
    all at the response positions. ``share``: see :func:`policy_forward`."""
    logps, ents, all_logits, hidden = [], [], [], []
    for i in range(0, ro.response_ids.shape[0], micro):
        raw, h = policy_forward(model, ro, slice(i, i + micro), hidden=keep_hidden, share=share)
        z = scaled(raw, temperature)
        if keep_hidden:
            hidden.append(h.float())
        logps.append(selective_log_softmax(z, ro.response_ids[i : i + micro]))
        if with_entropy:
            ents.append(entropy_from_logits(z))
        if keep_logits:
            all_logits.append(z)
    return PolicyPass(torch.cat(logps), torch.cat(ents) if with_entropy else None,
                      torch.cat(all_logits) if keep_logits else None, torch.cat(hidden) if keep_hidden else None)


def logps_under_prompts(model, tok, ro: Rollout, temperature: float, micro: int, encoder=None, share: bool = True):
    """The ``LOGPS_UNDER`` input of a credit scheme: a function from B prompt texts to the
    rollout policy's log-probs (B, T) of the sampled response ids under those prompts, one
    no-grad :func:`rollout_policy_pass` per call (ids spliced, never re-tokenized; see
    :func:`datc.batch.with_prompts`). Under the original prompts it gives the old log-probs."""
    cfg = getattr(model, "config", None)
    ctx = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None)

    def logps_under(prompts: list[str]) -> torch.Tensor:
        other = with_prompts(ro, tok, prompts, encoder)
        width = other.prompt_ids.shape[1] + other.response_ids.shape[1]
        if ctx is not None and width > ctx:
            raise ValueError(f"prompts of up to {other.prompt_ids.shape[1]} tokens plus {other.response_ids.shape[1]} "
                             f"response positions exceed the policy's context of {ctx}")
        return rollout_policy_pass(model, other, temperature, micro, False, with_entropy=False, share=share).logps

    return logps_under

