"""The shared weight step of METHOD §2.5: per-token scores -> per-response token weights.

Every score-returning credit scheme goes through :func:`scores_to_weights` (called by
:func:`datc.credit.compute_credit`), so the schemes differ only in their scores. The result
has ``w >= 0`` and ``mean_t w = 1`` over each response's valid tokens, hence
``sign(A_i · w) = sign(A_i)`` and ``mean_t A_i · w = A_i``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

NORMALIZERS = ("softmax", "linear", "rank_power")
END_TOKEN = ("score", "neutral")  # the end-of-text token weighted by its score like any token, or held at 1
# The linear normalizer's floor when ``w_min`` is unset (METHOD §2.5): small and positive, so a
# token far below its response's mean score keeps a little of the advantage instead of none.
LINEAR_FLOOR = 0.01
# Halvings of the clip shift's bracket (whose width is the response's weight range): 64 take
# it below float64 resolution for any realistic range, so the bisection is exact to rounding.
_CLIP_BISECTIONS = 64


@dataclass
class WeightParams:
    """Config fields of the weight step; every score-based scheme's params subclass this."""

    standardize: bool = True  # z-score scores per response (population std); false: centre only
    normalizer: str = "softmax"  # softmax | linear | rank_power
    tau: float = 1.0  # softmax temperature on z (> 0); smaller is more peaked
    alpha: float = 1.0  # linear: slope of 1 + alpha*z; rank_power: exponent of rank/T (>= 0)
    lam: float = 1.0  # mixing lambda in [0, 1]: w <- (1 - lam) + lam*w; 0 is GRPO bit for bit
    w_min: float | None = None  # lower clip in [0, 1], also the linear floor; None: no clip (linear floor 0.01)
    w_max: float | None = None  # upper clip >= 1; None: no clip
    min_std: float = 1e-5  # fall back to w = 1 where std(s) <= min_std * mean|s| (relative)
    eps: float = 1e-8  # added to the std in the z-score, relative to mean|s|
    end_token: str = "score"  # score | neutral: the end-of-text token weighted like any token, or held at w = 1

    def __post_init__(self) -> None:
        if self.end_token not in END_TOKEN:
            raise ValueError(f"end_token must be one of {END_TOKEN}, got {self.end_token!r}")
        if not isinstance(self.standardize, bool):
            raise ValueError(f"standardize must be true or false, got {self.standardize!r}")
        if self.normalizer not in NORMALIZERS:
            raise ValueError(f"normalizer must be one of {NORMALIZERS}, got {self.normalizer!r}")
        _check_range("tau", self.tau, lo=0.0, lo_open=True)
        _check_range("alpha", self.alpha, lo=0.0)
        _check_range("lam", self.lam, lo=0.0, hi=1.0)
        # Mean 1 with every token in [w_min, w_max] is feasible iff w_min <= 1 <= w_max.
        if self.w_min is not None:
            _check_range("w_min", self.w_min, lo=0.0, hi=1.0)
        if self.w_max is not None:
            _check_range("w_max", self.w_max, lo=1.0, hi=math.inf)
        _check_range("min_std", self.min_std, lo=0.0)
        _check_range("eps", self.eps, lo=0.0)


def _score_end(params: WeightParams) -> WeightParams:
    return dataclasses.replace(params, end_token="score")


