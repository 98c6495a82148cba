"""METHOD §6's bracketing rule on one coordinate, as pure functions of the points tried.

A coordinate's points lie on a lattice ``value = default · 2**k`` (``k`` an integer: ×1/2, ×1, ×2
are k = -1, 0, 1). The search starts at ``Limits.start`` (×0.5, ×1, ×2) and, "while the best point
of a coordinate is at either end, the grid extends one more factor of 2 beyond that end" (METHOD
§6): the learning rate up to ×32 or down to ×1/32 (``RATE``: k in [-5, 5]), the knob (``τ`` or a
peer's own) up to ×8 or down to ×1/8 (``KNOB``: k in [-3, 3]). It stops when the best point has a
tried neighbour on each side, or the neighbour beyond it diverged or collapsed (an *edge*, stated
in the table), or the best point is at the search's limit. A diverged or collapsed point is never
chosen: it is a stop-marker. :func:`bracket_step` says which points must run (or finish) before
anything is decided, or the point chosen; nothing here runs or reads a run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from datc.report.statistics import same_value


@dataclass(frozen=True)
class Point:
    """One lattice point of a coordinate, read from its selection runs."""

    k: int
    score: float | None  # mean final held-out gold over the selection seeds
    complete: bool  # every selection seed finished (a diverged seed counts as finished)
    diverged: bool = False  # a selection run of it diverged (non-finite loss): stop-marker
    collapsed: bool = False  # at least half of its selection runs had a length collapse: stop-marker


@dataclass(frozen=True)
class Limits:
    """The lattice's ends (inclusive) and the points every search starts with."""

    lo: int
    hi: int
    start: tuple[int, ...] = (-1, 0, 1)


RATE = Limits(-5, 5)  # the learning rate: ×1/32 .. ×32 of the setting's default
KNOB = Limits(-3, 3)  # the knob: ×1/8 .. ×8 of its default


@dataclass(frozen=True)
class Step:
    """What the search needs next: ``needed`` points to run or finish; when ``done``, the point
    ``chosen`` (None: no usable point) and the edges met (the table's words)."""

    needed: tuple[int, ...]
    chosen: int | None = None
    edges: tuple[str, ...] = ()
    done: bool = False


def factor(k: int) -> str:
    """``×2``, ``×1/4``, ``×1``: the lattice point's factor of the default."""
    return f"×{2 ** k}" if k >= 0 else f"×1/{2 ** -k}"


def lattice_k(value: float | None, default: float | None) -> int | None:
    """The ``k`` of ``value = default · 2**k`` where ``value`` is on the lattice (within
    :func:`same_value`'s tolerance), else None (an off-lattice point, such as the matched-KL
    search's ×2.4: not eligible)."""
    if value is None or default is None or value <= 0 or default <= 0:
        return None
    k = round(math.log2(value / default))
    return k if same_value(value, default * 2.0 ** k) else None


def usable(p: Point) -> bool:
    return p.complete and not p.diverged and not p.collapsed and p.score is not None


def bracket_step(points: Mapping[int, Point], lim: Limits) -> Step:
    """METHOD §6's bracketing rule, one decision: (1) the start points not complete are needed;
    (2) with no usable point, the point below the lowest tried is needed (or, at the limit, the
    search ends with no usable point); (3) the best usable point ``b`` by mean selection gold
    (ties: the default, then the nearest the default, then the lower); (4) each neighbour ``b ± 1``
    tried and complete is fine (an edge if it diverged or collapsed), beyond the limits is an edge,
    otherwise needed; (5) nothing needed: ``b`` is chosen."""
    pts = {k: p for k, p in points.items() if lim.lo <= k <= lim.hi}
    needed = tuple(k for k in lim.start if lim.lo <= k <= lim.hi and (k not in pts or not pts[k].complete))
    if needed:
        return Step(needed)
    ok = {k: p for k, p in pts.items() if usable(p)}
    if not ok:
        low = min(k for k, p in pts.items() if p.complete) - 1
        if low >= lim.lo:
            return Step((low,))
        return Step((), None, ("no usable point: every point tried diverged or collapsed",), True)
    b = _best(ok)
    edges, needed_ = [], []
    for n in (b - 1, b + 1):
        if not lim.lo <= n <= lim.hi:
            edges.append(f"edge: at the search's limit ({factor(b)})")
        elif n in pts and pts[n].complete:
            if pts[n].diverged:
                edges.append(f"edge: the next point ({factor(n)}) diverged")
            elif pts[n].collapsed:
                edges.append(f"edge: the next point ({factor(n)}) collapsed")
        else:
            needed_.append(n)
    if needed_:
        return Step(tuple(needed_))
    return Step((), b, tuple(edges), True)


def _best(ok: Mapping[int, Point]) -> int:
    return max(ok, key=lambda k: (ok[k].score, k == 0, -abs(k), -k))


def extra_at_most(points: Mapping[int, Point], lim: Limits) -> int:
    """``--plan``'s worst case: how many more points this coordinate may run before it is decided,
    the points needed now included (the best moves only to a newly added end, so the search
    extends one way: at most to the farther limit from the points tried so far)."""
    step = bracket_step(points, lim)
    if step.done:
        return 0
    pts = {k: p for k, p in points.items() if lim.lo <= k <= lim.hi}
    ok = {k: p for k, p in pts.items() if usable(p)}
    if ok and not set(lim.start) & set(step.needed):
        b = _best(ok)
        up, down = any(n > b for n in step.needed), any(n < b for n in step.needed)
        return (lim.hi - b if up else 0) + (b - lim.lo if down else 0) if not (up and down) else \
            1 + max(lim.hi - b, b - lim.lo)
    tried = {k for k, p in pts.items() if p.complete} | set(step.needed) | set(lim.start)
    return len(step.needed) + max(lim.hi - max(tried), min(tried) - lim.lo)
