"""Credit diagnostics, logged under ``credit/`` for every scheme."""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from scipy.stats import spearmanr
from torch import Tensor

from datc.credit.base import CreditOutput


def credit_accuracy(signed_scores: Tensor, gold_contrib: Tensor, mask: Tensor) -> float:
    """Mean over responses of the Spearman correlation between ``sign(A)·s`` and each token's
    gold contribution, over the response's valid tokens. Responses where either is constant
    (e.g. a zero advantage, or no token that matters) are skipped; NaN if none is left, which
    is the case for constant weights such as GRPO's: its accuracy is undefined, not zero."""
    vals = []
    for s, g, mk in zip(signed_scores.cpu().numpy(), gold_contrib.cpu().numpy(), mask.cpu().numpy(), strict=True):
        s, g = s[mk], g[mk]
        if len(s) < 2 or np.ptp(s) == 0 or np.ptp(g) == 0 or not np.isfinite(s).all():
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = spearmanr(s, g).statistic
        if math.isfinite(r):
            vals.append(r)
    return float(np.mean(vals)) if vals else math.nan


def credit_metrics(out: CreditOutput, advantages: Tensor, mask: Tensor, gold_contrib: Tensor | None) -> dict[str, float]:
    """Weight statistics over valid tokens, the effective sample size of each response's
    weights (``(Σw)² / (T Σw²)``, 1 for uniform), the fraction of tokens above 1, the fallback
    rate among responses with a non-zero advantage (a zero advantage makes weights moot) and,
    on tasks with gold contributions, credit accuracy."""
    w = out.weights
    mk = mask.bool()
    valid = w[mk]
    if valid.numel() == 0:
        return {"credit/fallback_frac": _fallback_frac(out, advantages)}
    wf = w * mk
    n = mk.sum(-1).clamp(min=1)
    ess = (wf.sum(-1) ** 2 / (n * (wf**2).sum(-1)).clamp(min=1e-12))[mk.any(-1)]
    metrics = {
        "credit/weight_mean": float(valid.mean()),
        "credit/weight_std": float(valid.std()) if valid.numel() > 1 else 0.0,
        "credit/weight_min": float(valid.min()),
        "credit/weight_max": float(valid.max()),
        "credit/frac_above_1": float((valid > 1 + 1e-6).float().mean()),
        "credit/ess": float(ess.mean()),
        "credit/fallback_frac": _fallback_frac(out, advantages),
    }
    if out.scores is not None:
        s = out.scores[mk]
        metrics["credit/score_mean"] = float(s.mean())
        metrics["credit/score_std"] = float(s.std()) if s.numel() > 1 else 0.0
        q = torch.quantile(s.double(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
        metrics.update({"credit/score_p10": float(q[0]), "credit/score_p50": float(q[1]), "credit/score_p90": float(q[2])})
    if gold_contrib is not None:
        signed = (out.scores if out.scores is not None else w) * torch.sign(advantages)[:, None]
        metrics["credit/accuracy"] = credit_accuracy(signed, gold_contrib, mk)
    return metrics


def _fallback_frac(out: CreditOutput, advantages: Tensor) -> float:
    moving = advantages != 0
    return float(out.fallback[moving].float().mean()) if moving.any() else 0.0
