"""``delta``: DelTA, discriminative token credit assignment (arXiv 2605.21467), METHOD §3.

The policy-gradient update acts as a linear discriminator between advantage-weighted centroids
of token-gradient vectors. DelTA uses the last-layer proxy ``v_t = (1 - π_old(y_t)) h_t``
(``h_t`` the LM-head input that predicts ``y_t``: the gradient of ``log π(y_t)`` with respect to
the LM-head weights' row of ``y_t``), and up-weights the tokens that are characteristic of
their own side. Over the rollout batch's valid tokens:

1. Centroids: ``μ+ = Σ A_i v_t / Σ A_i`` over tokens of responses with ``A_i > 0``, ``μ-``
   likewise with ``|A_i|`` over ``A_i < 0`` (the zero vector for an empty side).
2. Margin of each token towards its own side: ``m_t = ‖v_t - μ_other‖² - ‖v_t - μ_own‖²``
   ``= sign(A_i) · 2 (v_t·(μ+ - μ-) - (‖μ+‖² - ‖μ-‖²) / 2)`` (computed in this linear form).
   ``γ±`` = the (population) std of the margins on each side, floored at ``sqrt(1e-8)``.
3. ``K`` refinement steps: ``μ± ← Σ σ(m_t/γ±) |A_i| v_t / Σ σ(m_t/γ±) |A_i|``, and ``γ±``
   from the margins that gave those weights.
4. ``w_t = λ_min + (λ_max - λ_min) σ(m_t / (τ γ±))`` from the final centroids, ``λ_min`` on
   every token of a zero-advantage response (as the public code does: such responses carry no
   advantage but count in step 5); then one global rescale so the batch's valid tokens have
   mean weight 1 (normalization ``global``: a single response's mean need not be 1, and the
   rescaled weights lie in ``[c λ_min, c λ_max]`` with ``c`` the rescale factor).

Follows the public code's ``Normal`` implementation (defaults ``K = 1``, ``λ ∈ [0.8, 1.2]``,
identity metric ``d = 1``, ``λ_w = 1``, sigmoid temperature 1 in units of the margin's std),
including its order of updates (the final ``γ`` comes from the margins of the last refinement
step's input centroids). ``h_t`` is taken from ``output_hidden_states`` (last entry, after the
final norm in GPT-2/Llama/Qwen), equal to the public code's hook on the LM head's input.
Departures: weights come from the rollout pass's ``π_old`` once per rollout batch (the public
code recomputes them per mini-batch update from the actor before the update, the same policy on
the first epoch); the batch is the whole rollout batch (the public code's is each worker's
share); ``τ`` is exposed as a config field (public code: 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from datc.credit import register_credit
from datc.credit.base import OLD_LOGPS, POLICY_HIDDEN, CreditBatch

VAR_FLOOR = 1e-8  # floor on the margins' variance (public code's eps)
MASS_FLOOR = 1e-8  # floor on a side's total weight, so an empty side gives the zero centroid


@dataclass
class DeltaParams:
    K: int = 1  # centroid refinement steps (public code's default 1; 0: advantage-weighted centroids only)
    lam_min: float = 0.8  # weight of a token far on the other side (and of zero-advantage responses)
    lam_max: float = 1.2  # weight of a token far on its own side
    tau: float = 1.0  # sigmoid temperature, in units of the margin's std per side

    def __post_init__(self) -> None:
        if isinstance(self.K, bool) or not isinstance(self.K, int) or self.K < 0:
            raise ValueError(f"K must be an integer >= 0, got {self.K!r}")
        if not 0.0 <= self.lam_min <= self.lam_max:
            raise ValueError(f"need 0 <= lam_min <= lam_max, got lam_min={self.lam_min}, lam_max={self.lam_max}")
        if not self.tau > 0:
            raise ValueError(f"tau must be > 0, got {self.tau}")


def _one(x: Tensor) -> Tensor:
    return x


def _centroid(v: Tensor, mass: Tensor, rank_sum=_one) -> Tensor:
    """Weighted mean of the rows of ``v`` (N, d) with weights ``mass`` (N,), over every
    process's tokens (``rank_sum``); 0 if the mass is 0."""
    return rank_sum(mass.to(v.dtype) @ v) / rank_sum(mass.sum()).clamp_min(MASS_FLOOR).to(v.dtype)


