"""``datc_unsigned``: DATC with ``direction: unsigned`` (METHOD §3), which isolates the sign of
the advantage in the displacement.

The displacement is ``e_{y_t} - π_t`` whatever the sign of ``A_i``, so the score says how much
raising the sampled token moves the reward up, not whether the update does. All other switches
are DATC's and can be overridden as in ``datc``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from datc.credit import register_credit
from datc.credit.base import POLICY_LOGITS, RM_EMBEDDING, RM_GRAD, CreditBatch
from datc.credit.schemes.datc import DATCParams, datc_token_scores


@dataclass
class DATCUnsignedParams(DATCParams):
    """DATC's fields; only the default of ``direction`` differs."""

    direction: str = "unsigned"  # signed | unsigned: the ablation drops sign(A_i)


@register_credit(
    "datc_unsigned",
    needs={RM_GRAD, RM_EMBEDDING, POLICY_LOGITS},
    output="scores",
    row_local=True,  # per-token scores, per-response weights: computed a micro-batch of rows at a time
    row_separable=True,  # and no draws: only the responses with A != 0 need credit
    params=DATCUnsignedParams,
)
def datc_unsigned(batch: CreditBatch, params: DATCUnsignedParams) -> Tensor:
    """DATC without sign(A_i) in the displacement."""
    return datc_token_scores(batch, params)
