"""METHOD §6's matched-KL control: GRPO at the learning rate whose final ``KL(π‖π_ref)`` is within
±5% of a scheme's (±20% in a study made before ``datc-study``: its manifest has no ``"search"``), so that a gain over GRPO can be told apart from a larger step.

For every scheme whose tuned gain over tuned GRPO is resolved (the paired interval on the
evaluation seeds excludes zero and the gain is positive), and for any scheme the study was asked to
control whatever its result (``datc-study --stage kl --kl-schemes``: a loss at equal tuning may be a
smaller step, not worse credit; the schemes are kept in ``matched.json``'s ``"requested"``), the *target* is the mean final KL of the
scheme's chosen configuration on the **selection** seeds. GRPO's learning rate is searched on the
same selection seeds (``datc-study --stage kl``: :func:`datc.study.kl_search.kl_step` from GRPO's finished
selection points, a few rounds at most, each round's rates in ``matched.json``), and the rate whose
mean selection KL is within the tolerance of the target (:func:`matched_lr`) is run on the evaluation seeds
into the setting's ``matched/`` folder. ``datc-compare --tuned`` reports, per such scheme, the gain
at equal tuning beside the gain against GRPO at matched KL, and both KLs on the evaluation seeds:
nothing of the search looks at an evaluation run's gold.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datc.report.loading import Run
from datc.report.statistics import Interval, PairedDifference, paired_difference, t_interval
from datc.report.statistics import same_value as _same
from datc.study.errors import TuningError
from datc.study.kl_search import credit_share

TOLERANCE = 0.2  # |KL_grpo / KL_scheme - 1| at most this on the selection seeds: matched
MAX_ROUNDS = 4  # search rounds per scheme (each: GRPO at one new rate on the selection seeds)
MAX_MOVE = 4.0  # one proposal moves the rate at most this factor from the nearest tried rate
MIN_SLOPE = 0.5  # d log KL / d log lr assumed at least this when extrapolating
MATCHED_DIR = "matched"  # GRPO's evaluation runs at the matched rates
SEARCH_FILE = "matched.json"  # the search's targets and the rates tried per scheme


def _round(x: float) -> float:
    return float(f"{x:.3g}")


def within(kl: float, target: float, tol: float = TOLERANCE) -> bool:
    return target > 0 and abs(kl / target - 1.0) <= tol


def matched_lr(points: Sequence[tuple[float, float]], target: float, tol: float = TOLERANCE) -> float | None:
    """The learning rate among ``points`` (lr, mean final KL) whose KL is within ``tol`` of
    ``target``, the nearest in ``|log(KL / target)|`` where several are; None if none is."""
    ok = [(abs(math.log(kl / target)), lr) for lr, kl in points if kl > 0 and within(kl, target, tol)]
    return min(ok)[1] if ok else None


def propose_lr(points: Sequence[tuple[float, float]], target: float) -> float:
    """The next learning rate to try for a final KL of ``target`` from the finished ``points``
    (lr, mean final KL > 0): log-log interpolation between the two neighbouring rates whose KLs
    bracket the target (the lowest such pair); else extrapolation from the point of the largest KL
    (a larger target) or the smallest (a smaller one), along the slope to its neighbouring rate taken
    positive and at least :data:`MIN_SLOPE` (1 with a single point), the move at most ×:data:`MAX_MOVE`;
    rounded to 3 significant digits."""
    pts = sorted((float(lr), float(kl)) for lr, kl in points if kl > 0 and lr > 0)
    if not pts:
        raise ValueError("propose_lr: no finished point with a positive learning rate and KL")
    lt = math.log(target)
    for (l0, k0), (l1, k1) in zip(pts, pts[1:], strict=False):
        if min(k0, k1) <= target <= max(k0, k1) and k0 != k1:
            f = (lt - math.log(k0)) / (math.log(k1) - math.log(k0))
            return _round(math.exp(math.log(l0) + f * (math.log(l1) - math.log(l0))))
    i = max(range(len(pts)), key=lambda j: (pts[j][1], pts[j][0])) if target > max(k for _, k in pts) else \
        min(range(len(pts)), key=lambda j: (pts[j][1], pts[j][0]))  # ties: the highest rate up, the lowest down
    j = i + 1 if i + 1 < len(pts) else i - 1  # the anchor's neighbour, for the slope
    slope = 1.0 if j < 0 else (math.log(pts[j][1]) - math.log(pts[i][1])) / (math.log(pts[j][0]) - math.log(pts[i][0]))
    slope = max(abs(slope), MIN_SLOPE)  # KL taken to grow with the rate: up for a larger target, down for a smaller
    move = max(-math.log(MAX_MOVE), min(math.log(MAX_MOVE), (lt - math.log(pts[i][1])) / slope))
    lb = pts[i][0]
    return _round(lb * math.exp(move))


def resolved_gain(runs: Sequence[Run], base: Sequence[Run]) -> PairedDifference | None:
    """The paired final-gold difference where it is a resolved gain (interval above zero), else None."""
    pd = paired_difference(runs, base, "final_gold")
    return pd if pd.significant and pd.diff.mean is not None and pd.diff.mean > 0 else None


@dataclass(frozen=True)
class MatchedRow:
    """One scheme's matched-KL control in one setting."""

    scheme: str
    gain: PairedDifference  # tuned scheme minus tuned baseline (equal tuning), evaluation seeds
    target_kl: float  # the scheme's chosen configuration, mean final KL, selection seeds
    tried: tuple[tuple[float, float], ...]  # the baseline's selection points (lr, mean final KL)
    lr: float | None  # the matched baseline rate (None: not found)
    matched: tuple[Run, ...]  # the baseline's evaluation runs at ``lr``
    vs_matched: PairedDifference | None  # tuned scheme minus the matched baseline, evaluation seeds
    kl_scheme: Interval  # final KL of the scheme's tuned evaluation runs
    kl_matched: Interval  # final KL of the matched baseline's evaluation runs
    tol: float = TOLERANCE  # the manifest's: ±5% for a bracketing study (METHOD §6), ±20% before it
    bracket: bool = False  # a study made or continued by datc-study: the ratio and the credit share stated
    resolved: bool = True  # the gain at equal tuning is resolved (False: a control asked for by name)

    @property
    def ratio(self) -> float | None:
        """The baseline's selection KL at the matched rate over the target."""
        kl = next((kl for lr, kl in self.tried if self.lr is not None and _same(lr, self.lr)), None)
        return None if kl is None else kl / self.target_kl

    @property
    def credit_share(self) -> float | None:
        """METHOD §6: the gain at matched KL over the gain at equal tuning (None where that gain is
        not resolved: the share of a loss or of noise says nothing)."""
        d = self.vs_matched
        if not self.resolved:
            return None
        return credit_share(None if d is None or not d.seeds else d.diff.mean, self.gain.diff.mean)


