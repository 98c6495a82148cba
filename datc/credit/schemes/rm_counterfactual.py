"""``rm_counterfactual``: the reward model's own attribution, without linearization.

Each token's contribution is what the reward model loses, in expectation, when the token is
replaced by another draw of the rollout policy at that position::

    c_t = R(y) - E_{v ~ π(·|y<t)} [ R(y with y_t := v) ]
        ≈ R(y) - (1/K) Σ_k R(y with y_t := v_k),   v_k ~ π_t i.i.d.    (K = ``k``)

(an unbiased Monte-Carlo estimate; a draw equal to ``y_t`` contributes 0), and the score is
``s_t = sign(A_i) · c_t``, signed by the advantage as DATC is, through the shared weight step
(METHOD §2.5). ``π_t = softmax(z_t)`` is the rollout distribution at the sampling temperature
(the full distribution: ``top_p`` is not applied). ``datc_identity``'s score,
``g_t · (E[y_t] - π_tᵀE)``, is exactly the first-order (embedding-space Taylor) estimate of
``c_t``, so the gap between the two schemes is what linearization loses.

Cost: the edited responses are scored by no-grad reward-model forwards (the ``rm_edit_scores``
input, :func:`datc.forward.attribution.rm_edit_scorer`): ``K`` per valid token of each response with
``A != 0``. They are prefix-cached: one cached forward of each edited response, then every edit
forwards only the columns from its edited token to the read-out, ``rows_per_forward`` edits
per forward sorted by column, so an edit at position t of a T-token response costs about
``T - t`` token forwards, and the K·T edits of a response about ``K · T / 2`` whole-response
forwards. Measured on SmolLM2-135M (one CPU thread, 1,240 edits of 10 responses of 40 + 31
tokens, K = 4; results/bench/edit_scores.md): 74 s at 64 edits per forward against 156 s for the
edited rows scored whole (512 per forward, each prompt once), 2.1x. 512 edits per forward
(``python -m scripts.bench.edit_scores --chunks 64 512``) was slower than 64 in a run beside
another job (118 s against 70 s): its forwards span more columns. Responses with ``A = 0`` are
skipped, their weights are moot.

Not row-local: the draws come from one generator for the rows in turn, so the step computes the
scheme over the whole batch (the rows with ``A = 0`` are skipped here, not by the step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from datc.credit import register_credit
from datc.credit.base import POLICY_LOGITS, RM_EDIT_SCORES, RM_SCORES, CreditBatch
from datc.credit.weights import WeightParams

DRAW_CHUNK = 4096  # tokens whose distributions are softmaxed at once (memory O(DRAW_CHUNK · V))


@dataclass
class RMCounterfactualParams(WeightParams):
    """The weight step's fields plus the estimator's."""

    k: int = 4  # draws v ~ pi_t per valid token (reward-model forwards per token)
    rows_per_forward: int = 64  # edited responses per reward-model forward (each holds a copy of its row's KV cache)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("k", "rows_per_forward"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


def counterfactual_contributions(scores: Tensor, logits: Tensor, mask: Tensor, edit_scores: Callable, k: int,
                                 generator: torch.Generator | None, rows_per_forward: int | None = None) -> Tensor:
    """(B, T) float32 Monte-Carlo estimates of ``c_t = R(y) - E_{v~π_t} R(y with y_t := v)`` at
    the positions ``mask`` (B, T) bool, 0 elsewhere. ``scores`` (B,) ``R(y)``; ``logits`` (B, T, V)
    the rollout policy's ``z_t`` (``π_t = softmax(z_t)``); ``edit_scores`` the ``rm_edit_scores``
    input; ``k`` draws per position from ``generator`` (on the CPU), row-major over ``mask``."""
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    where = mask.nonzero()  # (N, 2) [response, position]
    if len(where) == 0:
        return out
    draws = []
    for i in range(0, len(where), DRAW_CHUNK):
        w = where[i : i + DRAW_CHUNK]
        probs = torch.softmax(logits[w[:, 0], w[:, 1]].double(), -1).cpu()  # (n, V)
        draws.append(torch.multinomial(probs, k, replacement=True, generator=generator))
    v = torch.cat(draws).to(mask.device)  # (N, k)
    edited = edit_scores(where[:, 0].repeat_interleave(k), where[:, 1].repeat_interleave(k), v.reshape(-1),
                         rows_per_forward).view(-1, k).float()
    out[where[:, 0], where[:, 1]] = scores[where[:, 0]].float() - edited.mean(-1)
    return out


@register_credit("rm_counterfactual", needs={RM_SCORES, RM_EDIT_SCORES, POLICY_LOGITS}, output="scores",
                 params=RMCounterfactualParams)  # not row-local: one stream of draws over the batch
def rm_counterfactual(batch: CreditBatch, params: RMCounterfactualParams) -> Tensor:
    """What the reward model loses when each token is redrawn from the policy, signed by A."""
    sign = torch.sign(batch.advantages)
    mask = batch.response_mask & (sign != 0)[:, None]  # A = 0: weights moot, no forwards spent
    c = counterfactual_contributions(batch.rm_scores, batch.policy_logits, mask, batch.rm_edit_scores, params.k,
                                     batch.generator, params.rows_per_forward)
    return sign[:, None].float() * c
