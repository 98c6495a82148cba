"""``oracle``: credit from the task's own per-token gold contribution, ``s_t = sign(A_i) · c_t``.

``c_t`` is the gold reward's exact share of token ``t`` (the testbed tasks and ``reviews``
compute it: the contributions of a response sum to its gold reward). A token that earned the
response its advantage (``sign(A) · c_t > 0``) scores high, one that worked against it low,
through the shared weight step (METHOD §2.5, mean 1 per response, so every token keeps the
sign of ``A_i``). It is the best a direction-aware credit scheme can do with perfect knowledge of
which tokens matter, so the gap between ``grpo`` and ``oracle`` bounds what token credit can buy
in a setting. A run whose task has no per-token gold (``data.task: null``) is refused before any
model loads (:func:`datc.training.session.build_session`).

``sign(A_i)`` is ``torch.sign``: a response with ``A_i = 0`` scores 0 everywhere and falls back to
``w = 1`` (moot: ``Â = 0``); so does one whose tokens all contribute alike (e.g. all filler).
"""

from __future__ import annotations

import torch
from torch import Tensor

from datc.credit import register_credit
from datc.credit.base import GOLD_CONTRIB, CreditBatch
from datc.credit.weights import WeightParams


@register_credit("oracle", needs={GOLD_CONTRIB}, output="scores", params=WeightParams,
                 row_local=True, row_separable=True)  # per-token scores, per-response weights
def oracle(batch: CreditBatch, params: WeightParams) -> Tensor:
    """The gold contribution of each token, signed by the response's advantage."""
    sign = torch.sign(batch.advantages).to(batch.gold_contrib.dtype)
    return torch.where(batch.response_mask, sign[:, None] * batch.gold_contrib, 0.0)
