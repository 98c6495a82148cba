"""Two attribution inputs of credit schemes, computed from the models: the reward model's scores
of edited responses (``RM_EDIT_SCORES``) and the rollout policy's grad × input
(``POLICY_GRAD_X_INPUT``). Shapes: B responses, T response positions (right-padded), P prompt
width, d the policy's hidden size, N edits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from datc.logprobs import selective_log_softmax
from datc.rewards.model import RMInputs
from datc.rollout import Rollout, position_ids


def rm_edit_scorer(score_fn: Callable, rm, inputs: RMInputs, response_mask: Tensor, batch_size: int,
                   share: bool = True) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The ``RM_EDIT_SCORES`` input: a function from N edits ``(rows, positions, ids)`` (each
    (N,) long) to the reward model's scores (N,) float32 of the edited responses, response
    ``rows[n]`` with its token at response position ``positions[n]`` set to ``ids[n]``.

    Batching: each edit is one row of the reward model's input (the response's own row, one
    column changed at ``inputs.response_pos``, so the sampled ids are never re-tokenized); the
    rows are scored by ``score_fn`` (:func:`datc.rewards.model.score`, the session's seam) in
    no-grad forwards of ``batch_size`` rows (``rows_per_forward`` when the caller gives it), with each distinct prompt prefix of a forward
    computed once (``share``). Cost: N reward-model forwards of one response each; a scheme
    editing every valid token K times pays ``K · T`` times the reward phase's scoring.
    """
    def edit_scores(rows: Tensor, positions: Tensor, ids: Tensor, rows_per_forward: int | None = None) -> Tensor:
        if rows.numel() == 0:
            return torch.zeros(0, dtype=torch.float32, device=response_mask.device)
        rows, positions, ids = (x.to(inputs.input_ids.device) for x in (rows, positions, ids))
        edited = inputs.select(rows)
        col = inputs.response_pos[rows, positions]
        edited.input_ids = edited.input_ids.clone()
        edited.input_ids[torch.arange(len(rows), device=col.device), col] = ids
        with torch.no_grad():
            return score_fn(rm, edited, response_mask[rows], with_grad=False, batch_size=rows_per_forward or batch_size,
                            share=share).scores

    return edit_scores


def policy_grad_x_input(model, ro: Rollout, temperature: float, micro: int) -> Tensor:
    """(B, T, d) float32: the ``POLICY_GRAD_X_INPUT`` input, ``e ⊙ ∂L/∂e`` with
    ``L = -Σ_t log π(y_t)`` the response's negative log-likelihood at the sampling temperature
    and ``e`` the policy's input embedding at the position that predicts ``y_t`` (column
    ``P - 1 + t`` of ``prompt + response``, as GRAIL's code slices it), 0 at padding.

    One forward and one backward to the input embeddings per ``micro`` rows (no parameter
    gradients: ``torch.autograd.grad`` to the embeddings alone). Each response's loss only reads
    its own row, so the gradient of the batch's summed loss is each row's own."""
    P, T = ro.prompt_ids.shape[1], ro.response_ids.shape[1]
    emb = model.get_input_embeddings()
    out = []
    for i in range(0, ro.response_ids.shape[0], micro):
        ids, am = ro.input_ids[i : i + micro], ro.attention_mask[i : i + micro]
        y, mask = ro.response_ids[i : i + micro], ro.response_mask[i : i + micro]
        with torch.enable_grad():
            e = emb(ids).detach().requires_grad_(True)  # (b, P+T, d) a fresh leaf
            logits = model(inputs_embeds=e, attention_mask=am.long(), position_ids=position_ids(am),
                           logits_to_keep=T + 1).logits[:, :-1].float() / temperature  # (b, T, V)
            nll = -(selective_log_softmax(logits, y) * mask).sum()
            (g,) = torch.autograd.grad(nll, e)
        gx = (g * e.detach())[:, P - 1 : P + T - 1].float()  # (b, T, d) at the positions predicting y_t
        out.append(gx * mask[:, :, None])
    return torch.cat(out)
