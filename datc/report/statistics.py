"""Statistics over seeds: Student-t intervals, paired differences to the baseline, gold-curve
bands, and the :class:`Report` every output is made from."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from datc.report.loading import METRICS, Run

CONFIDENCE = 0.95
TREATMENT = "datc"
PAIRED_METRICS = ("final_gold", "gold_auc")


def same_value(a: float | None, b: float | None) -> bool:
    """Two config values (a learning rate, a knob) are the same: both None, or equal to rounding."""
    return (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9))


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values and the half-width of its 95% Student-t interval (``None`` when
    n < 2; the mean is ``None`` when n = 0)."""

    mean: float | None
    half_width: float | None
    n: int

    @property
    def excludes_zero(self) -> bool:
        return (
            self.mean is not None
            and self.half_width is not None
            and abs(self.mean) > self.half_width
        )


@dataclass(frozen=True)
class PairedDifference:
    """Scheme minus baseline over the seeds where both have the value."""

    diff: Interval
    seeds: tuple[int, ...]

    @property
    def significant(self) -> bool:
        return self.diff.excludes_zero


@dataclass(frozen=True)
class Row:
    """The aggregate of one (setting, scheme). ``cells`` maps each :data:`METRICS` key to its
    interval over seeds; ``vs_baseline`` maps each :data:`PAIRED_METRICS` key to the paired
    difference, and is empty for the baseline itself or when the setting has no baseline run."""

    data: str
    policy: str
    scheme: str
    n_runs: int
    seeds: tuple[int, ...]
    cells: dict[str, Interval]
    vs_baseline: dict[str, PairedDifference]
    collapsed: tuple[int | str, ...] = ()  # seeds (run names where a seed is unknown) of its length-collapsed runs (METHOD §6)

    @property
    def setting(self) -> str:
        return f"{self.data} / {self.policy}"


@dataclass(frozen=True)
class Verdict:
    """Whether a scheme beat the baseline, lost to it, or neither is resolved, on final gold in one setting. ``diff`` is ``None`` when
    one of the two schemes has no run there; ``diff.seeds`` is empty when they share no seed."""

    setting: str
    treatment: str
    baseline: str
    has_treatment: bool
    has_baseline: bool
    diff: PairedDifference | None

    @property
    def sentence(self) -> str:
        t, b = self.treatment.upper(), self.baseline.upper()
        if self.diff is None:
            missing = [s for s, ok in ((t, self.has_treatment), (b, self.has_baseline)) if not ok]
            verb = "is" if len(missing) == 1 else "are"
            return (
                f"On {self.setting}, {' and '.join(missing)} {verb} missing, "
                f"so {t} and {b} cannot be compared."
            )
        d = self.diff.diff
        if d.mean is None:
            return (
                f"On {self.setting}, {t} and {b} share no seed with a final gold value, "
                "so no paired comparison is possible."
            )
        hw = "n/a" if d.half_width is None else f"{d.half_width:.3f}"
        pairs = f"{d.n} shared seed{'s' if d.n != 1 else ''}"
        if not self.diff.significant:  # "beat" or "lost to" only where the interval excludes zero
            why = "one pair gives no interval" if d.half_width is None else f"95% t-interval over {pairs}"
            return (
                f"On {self.setting}, the difference between {t} and {b} on final held-out gold is not resolved: "
                f"paired difference {d.mean:+.3f} ± {hw} ({why}; the interval does not exclude zero)."
            )
        verb = "beat" if d.mean > 0 else "lost to"
        return (
            f"On {self.setting}, {t} {verb} {b} on final held-out gold: paired difference "
            f"{d.mean:+.3f} ± {hw} (95% t-interval over {pairs}; it excludes zero)."
        )


@dataclass(frozen=True)
class CurveBand:
    """Held-out gold of one (setting, scheme) by step over seeds; arrays of shape (n_steps,).
    ``half_width`` is NaN at steps evaluated by fewer than 2 seeds."""

    steps: np.ndarray
    mean: np.ndarray
    half_width: np.ndarray
    n: np.ndarray


@dataclass(frozen=True)
class Report:
    """Everything the outputs are made from: the (deduplicated) runs and their aggregates,
    rows ordered by setting, then baseline, DATC, other schemes alphabetically."""

    baseline: str
    runs: list[Run]
    rows: list[Row]
    verdicts: list[Verdict]

    @property
    def settings(self) -> list[str]:
        return list(dict.fromkeys(r.setting for r in self.rows))

    @property
    def schemes(self) -> list[str]:
        return _scheme_order({r.scheme for r in self.rows}, self.baseline)



def t_interval(values: Iterable[float | None]) -> Interval:
    """Mean and 95% Student-t half-width of the values that are not ``None``."""
    xs = np.array([v for v in values if v is not None], dtype=float)
    if len(xs) == 0:
        return Interval(None, None, 0)
    if len(xs) == 1:
        return Interval(float(xs[0]), None, 1)
    t = stats.t.ppf(0.5 + CONFIDENCE / 2, len(xs) - 1)
    return Interval(float(xs.mean()), float(t * xs.std(ddof=1) / math.sqrt(len(xs))), len(xs))


