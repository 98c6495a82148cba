"""The frozen reward model: scores, and (fused into the same pass) the gradient of each score
with respect to the reward model's input embedding at every response token (METHOD §2.1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from datc.batch import position_ids
from datc.engines.fast_decode import lean_rm_continuation
from datc.models.rm_inputs import RMInputs
from datc.models.shared_prompt import forward_after_prompts, prompt_groups


@dataclass
class RMScore:
    scores: Tensor  # (B,) float32
    grad: Tensor | None  # (B, T, d) float32, dR/dh_t at each response token (0 where masked)


def rm_forward(rm, inputs_embeds: Tensor, attention_mask: Tensor) -> Tensor:
    """The reward model's score of left-padded inputs, read at the last position. (B,) float.
    Shared by reward-model training and scoring, so both compute exactly the same function."""
    out = rm(inputs_embeds=inputs_embeds, attention_mask=attention_mask.long(), position_ids=position_ids(attention_mask)).logits
    return as_score(out)


def as_score(logits: Tensor) -> Tensor:
    s = logits[:, 0]
    return s if s.dtype == torch.float64 else s.float()  # bf16/fp16 scores are upcast


def score(rm, inputs: RMInputs, response_mask: Tensor, with_grad: bool = False, batch_size: int = 64,
          grad_rows: Tensor | None = None, share: bool = True) -> RMScore:
    """Score responses with the frozen reward model; with ``with_grad`` the same forward is
    followed by one backward to ``inputs_embeds`` only (no parameter gradients), returning
    ``g_t = ∂R/∂h_t`` for every response token. Run in chunks of ``batch_size`` rows.

    ``grad_rows`` (B,) bool: with ``with_grad``, only these responses get the backward; the
    others are scored by a no-grad forward and get a zero gradient (None: every response).
    ``share``: each distinct prefix of a chunk is forwarded once, without a graph (the gradient
    is wanted at the response tokens only, which the prefix does not depend on), and the
    continuations after it (:mod:`datc.models.shared_prompt`)."""
    if not with_grad or grad_rows is None or bool(grad_rows.all()):
        return _score(rm, inputs, response_mask, with_grad, batch_size, share)
    scores = torch.empty(response_mask.shape[0], dtype=torch.float32, device=response_mask.device)
    grad = None
    for want, rows in rows_by_gradient(response_mask.shape[0], True, grad_rows, response_mask.device):
        out = _score(rm, inputs.select(rows), response_mask[rows], want, batch_size, share)
        scores[rows] = out.scores
        if want:
            grad = out.grad.new_zeros((*response_mask.shape, out.grad.shape[-1]))
            grad[rows] = out.grad
    if grad is None:  # no response wanted it: the gradient is 0 everywhere
        d = rm.get_input_embeddings().weight.shape[-1]
        grad = torch.zeros(*response_mask.shape, d, device=response_mask.device)
    return RMScore(scores, grad)


def rows_by_gradient(n: int, with_grad: bool, grad_rows: Tensor | None,
                     device: torch.device | str = "cpu") -> list[tuple[bool, Tensor]]:
    """The ``n`` responses split into those scored with an input gradient and those without, as
    ``(with_gradient, rows)`` pairs, ``rows`` (k,) long on ``device``, the gradient ones first and
    empty groups left out: with ``with_grad`` the rows ``grad_rows`` (n,) bool get one (None:
    all), without it none does. Shared by :func:`score` and :func:`datc.forward.trunk.reference_and_score`."""
    if with_grad and grad_rows is not None:
        want = grad_rows.to(device=device, dtype=torch.bool)
    else:
        want = torch.full((n,), with_grad, dtype=torch.bool, device=device)
    return [(w, rows) for w in (True, False) if (rows := (want == w).nonzero().squeeze(-1)).numel()]


def _score(rm, inputs: RMInputs, response_mask: Tensor, with_grad: bool, batch_size: int, share: bool = True) -> RMScore:
    emb = rm.get_input_embeddings()
    scores, grads = [], []
    P = inputs.prefix_len
    lean = lean_rm_continuation(rm) if share else None  # the testbed's GPT-2: its last block at the read-out only
    for i in range(0, inputs.input_ids.shape[0], batch_size):
        ids = inputs.input_ids[i : i + batch_size]
        am = inputs.attention_mask[i : i + batch_size]
        groups = prompt_groups(ids[:, :P], am[:, :P]) if share and 0 < P < ids.shape[1] else None
        start = 0 if groups is None else P  # the first column with a graph
        with torch.no_grad():
            h = emb(ids)
        x = h[:, start:].clone() if groups is not None else h
        x.requires_grad_(with_grad)
        with torch.set_grad_enabled(with_grad):
            if groups is None:
                s = rm_forward(rm, x, am)
            else:
                _, out = forward_after_prompts(rm, am[:, :P], am[:, P:], groups, prompt_embeds=h[:, :P], cont_embeds=x,
                                               prompt_grad=False, cont_forward=lean)
                s = as_score(out if lean is not None else out.logits)
            if with_grad:
                (g,) = torch.autograd.grad(s.sum(), x)  # scores are independent per row
                pos = inputs.response_pos[i : i + batch_size] - start
                keep = response_mask[i : i + batch_size] if inputs.mapped is None else inputs.mapped[i : i + batch_size]
                g = g.gather(1, (pos * keep)[:, :, None].expand(-1, -1, g.shape[-1]))
                g = g if g.dtype == torch.float64 else g.float()
                grads.append(g * keep[:, :, None])
        scores.append(s.detach().float())
    return RMScore(torch.cat(scores), torch.cat(grads) if with_grad else None)
