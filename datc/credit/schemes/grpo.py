"""``grpo``: uniform credit, ``w = 1`` on every valid response token (METHOD §3)."""

import torch

from datc.credit import register_credit
from datc.credit.base import CreditBatch, NoParams


@register_credit("grpo", output="weights", normalization="per_response", row_local=True, row_separable=True)
def grpo(batch: CreditBatch, params: NoParams) -> torch.Tensor:
    """Every token carries the response's advantage unchanged."""
    return batch.response_mask.float()
