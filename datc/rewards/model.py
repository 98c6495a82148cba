"""The frozen reward model: scores, and (fused into the same pass) the gradient of each score
with respect to the reward model's input embedding at every response token (METHOD §2.1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from datc.rollout import position_ids


@dataclass
class RMInputs:
    """Reward-model inputs, left-padded so the score is read at the last position.
    L = the longest prefix + response."""

    input_ids: Tensor  # (B, L) long
    attention_mask: Tensor  # (B, L) bool
    response_pos: Tensor  # (B, T) long: position in the RM input of response token t (valid where response_mask)
    mapped: Tensor | None = None  # (B, T) bool: tokens with a position (chat templates may leave the EOS without one)

    def select(self, rows: Tensor) -> RMInputs:
        """The inputs of responses ``rows`` (k,) long, padding kept as it is."""
        return RMInputs(self.input_ids[rows], self.attention_mask[rows], self.response_pos[rows],
                        None if self.mapped is None else self.mapped[rows])


def build_rm_inputs(prefix_ids: Tensor, prefix_mask: Tensor, response_ids: Tensor, response_mask: Tensor, pad_id: int) -> RMInputs:
    """Splice the sampled response ids after the reward model's prompt prefix, never
    re-tokenizing them, and shift each row so its padding is all on the left.

    prefix_ids/prefix_mask (B, P) left-padded; response_ids/response_mask (B, T) right-padded.
    """
    ids = torch.cat([prefix_ids, response_ids], 1)  # (B, P+T): pads on the left and the right
    mask = torch.cat([prefix_mask, response_mask], 1)
    B, L = ids.shape
    shift = (~response_mask).sum(-1)  # right padding to move to the left, per row
    src = (torch.arange(L, device=ids.device)[None, :] - shift[:, None]) % L  # roll right by shift
    ids = ids.gather(1, src)
    mask = mask.gather(1, src)
    ids = torch.where(mask, ids, torch.full_like(ids, pad_id))
    T = response_ids.shape[1]
    response_pos = prefix_ids.shape[1] + torch.arange(T, device=ids.device)[None, :] + shift[:, None]
    response_pos = torch.where(response_mask, response_pos, torch.zeros_like(response_pos))
    return RMInputs(ids, mask, response_pos)


@dataclass
class RMScore:
    scores: Tensor  # (B,) float32
    grad: Tensor | None  # (B, T, d) float32, dR/dh_t at each response token (0 where masked)


def rm_forward(rm, inputs_embeds: Tensor, attention_mask: Tensor) -> Tensor:
    """The reward model's score of left-padded inputs, read at the last position. (B,) float.
    Shared by reward-model training and scoring, so both compute exactly the same function."""
    out = rm(inputs_embeds=inputs_embeds, attention_mask=attention_mask.long(), position_ids=position_ids(attention_mask)).logits
    s = out[:, 0]
    return s if s.dtype == torch.float64 else s.float()  # bf16/fp16 scores are upcast


def score(rm, inputs: RMInputs, response_mask: Tensor, with_grad: bool = False, batch_size: int = 64,
          grad_rows: Tensor | None = None) -> RMScore:
    """Score responses with the frozen reward model; with ``with_grad`` the same forward is
    followed by one backward to ``inputs_embeds`` only (no parameter gradients), returning
    ``g_t = ∂R/∂h_t`` for every response token. Run in chunks of ``batch_size`` rows.

    ``grad_rows`` (B,) bool: with ``with_grad``, only these responses get the backward; the
    others are scored by a no-grad forward and get a zero gradient (None: every response)."""
    if not with_grad or grad_rows is None or bool(grad_rows.all()):
        return _score(rm, inputs, response_mask, with_grad, batch_size)
    scores = torch.empty(response_mask.shape[0], dtype=torch.float32, device=response_mask.device)
    grad = None
    for want, rows in ((True, grad_rows.nonzero().squeeze(-1)), (False, (~grad_rows).nonzero().squeeze(-1))):
        if rows.numel() == 0:
            continue
        out = _score(rm, inputs.select(rows), response_mask[rows], want, batch_size)
        scores[rows] = out.scores
        if want:
            grad = out.grad.new_zeros((*response_mask.shape, out.grad.shape[-1]))
            grad[rows] = out.grad
    if grad is None:  # no response wanted it: the gradient is 0 everywhere
        d = rm.get_input_embeddings().weight.shape[-1]
        grad = torch.zeros(*response_mask.shape, d, device=response_mask.device)
    return RMScore(scores, grad)


def _score(rm, inputs: RMInputs, response_mask: Tensor, with_grad: bool, batch_size: int) -> RMScore:
    emb = rm.get_input_embeddings()
    scores, grads = [], []
    for i in range(0, inputs.input_ids.shape[0], batch_size):
        ids = inputs.input_ids[i : i + batch_size]
        am = inputs.attention_mask[i : i + batch_size]
        with torch.no_grad():
            h = emb(ids)
        h.requires_grad_(with_grad)
        with torch.set_grad_enabled(with_grad):
            s = rm_forward(rm, h, am)
            if with_grad:
                (g,) = torch.autograd.grad(s.sum(), h)  # scores are independent per row
                pos = inputs.response_pos[i : i + batch_size]
                g = g.gather(1, pos[:, :, None].expand(-1, -1, g.shape[-1]))
                g = g if g.dtype == torch.float64 else g.float()
                keep = response_mask[i : i + batch_size] if inputs.mapped is None else inputs.mapped[i : i + batch_size]
                grads.append(g * keep[:, :, None])
        scores.append(s.detach().float())
    return RMScore(torch.cat(scores), torch.cat(grads) if with_grad else None)