def matched_rows(st: Any, baseline: str, matched: Sequence[tuple[float, Run]],
                 requested: Collection[str] = ()) -> list[MatchedRow]:
    """The control for every scheme of ``st`` (a :class:`datc.study.reading.SettingTuning`) whose
    tuned gain over the tuned baseline is resolved, and for the ``requested`` ones whatever their
    difference (``resolved`` False unless it is a resolved gain too)."""
    base = st.schemes.get(baseline)
    if base is None or not base.tuned:
        return []
    n_sel = len(st.manifest["selection"]["seeds"])
    search = st.manifest.get("search")
    tol = float(search["kl_tolerance"]) if search else TOLERANCE
    points = tuple((c.lr, c.kl.mean) for c in base.candidates
                   if _same(c.knob, base.spec.get("knob_default")) and len(c.seeds) >= n_sel and c.kl.mean is not None and c.kl.mean > 0)
    rows = []
    for name, sc in sorted(st.schemes.items()):
        if name == baseline or sc.chosen is None or sc.chosen.kl.mean is None or not sc.tuned:
            continue
        gain = resolved_gain(sc.tuned, base.tuned)
        resolved = gain is not None
        if gain is None and name in requested:
            gain = paired_difference(sc.tuned, base.tuned, "final_gold")
        if gain is None or not gain.seeds:
            continue
        target = sc.chosen.kl.mean
        lr = matched_lr(points, target, tol)
        runs = tuple(r for x, r in matched if r.credit == baseline and lr is not None and _same(x, lr)) or \
            tuple(evaluated_at(base, lr))
        rows.append(MatchedRow(name, gain, target, points, lr, runs,
                               paired_difference(sc.tuned, runs, "final_gold") if runs else None,
                               t_interval(r.final_kl for r in sc.tuned), t_interval(r.final_kl for r in runs), tol, bool(search),
                               resolved))
    return rows


def evaluated_at(base: Any, lr: float | None) -> list[Run]:
    """The baseline's evaluation runs of the tuned comparison at rate ``lr``, if it is its chosen or
    its default rate (no second run of the same configuration into ``matched/``)."""
    if lr is not None and base.lr is not None and _same(lr, base.lr):
        return list(base.tuned)
    return list(base.default) if lr is not None and _same(lr, float(base.spec["lr"])) else []