def _check_range(
    name: str, value: float, lo: float, hi: float = math.inf, lo_open: bool = False
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        left = "(" if lo_open else "["
        raise ValueError(f"{name} must be a number in {left}{lo}, {hi}], got {value!r}")


@torch.no_grad()
def scores_to_weights(scores: Tensor, mask: Tensor, params: WeightParams, end: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Turn per-token scores into token weights with mean exactly 1 per response (METHOD §2.5).

    With ``params.end_token == "neutral"`` and ``end`` ((B, T) bool, each response's end-of-text
    token: :func:`datc.credit.base.end_of_text`), the end token takes ``w = 1`` and the steps below
    run over the response's other tokens (``mask & ~end``), so their mean is 1 and the response's
    mean stays 1: ``w_end = 1``, ``w_{t≠end} = weights(s_{t≠end})``. A truncated response (no end
    token) is weighted as without the option. ``fallback`` is then the fallback of the other tokens.

    Args:
        scores: (B, T) float, any values at masked positions (NaN included).
        mask: (B, T) bool, True on each response's valid tokens.
        params: the weight-step fields.

    Returns:
        weights: (B, T) float32, ``>= 0``, mean 1 over each response's valid tokens, 0 where
            masked. Masked positions never influence other weights.
        fallback: (B,) bool, True where the response got ``w = 1`` because it has fewer than
            two valid tokens, a non-finite score on a valid token, or a score spread that is
            rounding noise: ``std(s) <= min_std · mean|s|``. The threshold is relative, so
            scaling the reward model (hence every score) by ``c > 0`` changes no fallback.

    Steps, per response over its ``T_i`` valid tokens (computed in float64):

    1. ``z = (s - mean s) / (std s + eps)`` with the *population* std (divide by ``T_i``);
       ``standardize: false`` only centres (``z = s - mean s``), which softmax and rank_power
       ignore and which keeps the linear map's mean at 1 before its floor.
    2. Normaliser: ``softmax``: ``w = T_i · softmax(z / tau)``; ``linear``:
       ``w = max(floor, 1 + alpha z)`` with ``floor = w_min`` if set else ``LINEAR_FLOOR``
       (0.01, so no valid token's weight is 0), divided by its mean;
       ``rank_power``: ``w = (rank / T_i)^alpha`` divided by its mean, ranks 1..T_i ascending in
       score, tied scores sharing the average of their ranks (so equal scores get equal weights,
       independent of position).
    3. Mix ``w <- (1 - lam) + lam w`` (mean stays 1; ``lam = 0`` gives exactly 1.0).
    4. If ``w_min`` or ``w_max`` is set and a response has a token outside ``[lo, hi]``
       (``lo = w_min`` or 0, ``hi = w_max`` or inf): ``w <- clip(w + b, lo, hi)`` with one shift
       ``b`` per response solving ``mean clip(w + b, lo, hi) = 1``. That is the Euclidean
       projection of ``w`` onto ``{lo <= w <= hi, mean w = 1}``: tokens pushed past a bound
       sit on it and every other token moves by the same ``b``, so the bounds hold exactly and
       the mean is 1. The mean is continuous and non-decreasing in ``b`` and brackets 1 on
       ``[1 - max w, 1 - min w]`` because ``lo <= 1 <= hi`` (enforced by :class:`WeightParams`,
       the condition for mean 1 to be feasible), so bisection (64 halvings, float64) always
       finds ``b``. Responses already within bounds are left untouched.

    "Mean 1" is exact up to float64 rounding, then the float32 cast (about 1e-7).
    """
    if scores.shape != mask.shape or scores.dim() != 2:
        raise ValueError(
            f"scores {tuple(scores.shape)} and mask {tuple(mask.shape)} must both be (B, T)"
        )
    if params.end_token == "neutral":
        if end is None:
            raise ValueError("end_token: neutral needs each response's end-of-text token (the batch's response_end)")
        end = end.bool() & mask.bool()
        w, fallback = scores_to_weights(scores, mask.bool() & ~end, _score_end(params))
        return torch.where(end, torch.ones((), dtype=w.dtype), w), fallback
    mask = mask.bool()
    n = mask.sum(-1)  # (B,)
    n_f = n.clamp_min(1).to(torch.float64)[:, None]  # (B, 1)

    s = scores.detach().to(torch.float64)
    finite = torch.isfinite(s)
    all_finite = (finite | ~mask).all(-1)  # (B,)
    s = torch.where(mask & finite, s, 0.0)  # masked or non-finite entries cannot leak
    centred = torch.where(mask, s - s.sum(-1, keepdim=True) / n_f, 0.0)  # (B, T)
    std = (centred.square().sum(-1, keepdim=True) / n_f).sqrt()  # (B, 1), population std
    scale = s.abs().sum(-1) / n_f.squeeze(-1)  # (B,) mean |s| over valid tokens
    fallback = (n < 2) | ~all_finite | (std.squeeze(-1) <= params.min_std * scale)  # (B,)

    # eps is relative to the scores' magnitude too, so z (and w) are invariant to scaling s.
    z = centred / (std + params.eps * scale[:, None]) if params.standardize else centred
    z = torch.where(fallback[:, None], 0.0, z)  # keeps fallback rows finite; replaced below
    if params.normalizer == "softmax":
        logits = torch.where(mask, z / params.tau, -math.inf)
        logits = torch.where(n[:, None] > 0, logits, 0.0)  # an empty row must not give NaN
        w = n_f * torch.softmax(logits, dim=-1)
    elif params.normalizer == "linear":
        floor = LINEAR_FLOOR if params.w_min is None else params.w_min
        w = torch.where(mask, (1.0 + params.alpha * z).clamp_min(floor), 0.0)
        w = _to_mean_one(w, n_f)  # z is centred, so the mean before this is >= 1
    else:  # rank_power
        ranks = _average_ranks(torch.where(fallback[:, None], 0.0, s), mask)
        w = torch.where(mask, (ranks / n_f).pow(params.alpha), 0.0)
        w = _to_mean_one(w, n_f)

    w = (1.0 - params.lam) + params.lam * w
    w = torch.where(fallback[:, None], 1.0, w)
    w = torch.where(mask, w, 0.0)
    if params.w_min is not None or params.w_max is not None:
        lo = 0.0 if params.w_min is None else float(params.w_min)
        hi = math.inf if params.w_max is None else float(params.w_max)
        w = _clip_keep_mean(w, mask, lo, hi)
    return w.to(torch.float32), fallback


def _to_mean_one(w: Tensor, n_f: Tensor) -> Tensor:
    """Divide each row of ``w`` (B, T), 0 where masked, by its mean over ``n_f`` (B, 1) tokens;
    an empty row stays 0 instead of 0/0."""
    return w / (w.sum(-1, keepdim=True) / n_f).clamp_min(torch.finfo(w.dtype).tiny)


def _average_ranks(s: Tensor, mask: Tensor) -> Tensor:
    """(B, T) float64 ranks 1..T_i of the valid entries of ``s``, ascending, ties averaged.

    Masked entries sort after every valid one (their ranks exceed T_i and are discarded).
    """
    B, T = s.shape
    key = torch.where(mask, s, math.inf)
    sorted_key, order = key.sort(dim=-1, stable=True)
    starts = torch.ones_like(mask)
    starts[:, 1:] = sorted_key[:, 1:] != sorted_key[:, :-1]
    group = starts.long().cumsum(-1) - 1  # (B, T) tie-group index in sorted order
    pos = torch.arange(1, T + 1, dtype=torch.float64, device=s.device).expand(B, T)
    total = torch.zeros(B, T, dtype=torch.float64, device=s.device).scatter_add(-1, group, pos)
    count = torch.zeros_like(total).scatter_add(-1, group, torch.ones_like(pos))
    mean_rank = (total / count.clamp_min(1.0)).gather(-1, group)  # in sorted order
    return torch.empty_like(mean_rank).scatter(-1, order, mean_rank)


def _clip_keep_mean(w: Tensor, mask: Tensor, lo: float, hi: float) -> Tensor:
    """``clip(w + b, lo, hi)`` per response with the shift ``b`` that keeps the mean at 1.

    ``w``: (B, T) float64 with mean 1 over valid tokens and 0 where masked; ``lo <= 1 <= hi``.
    Only rows with a valid token outside ``[lo, hi]`` are changed (the others stay bit for bit).
    """
    rows = (mask & ((w < lo) | (w > hi))).any(-1).nonzero().squeeze(-1)  # (R,)
    if rows.numel() == 0:
        return w
    wr, mr = w[rows], mask[rows]  # (R, T)
    target = mr.sum(-1).to(w.dtype)  # (R,) the sum of weights that mean 1 requires
    # mean clip(w + b) <= 1 at b = 1 - max w and >= 1 at b = 1 - min w (since lo <= 1 <= hi).
    b_lo = 1.0 - torch.where(mr, wr, -math.inf).amax(-1)
    b_hi = 1.0 - torch.where(mr, wr, math.inf).amin(-1)
    for _ in range(_CLIP_BISECTIONS):
        b = 0.5 * (b_lo + b_hi)
        total = torch.where(mr, (wr + b[:, None]).clamp(lo, hi), 0.0).sum(-1)
        below = total < target
        b_lo = torch.where(below, b, b_lo)
        b_hi = torch.where(below, b_hi, b)
    b = 0.5 * (b_lo + b_hi)
    w = w.clone()
    w[rows] = torch.where(mr, (wr + b[:, None]).clamp(lo, hi), 0.0)
    return w
