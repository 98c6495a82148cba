"""``gcpo``: Guidance Contrastive Policy Optimization (arXiv 2605.29198), METHOD §3.

A token gets credit by how much a negative guidance prompt ``x⁻`` (the prompt with an
instruction to answer wrongly) changes the rollout policy's probability of it::

    Δ_t = log π_old(y_t | x⁻, y_<t) - log π_old(y_t | x, y_<t)
    s_t = e^Δ_t - Δ_t - 1          (the pointwise k3 estimate of KL, >= 0, 0 iff Δ_t = 0)

and the shared weight step turns the scores into per-response weights with the ``rank_power``
normalizer: ``w ∝ (rank_t / T_i)^α``, mean 1 per response, so every token keeps the sign of
``A_i`` and the response's mean token advantage is ``A_i``. ``x⁻`` costs one extra no-grad
forward of the rollout policy on the sampled response ids (the ``logps_under`` input).

Follows the public code's ``importance_weighting_type: kl`` with ``importance_normalization:
rank(40/80)``: ``Δ`` clamped to ``[-20, 20]`` and ``s`` to at most 10 before ranking,
``α = log(1 - 0.8) / log(1 - 0.4) - 1 ≈ 2.1506`` (the top 40% of tokens carry 80% of the
weight). The negative prompt is a configurable ``template`` around the prompt text (the public
code appends "Note: Intentionally generate an incorrect answer." to its math prompt); set it to
such an instruction for real models. The default ``"not {prompt}"`` keeps to the testbed's
word-level vocabulary (any other word would be ``<unk>``). On the testbed (tiny_gpt2, warm
policy, 4 batches of 64) it gave a higher credit accuracy than the suffix ``"{prompt} not"``
(keywords 0.19 vs 0.14, arithmetic 0.44 vs 0.10), but the neutral prefix ``"the {prompt}"``
did as well (0.19, 0.44): the tiny policies follow no instruction, so there the score measures
each token's sensitivity to a perturbed prompt rather than to a request for a wrong answer.

Departures: (1) the weights are computed once per rollout batch from ``π_old`` (METHOD §1), not
in every micro-batch from the policy being updated (identical on the first on-policy epoch);
(2) tied scores share their average rank, so equal scores get equal weights (the public code
breaks ties by sort order), and a response whose scores are all equal (e.g. every ``Δ`` clamped,
or a single token) falls back to ``w = 1``; (3) the weight step's ``lam`` and clipping are
available (defaults leave GCPO's weights unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from datc.credit import register_credit
from datc.credit.base import LOGPS_UNDER, OLD_LOGPS, PROMPTS, CreditBatch
from datc.credit.weights import WeightParams
from datc.math.losses import k3


@dataclass
class GCPOParams(WeightParams):
    """The weight step's fields (GCPO's rank-power defaults) plus the negative prompt."""

    template: str = "not {prompt}"  # negative guidance prompt x-; {prompt} is the original prompt text
    delta_clip: float = 20.0  # clamp Δ to [-delta_clip, delta_clip] before e^Δ (public code: 20)
    score_clip: float = 10.0  # clamp s = e^Δ - Δ - 1 to at most score_clip (public code: 10)
    normalizer: str = "rank_power"  # w ∝ (rank/T)^alpha, mean 1 per response
    alpha: float = 2.1506  # rank_power exponent: log(0.2)/log(0.6) - 1, top 40% of tokens get 80% of w

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.template, str) or "{prompt}" not in self.template:
            raise ValueError(f"template must be a string containing {{prompt}}, got {self.template!r}")
        try:
            self.template.format(prompt="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"template {self.template!r} must have no placeholder but {{prompt}}: {e}") from e
        for name in ("delta_clip", "score_clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")


def negative_prompts(prompts: list[str], template: str) -> list[str]:
    """``x⁻`` for each prompt text: the template with ``{prompt}`` filled in."""
    return [template.format(prompt=p) for p in prompts]


def guidance_scores(logps_neg: Tensor, logps: Tensor, delta_clip: float, score_clip: float) -> Tensor:
    """``s = e^Δ - Δ - 1`` with ``Δ = clamp(logps_neg - logps)``, clamped to ``<= score_clip``.
    (B, T) -> (B, T) float64."""
    delta = (logps_neg.double() - logps.double()).clamp(-delta_clip, delta_clip)
    return k3(delta).clamp(max=score_clip)


@register_credit("gcpo", needs={OLD_LOGPS, PROMPTS, LOGPS_UNDER}, output="scores", params=GCPOParams,
                 row_local=True, row_separable=True)  # per-token scores (each row under its own x-), per-response weights
def gcpo(batch: CreditBatch, params: GCPOParams) -> Tensor:
    """How far a negative guidance prompt moves each sampled token's log-prob (k3 divergence)."""
    logps_neg = batch.logps_under(negative_prompts(batch.prompts, params.template))
    scores = guidance_scores(logps_neg, batch.old_logps, params.delta_clip, params.score_clip)
    return torch.where(batch.response_mask, scores, 0.0)