def _margins(v: Tensor, side: Tensor, mu_pos: Tensor, mu_neg: Tensor) -> Tensor:
    """``‖v - μ_other‖² - ‖v - μ_own‖²`` per token (N,) float64, ``side`` = sign(A) in {-1, 0, 1}."""
    score = v @ (mu_pos - mu_neg) - 0.5 * (mu_pos.square().sum() - mu_neg.square().sum())
    return 2.0 * side * score.double()


def _spread(m: Tensor, on: Tensor, rank_sum=_one) -> Tensor:
    """The std of ``m`` over the entries where ``on`` (population, every process's tokens),
    floored at sqrt(VAR_FLOOR)."""
    n = rank_sum(on.sum().to(m.dtype)).clamp_min(1)
    mean = rank_sum((m * on).sum()) / n
    var = rank_sum((m.square() * on).sum()) / n - mean.square()
    return var.clamp_min(VAR_FLOOR).sqrt()


def delta_weights(v: Tensor, adv: Tensor, params: DeltaParams, rank_sum=_one) -> Tensor:
    """DelTA's weights (N,) float64 for N valid tokens with proxies ``v`` (N, d) and their
    response's advantages ``adv`` (N,), before the global rescale. ``rank_sum`` sums the
    centroids' and spreads' statistics over data-parallel processes (identity with one)."""
    side = torch.sign(adv).double()
    pos, neg = side > 0, side < 0
    a = adv.double().abs()

    def gammas(m: Tensor) -> Tensor:  # (N,) the std of the token's own side
        return torch.where(pos, _spread(m, pos, rank_sum), _spread(m, neg, rank_sum))

    mu_pos, mu_neg = _centroid(v, a * pos, rank_sum), _centroid(v, a * neg, rank_sum)
    gamma = gammas(_margins(v, side, mu_pos, mu_neg))
    for _ in range(params.K):
        m = _margins(v, side, mu_pos, mu_neg)
        soft = torch.sigmoid(m / gamma) * a
        mu_pos, mu_neg = _centroid(v, soft * pos, rank_sum), _centroid(v, soft * neg, rank_sum)
        gamma = gammas(m)
    gate = torch.sigmoid(_margins(v, side, mu_pos, mu_neg) / (params.tau * gamma))
    w = params.lam_min + (params.lam_max - params.lam_min) * gate
    return torch.where(side != 0, w, params.lam_min)


@register_credit("delta", needs={OLD_LOGPS, POLICY_HIDDEN}, output="weights", normalization="global",
                 params=DeltaParams)
def delta(batch: CreditBatch, params: DeltaParams) -> Tensor:
    """DelTA: weights from a margin between advantage-weighted centroids of (1 - π) h_t. (B, T)"""
    mask = batch.response_mask
    rows = mask.reshape(-1).nonzero().squeeze(-1)  # (N,) valid tokens
    out = torch.zeros(mask.numel(), dtype=torch.float64, device=mask.device)
    # No early exit on an empty share: under data parallelism every process makes the same
    # reductions (an empty share contributes zeros).
    h = batch.policy_hidden.reshape(mask.numel(), -1)[rows].float()  # (N, d)
    p = batch.old_logps.reshape(-1)[rows].float().exp()  # (N,)
    v = (1.0 - p)[:, None] * h
    adv = batch.advantages[:, None].expand(mask.shape).reshape(-1)[rows]
    w = delta_weights(v, adv, params, batch.rank_sum)
    n_global = batch.rank_sum(torch.tensor(float(rows.numel()), dtype=torch.float64, device=mask.device))
    out[rows] = w * (n_global / batch.rank_sum(w.sum()).clamp_min(MASS_FLOOR))  # global mean 1
    return out.view(mask.shape).float()
