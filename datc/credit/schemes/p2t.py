"""``p2t``: token rewards from a first-order Taylor split of the reward model's score (P2T, CVPR
2026, "Unlocking Token Rewards via Training-Free Reward Attribution").

The split, one forward and one backward of the reward model (the ``rm_grad`` input)::

    R(y) - R(baseline) ≈ Σ_t ⟨∇_{e_t} R, e_t - e_base⟩,     r_t = ⟨g_t, E[y_t] - e_base⟩

and the score ``s_t = sign(A_i) · r_t`` (a token whose reward agrees with the advantage gets
more of it), through the shared weight step (METHOD §2.5, mean 1 per response).

Implemented from the paper's description: no public code of it could be read here. The paper
splits a process reward model's segment scores; this project has an outcome reward model, so the
split is of the whole response's score, with one baseline embedding for every position.
Baseline (``baseline``): ``mean`` (default), the reward model's mean input-embedding row
``ē = (1/|V|) Σ_v E[v]``: the embedding of "a token drawn uniformly", so ``r_t`` is what token
``y_t`` adds over an uninformed token, on the embedding manifold's centre, and it depends on
the reward model alone. Not the zero vector (``zero``, offered), which is off that manifold
(normalized layers see a token of norm 0) and makes ``r_t`` the plain grad × input; and not the
policy-expected embedding ``π_tᵀE``, with which ``r_t`` is ``datc_identity``'s score exactly
(already a row of every comparison).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from datc.credit import register_credit
from datc.credit.base import RM_EMBEDDING, RM_GRAD, CreditBatch
from datc.credit.schemes.datc import flat_valid, scatter_valid
from datc.credit.weights import WeightParams

BASELINES = ("mean", "zero")


@dataclass
class P2TParams(WeightParams):
    """The weight step's fields plus the Taylor split's baseline embedding."""

    baseline: str = "mean"  # mean: the reward model's mean embedding row; zero: the zero vector

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline must be one of {BASELINES}, got {self.baseline!r}")


def taylor_token_rewards(g: Tensor, E: Tensor, y: Tensor, baseline: str) -> Tensor:
    """(N,) float64 ``r = ⟨g, E[y] - e_base⟩`` for N tokens: ``g`` (N, d), ``E`` (V, d), ids ``y`` (N,)."""
    e = E[y].double()
    base = E.double().mean(0) if baseline == "mean" else torch.zeros(E.shape[1], dtype=torch.float64, device=E.device)
    return (g.double() * (e - base)).sum(-1)


@register_credit("p2t", needs={RM_GRAD, RM_EMBEDDING}, output="scores", params=P2TParams,
                 row_local=True, row_separable=True)  # per-token scores, per-response weights
def p2t(batch: CreditBatch, params: P2TParams) -> Tensor:
    """First-order Taylor token rewards of the reward model's score, signed by A."""
    g, y, rows = flat_valid(batch)
    r = taylor_token_rewards(g[rows], batch.rm_embedding, y[rows].to(batch.rm_embedding.device), params.baseline)
    sign = torch.sign(batch.advantages).double().repeat_interleave(batch.response_mask.shape[1])[rows]
    return scatter_valid(sign * r, rows, batch.response_mask)
