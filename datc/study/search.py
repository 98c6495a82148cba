"""The bracketing search read from a study's selection runs (METHOD §6), for a manifest that holds
a ``"search"`` (a study made or continued by ``datc-study``); a manifest without one is the legacy
fixed grid ×0.5/×1/×2, read by :mod:`datc.study.reading` as it always was.

Per scheme: the rate's lattice points at the knob's default and, at the chosen rate, the knob's,
each a :class:`datc.study.bracket.Point` built from the candidates (finished selection runs) and
the runs that diverged (``diverged.json`` beside their ``run.json``, written by
:mod:`datc.study.job`); then :func:`datc.study.bracket.bracket_step` on each coordinate.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from datc.report.statistics import same_value
from datc.study.bracket import KNOB, RATE, Limits, Point, Step, bracket_step, factor, lattice_k

DIVERGED = "diverged.json"  # beside a selection run that stopped on a non-finite value (NonFiniteError)
SEARCH = {"rule": "bracket", "lr_exp": [RATE.lo, RATE.hi], "knob_exp": [KNOB.lo, KNOB.hi],
          "kl_tolerance": 0.05, "kl_max_rounds": 6}  # METHOD §6 as datc-study runs it (tuning.json's "search")
LEGACY = "fixed grid ×0.5/×1/×2, matched KL ±20% in 4 rounds"  # a manifest without "search"


def limits(manifest: Mapping[str, Any]) -> tuple[Limits, Limits] | None:
    """The rate's and the knob's lattice limits of a bracketing study; None for the legacy grid."""
    s = manifest.get("search")
    if not s:
        return None
    return Limits(int(s["lr_exp"][0]), int(s["lr_exp"][1])), Limits(int(s["knob_exp"][0]), int(s["knob_exp"][1]))


def diverged_runs(select: Path) -> list[dict[str, Any]]:
    """The selection runs that diverged: ``{"credit", "lr", "credit_fields", "seed"}`` from the
    ``run.json`` identity beside each ``diverged.json`` (else the coordinates it holds itself)."""
    out = []
    for path in sorted(select.glob(f"*/{DIVERGED}")):
        try:
            d = json.loads(path.read_text())
            ident = json.loads((path.parent / "run.json").read_text()).get("identity") if (path.parent / "run.json").is_file() else None
        except (OSError, ValueError):
            continue
        if isinstance(ident, dict):
            credit = dict(ident.get("credit") or {})
            d = {**d, "credit": credit.get("name"), "lr": (ident.get("trainer") or {}).get("lr"), "credit_fields": credit,
                 "seed": ident.get("seed")}
        if isinstance(d.get("lr"), (int, float)) and d.get("seed") is not None:
            out.append(d)
    return out


def _point(k: int, cand: Any, div_seeds: set[int], sel: Sequence[int]) -> Point:
    done = set(cand.seeds) if cand is not None else set()
    collapsed = cand is not None and bool(cand.collapsed) and 2 * len(cand.collapsed) >= len(cand.seeds)
    return Point(k, cand.score.mean if cand is not None and cand.seeds else None, set(sel) <= done | div_seeds,
                 bool(div_seeds & set(sel)), collapsed)


def points(spec: Mapping[str, Any], cands: Sequence[Any], diverged: Sequence[dict[str, Any]], sel: Sequence[int],
           lim: Limits, lr: float | None = None) -> dict[int, Point]:
    """One coordinate's lattice points: the rate at the knob's default (``lr`` None), or the knob
    at rate ``lr``. Off-lattice candidates (a matched-KL search's ×2.4) are left out."""
    field = str(spec["knob"]).removeprefix("credit.") if spec.get("knob") else None
    kd = spec.get("knob_default")
    found: dict[int, tuple[Any, set[int]]] = {}

    def place(x_lr: float, x_knob: float | None) -> int | None:
        if lr is None:
            return lattice_k(x_lr, float(spec["lr"])) if same_value(x_knob, kd) else None
        return lattice_k(x_knob, kd) if same_value(x_lr, lr) else None

    for c in cands:
        if (k := place(c.lr, c.knob)) is not None and lim.lo <= k <= lim.hi:
            found.setdefault(k, (c, set()))
    for d in diverged:
        knob = d.get("credit_fields", {}).get(field) if field else None
        if (k := place(float(d["lr"]), None if knob is None else float(knob))) is not None and lim.lo <= k <= lim.hi:
            found.setdefault(k, (None, set()))[1].add(int(d["seed"]))
    return {k: _point(k, c, s, sel) for k, (c, s) in found.items()}


def bracket_search(spec: Mapping[str, Any], cands: Sequence[Any], diverged: Sequence[dict[str, Any]], sel: Sequence[int],
                   lims: tuple[Limits, Limits]) -> tuple[float | None, float | None, Step, Step | None]:
    """METHOD §6's coordinate search with bracketing: the rate (at the knob's default), then the
    knob at that rate. Returns the chosen rate and knob (None while undecided or where no point
    was usable) and each coordinate's :class:`Step` (the knob's None while the rate is undecided)."""
    rate = bracket_step(points(spec, cands, diverged, sel, lims[0]), lims[0])
    if not rate.done or rate.chosen is None:
        return None, None, rate, None
    lr = float(spec["lr"]) * 2.0 ** rate.chosen
    if not spec.get("knob"):
        return lr, None, rate, None
    knob = bracket_step(points(spec, cands, diverged, sel, lims[1], lr), lims[1])
    chosen = float(spec["knob_default"]) * 2.0 ** knob.chosen if knob.done and knob.chosen is not None else None
    return lr, chosen, rate, knob


def on_path(spec: Mapping[str, Any], lims: tuple[Limits, Limits], lr_chosen: float | None, lr: float, knob: float | None) -> bool:
    """Whether a selection run lies on the bracketing search: a rate lattice point at the knob's
    default, or a knob lattice point at the chosen rate."""
    k = lattice_k(lr, float(spec["lr"]))
    if k is not None and lims[0].lo <= k <= lims[0].hi and same_value(knob, spec.get("knob_default")):
        return True
    kk = lattice_k(knob, spec.get("knob_default")) if spec.get("knob") else None
    return lr_chosen is not None and same_value(lr, lr_chosen) and kk is not None and lims[1].lo <= kk <= lims[1].hi


def step_text(pts: Mapping[int, Point] | None, step: Step | None) -> str:
    """The table's words for one coordinate: the points tried and how the search ended."""
    if step is None:
        return "n/a"
    tried = sorted(k for k, p in (pts or {}).items() if p.complete)
    head = f"{len(tried)}: " + ", ".join(factor(k) for k in tried)
    if not step.done:
        return head + "; needs " + ", ".join(factor(k) for k in step.needed)
    return head + "; " + ("; ".join(step.edges) if step.edges else "bracketed")
