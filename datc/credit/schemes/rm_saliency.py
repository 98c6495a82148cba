"""``rm_saliency``: ``s_t = |g_t · E[y_t]|`` (METHOD §3), a reward-gradient baseline that ignores
the policy.

Gradient-times-input saliency of the reward model at each response token's input embedding.
It needs neither the policy's logits nor a map to logit space, so its only fields are the
weight step's.
"""

from __future__ import annotations

from torch import Tensor

from datc.credit import register_credit
from datc.credit.base import RM_EMBEDDING, RM_GRAD, CreditBatch
from datc.credit.datc_math import rm_saliency as saliency
from datc.credit.schemes.datc import flat_valid, scatter_valid
from datc.credit.weights import WeightParams


@register_credit("rm_saliency", needs={RM_GRAD, RM_EMBEDDING}, output="scores", params=WeightParams,
                 row_local=True, row_separable=True)  # per-token scores, per-response weights
def rm_saliency(batch: CreditBatch, params: WeightParams) -> Tensor:
    """Reward-model gradient-times-input saliency of each sampled token."""
    g, y, rows = flat_valid(batch)
    scores = saliency(g[rows], batch.rm_embedding, y[rows])
    return scatter_valid(scores, rows, batch.response_mask)
