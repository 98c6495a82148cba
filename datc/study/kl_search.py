"""METHOD §6's matched-KL search, one decision at a time (pure: nothing here runs or reads a run).

"GRPO's learning rate whose mean final KL(π‖π_ref) on the selection seeds is within ±5% of the
scheme's (proposals interpolated log-log between the two tried rates whose KLs bracket the
target)". :func:`kl_step` takes the baseline's finished selection points (lr, mean final KL; None
for a rate that diverged) and the target (the scheme's chosen configuration's mean selection KL),
and says either the matched rate (with the ratio reached), or the next rate to try, or why the
search stops (the ratio of the nearest point said).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

TOLERANCE = 0.05  # |KL_baseline / KL_scheme - 1| at most this on the selection seeds: matched
MAX_ROUNDS = 6  # search rounds per scheme (each: the baseline at one new rate on the selection seeds)
MAX_MOVE = 4.0  # an extrapolated proposal moves the rate at most this factor from its anchor
MIN_SLOPE = 0.5  # d log KL / d log lr taken at least this when extrapolating


def round3(x: float) -> float:
    """3 significant digits (the rates the records' searches proposed: 1.2e-3, 5.64e-5)."""
    return float(f"{x:.3g}")


def _same(a: float, b: float) -> bool:
    return abs(a / b - 1.0) < 1e-6


@dataclass(frozen=True)
class KlStep:
    lr: float | None = None  # the matched rate (found)
    ratio: float | None = None  # its selection KL / the target; where stopped, the nearest point's
    propose: float | None = None  # the next rate to run on the selection seeds
    stopped: str | None = None  # why the search ends without a match


def kl_step(points: Sequence[tuple[float, float | None]], target: float, rounds: int, *, tol: float = TOLERANCE,
            max_rounds: int = MAX_ROUNDS, bounds: tuple[float, float]) -> KlStep:
    """One decision of the search: (1) a point within ``tol`` of ``target`` (the nearest in
    ``|log(KL/target)|``) is the match; (2) after ``max_rounds`` rounds, stop; (3) two tried rates,
    adjacent among the finite points, whose KLs straddle the target (the narrowest pair in log lr,
    ties the lowest): the log-log interpolation ``exp(log l0 + (log T - log k0)(log l1 - log l0) /
    (log k1 - log k0))`` to 3 significant digits, or the log-midpoint where the rounding lands on a
    tried rate or outside the pair (stop where that too does); (4) else extrapolate from the point of
    the largest KL (a larger target) or the smallest (a smaller one) along the slope to its neighbour,
    taken at least ``MIN_SLOPE``, the move at most ×``MAX_MOVE``, at most to the log-midpoint below a
    rate that diverged, clamped to ``bounds`` (stop where the anchor is already there); (5) a proposal
    equal to a tried rate stops the search."""
    finite = sorted((float(lr), float(kl)) for lr, kl in points if kl is not None and kl > 0 and lr > 0)
    diverged = sorted(float(lr) for lr, kl in points if kl is None)
    tried = [float(lr) for lr, _ in points]
    lt = math.log(target)
    within = [(abs(math.log(kl) - lt), lr, kl) for lr, kl in finite if abs(kl / target - 1.0) <= tol + 1e-12]
    if within:
        _, lr, kl = min(within)
        return KlStep(lr=lr, ratio=kl / target)
    near = min(finite, key=lambda p: abs(math.log(p[1]) - lt), default=None)
    near_text = f"; nearest lr {near[0]:g} at ratio {near[1] / target:.3f}" if near else ""
    ratio = near[1] / target if near else None

    def stop(why: str) -> KlStep:
        return KlStep(ratio=ratio, stopped=why + near_text)

    if rounds >= max_rounds:
        return stop(f"no rate within ±{tol:.0%} in {max_rounds} rounds")
    pairs = [(a, b) for a, b in zip(finite, finite[1:], strict=False)
             if min(a[1], b[1]) < target < max(a[1], b[1])]
    if pairs:
        (l0, k0), (l1, k1) = min(pairs, key=lambda ab: (math.log(ab[1][0] / ab[0][0]), ab[0][0]))
        f = (lt - math.log(k0)) / (math.log(k1) - math.log(k0))
        lr = round3(math.exp(math.log(l0) + f * (math.log(l1) - math.log(l0))))
        if not l0 < lr < l1 or any(_same(lr, x) for x in tried):
            lr = round3(math.sqrt(l0 * l1))
            if not l0 < lr < l1 or any(_same(lr, x) for x in tried):
                return stop(f"the bracket {l0:g}..{l1:g} is narrower than the rounding")
        return KlStep(propose=lr)
    lo, hi = bounds
    if not finite:  # every rate tried diverged: a quarter of the lowest
        anchor, lr = diverged[0], max(lo, diverged[0] / MAX_MOVE)
        if _same(anchor, lo) or anchor < lo:
            return stop(f"every rate tried diverged, down to the search's bound {lo:g}")
    else:
        up = target > max(kl for _, kl in finite)
        i = max(range(len(finite)), key=lambda j: (finite[j][1], finite[j][0])) if up else \
            min(range(len(finite)), key=lambda j: (finite[j][1], finite[j][0]))
        j = i + 1 if i + 1 < len(finite) else i - 1
        slope = 1.0 if j < 0 else (math.log(finite[j][1]) - math.log(finite[i][1])) / \
            (math.log(finite[j][0]) - math.log(finite[i][0]))
        slope = max(abs(slope), MIN_SLOPE)
        anchor = finite[i][0]
        move = max(-math.log(MAX_MOVE), min(math.log(MAX_MOVE), (lt - math.log(finite[i][1])) / slope))
        lr = anchor * math.exp(move)
        if up and (wall := [d for d in diverged if d > anchor]):
            lr = min(lr, math.sqrt(anchor * wall[0]))
        bound = hi if up else lo
        if _same(anchor, bound) or (anchor > hi if up else anchor < lo):
            return stop(f"the target is beyond the search's bound {bound:g}")
        lr = min(hi, max(lo, lr))
    lr = round3(lr)
    if any(_same(lr, x) for x in tried):
        return stop(f"the search came back to a rate it tried ({lr:g}) without a match")
    return KlStep(propose=lr)


def credit_share(at_matched: float | None, at_equal: float | None) -> float | None:
    """METHOD §6's credit share: the gain at matched KL over the gain at equal tuning (None where
    either is unknown or the equal-tuning gain is zero); may be below 0 or above 1."""
    if at_matched is None or at_equal is None or at_equal == 0:
        return None
    return at_matched / at_equal
