"""``datc_identity``: DATC with ``logit_map: identity`` (METHOD §3), which isolates the softmax
Jacobian in the map to logit space.

The force is ``f_t = ρ_t - mean(ρ_t)`` with ``ρ_t = E g_t``: the reward direction over tokens,
before the softmax, so the policy's confidence no longer scales it. All other switches are
DATC's and can be overridden as in ``datc``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from datc.credit import register_credit
from datc.credit.base import POLICY_LOGITS, RM_EMBEDDING, RM_GRAD, CreditBatch
from datc.credit.schemes.datc import DATCParams, datc_token_scores


@dataclass
class DATCIdentityParams(DATCParams):
    """DATC's fields; only the default of ``logit_map`` differs."""

    logit_map: str = "identity"  # jacobian | identity: the ablation drops the softmax Jacobian


@register_credit(
    "datc_identity",
    needs={RM_GRAD, RM_EMBEDDING, POLICY_LOGITS},
    output="scores",
    row_local=True,  # per-token scores, per-response weights: computed a micro-batch of rows at a time
    row_separable=True,  # and no draws: only the responses with A != 0 need credit
    params=DATCIdentityParams,
)
def datc_identity(batch: CreditBatch, params: DATCIdentityParams) -> Tensor:
    """DATC with the reward force taken before the softmax (identity map to logit space)."""
    return datc_token_scores(batch, params)