def verdict(row: MatchedRow) -> str:
    if row.lr is None:
        return "no matched rate found yet"
    d = row.vs_matched
    if d is None or not d.seeds:
        return "matched rate not evaluated yet"
    off = "" if _kl_within(row) else f" (the evaluation seeds' KLs are not within ±{row.tol:.0%})"
    if not row.resolved:  # a control asked for by name: no gain at equal tuning to explain
        if d.significant:
            return ("above GRPO at matched KL" if d.diff.mean > 0 else "below GRPO at matched KL") + off
        return "not resolved at matched KL" + off
    if d.significant:
        return ("credit: the gain holds at matched KL" if d.diff.mean > 0 else "below GRPO at matched KL") + off
    return "step size: the gain is not resolved at matched KL" + off


def _kl_within(row: MatchedRow) -> bool:
    a, b = row.kl_scheme.mean, row.kl_matched.mean
    return a is None or b is None or within(b, a, row.tol)


def matched_markdown(rows: Sequence[MatchedRow], baseline: str, default_lr: float) -> str:
    from datc.report.tables import _interval_text

    if not rows:
        return ""
    bracket = rows[0].bracket
    lines = [
        f"Matched-KL control (METHOD §6): {baseline} at the learning rate whose mean final KL on the selection seeds is "
        f"within ±{rows[0].tol:.0%} of the scheme's chosen configuration's, evaluated on the evaluation seeds."
        + (" Credit share: the gain at matched KL over the gain at equal tuning." if bracket else ""), "",
        f"| scheme | Δ vs tuned {baseline} | its KL (selection) | matched {baseline} rate | {baseline}'s KL there (selection) "
        f"| KL, evaluation: scheme / matched {baseline} | Δ vs matched {baseline} | reading | rates tried (lr: KL) |"
        + (" credit share |" if bracket else ""),
        "|" + "---|" * (10 if bracket else 9),
    ]
    for r in rows:
        kl_there = next((kl for lr, kl in r.tried if r.lr is not None and _same(lr, r.lr)), None)
        d = r.vs_matched
        d_text = "n/a" if d is None or not d.seeds else _interval_text(d.diff, len(r.matched), signed=True)
        if d is not None and d.seeds and d.significant:
            d_text = f"**{d_text}**"
        ev = "n/a" if r.kl_scheme.mean is None or r.kl_matched.mean is None else \
            f"{r.kl_scheme.mean:.3f} / {r.kl_matched.mean:.3f} (ratio {r.kl_matched.mean / r.kl_scheme.mean:.2f})"
        gain = _interval_text(r.gain.diff, r.gain.diff.n, signed=True)
        lines.append("| " + " | ".join([
            r.scheme, f"**{gain}**" if r.gain.significant else gain, f"{r.target_kl:.3f}",
            "not found" if r.lr is None else f"{r.lr:g} (×{r.lr / default_lr:.3g})",
            "n/a" if kl_there is None else f"{kl_there:.3f} (ratio {kl_there / r.target_kl:.2f})", ev, d_text, verdict(r),
            ", ".join(f"{lr:g}: {kl:.3f}" for lr, kl in r.tried),
            *([] if not bracket else ["n/a" if r.credit_share is None else f"{r.credit_share:.2f}"])]) + " |")
    return "\n".join(lines) + "\n"


def matched_json(rows: Sequence[MatchedRow]) -> list[dict[str, Any]]:
    def iv(x: Interval) -> dict[str, Any]:
        return {"mean": x.mean, "half_width": x.half_width, "n": x.n}

    return [{"scheme": r.scheme, "gain": iv(r.gain.diff), "target_kl": r.target_kl, "tried": [list(p) for p in r.tried],
             "lr": r.lr, "matched_runs": [m.run_name for m in r.matched],
             "vs_matched": None if r.vs_matched is None else {**iv(r.vs_matched.diff), "seeds": list(r.vs_matched.seeds)},
             "kl_scheme": iv(r.kl_scheme), "kl_matched": iv(r.kl_matched), "reading": verdict(r), "resolved": r.resolved,
             **({"ratio": r.ratio, "credit_share": r.credit_share, "tolerance": r.tol} if r.bracket else {})} for r in rows]


def read_search(folder: Path) -> dict[str, Any]:
    """The matched-KL search's log (``matched.json``), ``{}`` without one; one that is not what
    :func:`write_search` writes (garbage, a list) is refused in one line (:class:`TuningError`)."""
    path = folder / SEARCH_FILE
    try:
        search = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise TuningError(f"{path}: unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); it is "
                          "the matched-KL search's log: move it aside to run the search again") from None
    if not isinstance(search, dict):
        raise TuningError(f"{path}: not the matched-KL search's log (a JSON {type(search).__name__}, not an object); "
                          "move it aside to run the search again")
    return search


def write_search(folder: Path, search: Mapping[str, Any]) -> None:
    from datc.atomic import atomic_write_json

    atomic_write_json(folder / SEARCH_FILE, dict(search))
