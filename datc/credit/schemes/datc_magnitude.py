"""``datc_magnitude``: ``s_t = ‖f_t‖`` (METHOD §3), the magnitude of the reward force in logit
space with no alignment to the update's direction.

It isolates the direction: tokens where the reward is sensitive to the policy's logits get
more credit, whichever way the update pushes them. There is no displacement, so the DATC
switches ``direction`` and ``alignment`` do not exist here; ``logit_map``, ``chunk_size`` and
``top_k`` mean what they mean for ``datc``. ``‖f_t‖`` needs ``ρ_t = E g_t`` one chunk at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from datc.credit import register_credit
from datc.credit.base import POLICY_LOGITS, RM_EMBEDDING, RM_GRAD, CreditBatch
from datc.credit.datc_math import check_options, force_norm
from datc.credit.schemes.datc import flat_valid, scatter_valid
from datc.credit.weights import WeightParams


@dataclass
class MagnitudeParams(WeightParams):
    """The weight step's fields plus the DATC switches that apply to the force alone."""

    logit_map: str = "jacobian"  # jacobian | identity: how the reward force enters logit space
    chunk_size: int | None = None  # tokens per chunk, extra memory O(chunk_size * V); None: sized by memory
    top_k: int | None = None  # keep the k most likely tokens of pi_t (renormalised); None: exact

    def __post_init__(self) -> None:
        super().__post_init__()
        check_options(self.logit_map, "work", self.chunk_size, self.top_k)


@register_credit(
    "datc_magnitude",
    needs={RM_GRAD, RM_EMBEDDING, POLICY_LOGITS},
    output="scores",
    row_local=True,  # per-token scores, per-response weights: computed a micro-batch of rows at a time
    row_separable=True,  # and no draws: only the responses with A != 0 need credit
    params=MagnitudeParams,
)
def datc_magnitude(batch: CreditBatch, params: MagnitudeParams) -> Tensor:
    """The norm of the reward force in logit space, ignoring the update's direction."""
    B, T = batch.response_mask.shape
    g, _, rows = flat_valid(batch)
    scores = force_norm(
        g,
        batch.rm_embedding,
        batch.policy_logits.reshape(B * T, -1),
        logit_map=params.logit_map,
        chunk_size=params.chunk_size,
        top_k=params.top_k,
        rows=rows,
    )
    return scatter_valid(scores, rows, batch.response_mask)
