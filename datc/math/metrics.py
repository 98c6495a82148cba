"""Statistics shared by training, evaluation and the prepare step."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def pearson(x: Tensor, y: Tensor) -> float:
    """Pearson correlation of two 1-D tensors; NaN when either is constant."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    den = x.norm() * y.norm()
    return float((x @ y) / den) if den > 0 else math.nan


def within_group_corr(x: Tensor, y: Tensor, group_size: int) -> float:
    """Mean Pearson correlation of ``x`` and ``y`` within each group of ``group_size``
    consecutive entries, over the groups where neither is constant (NaN if none). This is what
    GRPO sees: a reward model is only useful if it ranks the responses to one prompt."""
    xs, ys = x.view(-1, group_size), y.view(-1, group_size)
    vals = [pearson(a, b) for a, b in zip(xs, ys, strict=True)]
    vals = [v for v in vals if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def finite_mean(x: Tensor) -> float:
    """Mean of the finite entries of ``x`` (NaN if none); non-finite ones are counted apart."""
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else math.nan


def finite_std(x: Tensor) -> float:
    """Std of the finite entries of ``x`` (NaN if fewer than two)."""
    x = x[torch.isfinite(x)]
    return float(x.std()) if x.numel() > 1 else math.nan


def mean_of(xs: list) -> float | None:
    """Mean of the finite numbers in ``xs`` (None, missing and non-finite entries skipped; None if none)."""
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None
