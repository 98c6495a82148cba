"""``prob_reweight``: the Advantage Reweighting (AR) of AR-Lopti (arXiv 2505.12929), METHOD §3.

``w_t = α · π_old(y_t) + (1 - α)``: low-probability tokens, whose gradients are the largest,
get a smaller share of the advantage. Follows the public code's ``both_linear_normal`` method
(the same weight for positive and negative advantages) with its default ``α = 0.2``
(``reweight_k``; ``reweight_tau = 1 - α``). The weights are **not** renormalized: a response's
mean token advantage is ``A_i · mean_t w_t``, smaller than ``A_i`` (normalization ``none``).
Departure: AR-Lopti's Lopti half (a separate update for low-probability tokens) is not included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from datc.credit import register_credit
from datc.credit.base import OLD_LOGPS, CreditBatch


@dataclass
class ProbReweightParams:
    alpha: float = 0.2  # weight of the token's rollout probability; 0 is GRPO

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")


@register_credit("prob_reweight", needs={OLD_LOGPS}, output="weights", normalization="none",
                 params=ProbReweightParams, row_local=True, row_separable=True)  # per token
def prob_reweight(batch: CreditBatch, params: ProbReweightParams) -> Tensor:
    """``α π_old(y_t) + 1 - α`` on valid tokens, 0 on padding. (B, T)"""
    w = params.alpha * batch.old_logps.exp() + (1.0 - params.alpha)
    return torch.where(batch.response_mask, w, torch.zeros_like(w))