def detectable_difference(iv: Interval, power: float = 0.8) -> float | None:
    """The smallest true mean difference that a two-sided 95% t-test on these paired differences
    would detect with probability ``power``, at their number ``n`` and observed standard
    deviation ``s``: ``(t_{0.975, n-1} + t_{power, n-1}) · s / √n`` (the usual planning formula
    for a one-sample t-test, central-t approximation; e.g. Cohen, *Statistical Power Analysis*,
    ch. 2). ``None`` below 2 values."""
    if iv.half_width is None or iv.n < 2:
        return None
    t_a = stats.t.ppf(0.5 + CONFIDENCE / 2, iv.n - 1)
    return float(iv.half_width * (t_a + stats.t.ppf(power, iv.n - 1)) / t_a)


def paired_difference(
    runs: Sequence[Run], baseline_runs: Sequence[Run], key: str
) -> PairedDifference:
    """``key`` of ``runs`` minus that of ``baseline_runs``, paired by seed."""

    def by_seed(rs: Sequence[Run]) -> dict[int, float]:
        return {r.seed: v for r in rs if r.seed is not None and (v := r.value(key)) is not None}

    a, b = by_seed(runs), by_seed(baseline_runs)
    seeds = tuple(sorted(a.keys() & b.keys()))
    return PairedDifference(t_interval(a[s] - b[s] for s in seeds), seeds)


def curve_band(runs: Sequence[Run]) -> CurveBand | None:
    """Mean gold curve over ``runs`` at every step any of them evaluated; ``None`` if none did."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for p in run.curve:
            by_step.setdefault(p.step, []).append(p.gold)
    if not by_step:
        return None
    steps = sorted(by_step)
    ivs = [t_interval(by_step[s]) for s in steps]
    return CurveBand(
        steps=np.array(steps),
        mean=np.array([iv.mean for iv in ivs], dtype=float),
        half_width=np.array([np.nan if iv.half_width is None else iv.half_width for iv in ivs]),
        n=np.array([iv.n for iv in ivs]),
    )


def _scheme_order(schemes: Iterable[str], baseline: str) -> list[str]:
    first = [s for s in (baseline, TREATMENT) if s in schemes]
    return first + sorted(set(schemes) - set(first))


def group_runs(runs: Iterable[Run]) -> dict[tuple[str, str, str], list[Run]]:
    """Runs by (data, policy with its variant, credit), each list sorted by seed."""
    out: dict[tuple[str, str, str], list[Run]] = {}
    for run in runs:
        out.setdefault((run.data, run.policy_label, run.credit), []).append(run)
    return {
        k: sorted(v, key=lambda r: (r.seed is None, r.seed or 0, r.run_name))
        for k, v in out.items()
    }


def collapsed_seeds(runs: Iterable[Run]) -> tuple[int | str, ...]:
    """The seeds (run names where a seed is unknown) of ``runs`` that collapsed in length."""
    return tuple(r.seed if r.seed is not None else r.run_name for r in runs if r.collapse_step is not None)


def build_report(runs: Sequence[Run], baseline: str = "grpo") -> Report:
    """Aggregate ``runs`` (one per setting, scheme and seed) into table rows and verdicts."""
    groups = group_runs(runs)
    rows, verdicts = [], []
    for data, policy in sorted({(d, p) for d, p, _ in groups}):
        present = {c for d, p, c in groups if (d, p) == (data, policy)}
        base = groups.get((data, policy, baseline))
        for scheme in _scheme_order(present, baseline):
            rs = groups[(data, policy, scheme)]
            vs = (
                {}
                if base is None or scheme == baseline
                else {k: paired_difference(rs, base, k) for k in PAIRED_METRICS}
            )
            rows.append(
                Row(
                    data=data,
                    policy=policy,
                    scheme=scheme,
                    n_runs=len(rs),
                    seeds=tuple(r.seed for r in rs if r.seed is not None),
                    cells={m.key: t_interval(r.value(m.key) for r in rs) for m in METRICS},
                    vs_baseline=vs,
                    collapsed=collapsed_seeds(rs),
                )
            )
        # every scheme against the baseline (DATC first where it ran); a setting where only the
        # baseline ran says that DATC, the method under test, is missing
        treatments = [s for s in _scheme_order(present, baseline) if s != baseline] or [TREATMENT]
        for scheme in treatments:
            treat = groups.get((data, policy, scheme))
            verdicts.append(
                Verdict(
                    setting=f"{data} / {policy}",
                    treatment=scheme,
                    baseline=baseline,
                    has_treatment=treat is not None,
                    has_baseline=base is not None,
                    diff=paired_difference(treat, base, "final_gold") if treat and base else None,
                )
            )
    return Report(baseline, list(runs), rows, verdicts)

