"""Credit diagnostics, logged under ``credit/`` for every scheme."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from datc.credit.base import CreditOutput


def _average_ranks(x: Tensor, mask: Tensor) -> Tensor:
    """Per row, the rank (1-based, ties averaged, as ``scipy.stats.rankdata``) of each valid
    entry among the row's valid entries; 0 elsewhere. (B, T) -> (B, T) float64."""
    xv = x.double()
    m = mask[:, :, None] & mask[:, None, :]  # (B, T, T): both entries valid
    below = ((xv[:, None, :] < xv[:, :, None]) & m).sum(-1)
    equal = ((xv[:, None, :] == xv[:, :, None]) & m).sum(-1)
    return torch.where(mask, below + (equal + 1) / 2, torch.zeros_like(xv))


def credit_accuracy(signed_scores: Tensor, gold_contrib: Tensor, mask: Tensor) -> float:
    """Mean over responses of the Spearman correlation between ``sign(A)·s`` and each token's
    gold contribution, over the response's valid tokens. Responses where either is constant
    (e.g. a zero advantage, or no token that matters) are skipped; NaN if none is left, which
    is the case for constant weights such as GRPO's: its accuracy is undefined, not zero."""
    r = credit_accuracy_rows(signed_scores, gold_contrib, mask)
    ok = ~r.isnan()
    return float(r[ok].mean()) if ok.any() else math.nan


def credit_accuracy_rows(signed_scores: Tensor, gold_contrib: Tensor, mask: Tensor) -> Tensor:
    """Per response (float64, shape ``(B,)``): the Spearman correlation between ``sign(A)·s``
    and the gold contributions over its valid tokens; NaN where it is undefined (fewer than 2
    tokens, a constant row, a non-finite score).

    Vectorized over responses: Pearson correlation of average ranks, which is exactly
    ``scipy.stats.spearmanr`` (tested against it)."""
    s, g, mk = signed_scores.detach().cpu(), gold_contrib.detach().cpu(), mask.detach().cpu().bool()
    finite = torch.where(mk, torch.isfinite(s), torch.ones_like(mk)).all(-1)
    mk = mk & finite[:, None]
    rows = max(1, 2**24 // max(mk.shape[1] ** 2, 1))  # (rows, T, T) comparisons at a time
    rs = torch.cat([_average_ranks(torch.where(m, x, 0), m) for x, m in zip(s.split(rows), mk.split(rows), strict=True)])
    rg = torch.cat([_average_ranks(torch.where(m, x, 0), m) for x, m in zip(g.split(rows), mk.split(rows), strict=True)])
    n = mk.sum(-1).double()
    mean_s = rs.sum(-1) / n.clamp(min=1)
    mean_g = rg.sum(-1) / n.clamp(min=1)
    ds = torch.where(mk, rs - mean_s[:, None], torch.zeros_like(rs))
    dg = torch.where(mk, rg - mean_g[:, None], torch.zeros_like(rg))
    cov, vs, vg = (ds * dg).sum(-1), (ds * ds).sum(-1), (dg * dg).sum(-1)
    ok = finite & (n >= 2) & (vs > 0) & (vg > 0)  # a constant row has zero rank variance
    r = cov / (vs * vg).sqrt().clamp(min=torch.finfo(torch.float64).tiny)
    return torch.where(ok, r.double(), torch.full_like(r.double(), math.nan))


WEIGHT_KEYS = ("weight_mean", "weight_std", "weight_min", "weight_max", "frac_above_1", "ess")
SCORE_KEYS = ("score_mean", "score_std", "score_p10", "score_p50", "score_p90")


def credit_metrics(out: CreditOutput, advantages: Tensor, mask: Tensor, gold_contrib: Tensor | None) -> dict[str, float]:
    """Weight statistics over valid tokens, the effective sample size of each response's
    weights (``(Σw)² / (T Σw²)``, 1 for uniform), the fraction of tokens above 1, the fallback
    rate and, on tasks with gold contributions, credit accuracy.

    All of them over the responses with a non-zero advantage only: a zero advantage makes a
    response's weights moot (``Â = 0``), and the trainer may not even compute them
    (``trainer.skip_zero_advantage``), so the figures are the same with the skip on or off, and
    for every scheme. NaN where no such response has a valid token (e.g. every group tied)."""
    w = out.weights
    mk = mask.bool() & (advantages != 0)[:, None]  # (B, T) the tokens whose weights matter
    valid = w[mk]
    metrics = {f"credit/{k}": math.nan for k in WEIGHT_KEYS + (SCORE_KEYS if out.scores is not None else ())}
    metrics["credit/fallback_frac"] = _fallback_frac(out, advantages)
    if gold_contrib is not None:
        signed = (out.scores if out.scores is not None else w) * torch.sign(advantages)[:, None]
        metrics["credit/accuracy"] = credit_accuracy(signed, gold_contrib, mk)
    if valid.numel() == 0:
        return metrics
    wf = w * mk
    n = mk.sum(-1).clamp(min=1)
    ess = (wf.sum(-1) ** 2 / (n * (wf**2).sum(-1)).clamp(min=1e-12))[mk.any(-1)]
    metrics.update({
        "credit/weight_mean": float(valid.mean()),
        "credit/weight_std": float(valid.std()) if valid.numel() > 1 else 0.0,
        "credit/weight_min": float(valid.min()),
        "credit/weight_max": float(valid.max()),
        "credit/frac_above_1": float((valid > 1 + 1e-6).float().mean()),
        "credit/ess": float(ess.mean()),
    })
    if out.scores is not None:
        s = out.scores[mk]
        metrics["credit/score_mean"] = float(s.mean())
        metrics["credit/score_std"] = float(s.std()) if s.numel() > 1 else 0.0
        q = torch.quantile(s.double(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64, device=s.device))
        metrics.update({"credit/score_p10": float(q[0]), "credit/score_p50": float(q[1]), "credit/score_p90": float(q[2])})
    return metrics


def _fallback_frac(out: CreditOutput, advantages: Tensor) -> float:
    moving = advantages != 0
    return float(out.fallback[moving].float().mean()) if moving.any() else 0.0
