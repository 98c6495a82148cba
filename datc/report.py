"""Compare finished runs across settings and credit schemes: tables, a summary, plots.

Runs come from the ``summary.json`` files the trainer writes (found by ``**/summary.json`` under
one or more root directories) and, optionally, from a W&B project. A *setting* is the pair
``(data, policy)``, a *scheme* is ``credit``; runs of one scheme in one setting with different
seeds are replicates. Written under ``--out``:

- ``table.md``, ``table.tex``: one row per (setting, scheme) with final held-out gold, gold
  AUC, final RM score, final KL, credit accuracy, step time and the number of seeds, plus the
  paired difference to the baseline for final gold and gold AUC (bold where significant).
- ``summary.md``: one sentence per setting on whether DATC beat the baseline on final gold.
- ``gold_curves.png``, ``credit_accuracy.png``, ``rm_vs_gold.png``.
- ``runs.csv``: one row per run with the fields used; ``report.json``: every number computed.

Statistics: a cell is the mean over seeds ± the half-width of the 95% Student-t interval,
``t.ppf(0.975, n-1) * sd(ddof=1) / sqrt(n)``, undefined for n = 1. The comparison with the
baseline pairs runs by seed (seeds where both runs have the value) and gives the mean of the
per-seed differences (scheme minus baseline) with its own t interval; it is *significant*
when that interval excludes zero.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from scipy import stats

from datc.atomic import atomic_write_bytes

CONFIDENCE = 0.95
TREATMENT = "datc"
# Schemes with constant token weights: credit accuracy (a rank correlation of the weights with
# gold contributions) is undefined for them, so it is shown as n/a whatever was logged.
UNIFORM_CREDIT = frozenset({"grpo"})
UNKNOWN = "unknown"
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


@dataclass(frozen=True)
class Metric:
    """One per-run number reported in the table: ``key`` is the :class:`Run` attribute."""

    key: str
    label: str


METRICS = (
    Metric("final_gold", "final gold"),
    Metric("gold_auc", "gold AUC"),
    Metric("final_rm_score", "final RM score"),
    Metric("final_kl", "final KL"),
    Metric("credit_accuracy", "credit accuracy"),
    Metric("step_s", "step time (s)"),
)
PAIRED_METRICS = ("final_gold", "gold_auc")


@dataclass(frozen=True)
class CurvePoint:
    """One evaluation of held-out gold reward during training."""

    step: int
    gold: float


@dataclass(frozen=True)
class Run:
    """One training run, flattened to the fields the report uses. Numbers are ``None`` when the
    run did not record them (missing, null or non-finite)."""

    run_name: str
    run_id: str | None
    data: str
    policy: str
    credit: str
    seed: int | None
    steps: int | None
    final_gold: float | None  # eval.final["eval/gold"]
    gold_auc: float | None  # eval.gold_auc: time-averaged gold over the eval curve
    final_rm_score: float | None  # eval.final["eval/rm_score"]
    final_kl: float | None  # eval.final["eval/kl"]: k3 estimate vs the reference, nats/token
    credit_accuracy: float | None  # train_mean["credit/accuracy"], Spearman rho in [-1, 1]
    step_s: float | None  # train_mean["perf/step_s"], seconds per optimizer step
    wall_time_s: float | None
    git_commit: str | None
    curve: tuple[CurvePoint, ...]  # sorted by step
    source: str  # the summary.json path or the W&B run path
    mtime: float  # seconds since the epoch; the newest of duplicate runs is kept

    @property
    def setting(self) -> str:
        return f"{self.data} / {self.policy}"

    def value(self, key: str) -> float | None:
        return getattr(self, key)


CSV_FIELDS = (
    "run_name",
    "run_id",
    "data",
    "policy",
    "credit",
    "seed",
    "steps",
    *(m.key for m in METRICS),
    "wall_time_s",
    "git_commit",
    "source",
)


@dataclass(frozen=True)
class LoadResult:
    """Runs read from some source, and the problems met on the way (one line each)."""

    runs: list[Run]
    warnings: list[str] = field(default_factory=list)


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

    @property
    def setting(self) -> str:
        return f"{self.data} / {self.policy}"


@dataclass(frozen=True)
class Verdict:
    """Whether DATC beat the baseline on final gold in one setting. ``diff`` is ``None`` when
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
        verb = "beat" if d.mean > 0 else "did not beat"
        if d.half_width is None:
            detail = "one shared seed, no interval; not significant at 95%"
        else:
            sig = "significant" if self.diff.significant else "not significant"
            detail = f"95% t-interval over {d.n} shared seeds; {sig} at 95%"
        hw = "n/a" if d.half_width is None else f"{d.half_width:.3f}"
        return (
            f"On {self.setting}, {t} {verb} {b} on final held-out gold: paired difference "
            f"{d.mean:+.3f} ± {hw} ({detail})."
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


# ---------------------------------------------------------------- reading runs


def _num(x: Any) -> float | None:
    # The trainer's logger writes non-finite floats as null or as strings such as "inf".
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _int(x: Any) -> int | None:
    v = _num(x)
    return int(v) if v is not None and v == int(v) else None


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _str(x: Any) -> str | None:
    return str(x) if isinstance(x, (str, int)) and not isinstance(x, bool) and str(x) else None


def run_from_summary(summary: Any, source: str, mtime: float, default_name: str) -> Run:
    """Flatten one ``summary.json`` dict (any key may be missing or null) into a :class:`Run`.
    ``default_name`` names a run whose summary has no ``run_name`` (e.g. its directory)."""
    s = _dict(summary)
    ev = _dict(s.get("eval"))
    final = _dict(ev.get("final"))
    train = _dict(s.get("train_mean"))
    credit = _str(s.get("credit")) or UNKNOWN
    raw_curve = ev.get("curve")
    points = [_dict(p) for p in raw_curve] if isinstance(raw_curve, list) else []
    curve = sorted(
        (
            CurvePoint(step, gold)
            for p in points
            if (step := _int(p.get("step"))) is not None
            and (gold := _num(p.get("gold"))) is not None
        ),
        key=lambda p: p.step,
    )
    return Run(
        run_name=_str(s.get("run_name")) or default_name,
        run_id=_str(s.get("run_id")),
        data=_str(s.get("data")) or UNKNOWN,
        policy=_str(s.get("policy")) or UNKNOWN,
        credit=credit,
        seed=_int(s.get("seed")),
        steps=_int(s.get("steps")),
        final_gold=_num(final.get("eval/gold")),
        gold_auc=_num(ev.get("gold_auc")),
        final_rm_score=_num(final.get("eval/rm_score")),
        final_kl=_num(final.get("eval/kl")),
        credit_accuracy=None if credit in UNIFORM_CREDIT else _num(train.get("credit/accuracy")),
        step_s=_num(train.get("perf/step_s")),
        wall_time_s=_num(s.get("wall_time_s")),
        git_commit=_str(s.get("git_commit")),
        curve=tuple(curve),
        source=source,
        mtime=mtime,
    )


def load_run_dirs(roots: Sequence[str | Path]) -> LoadResult:
    """Every ``summary.json`` found recursively under ``roots`` (a file found under two
    overlapping roots is read once). Unreadable files and missing roots are warned about."""
    runs: list[Run] = []
    warns: list[str] = []
    seen: set[Path] = set()
    for root in map(Path, roots):
        if not root.is_dir():
            warns.append(f"{root}: not a directory, skipped")
            continue
        for path in sorted(root.glob("**/summary.json")):
            if path.resolve() in seen:
                continue
            seen.add(path.resolve())
            try:
                summary = json.loads(path.read_text())
                mtime = path.stat().st_mtime
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                warns.append(f"{path}: unreadable ({type(e).__name__}: {e}), skipped")
                continue
            runs.append(run_from_summary(summary, str(path), mtime, path.parent.name))
    return LoadResult(runs, warns)


def gold_auc(points: Sequence[tuple[int, float]]) -> float | None:
    """Area under the gold curve by the trapezoid rule over steps, divided by the step span: the
    time-averaged gold (gold units), as the trainer computes it. ``points``: (step, gold) pairs
    sorted by step; ``None`` with fewer than 2 points or a zero span."""
    if len(points) < 2 or points[-1][0] == points[0][0]:
        return None
    area = sum(
        (s1 - s0) * (g0 + g1) / 2 for (s0, g0), (s1, g1) in zip(points, points[1:], strict=False)
    )
    return area / (points[-1][0] - points[0][0])


def summary_from_wandb(run: Any, history: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The ``summary.json`` shape of a run read through ``wandb.Api().runs(project)``.

    ``run`` needs ``.summary`` and ``.config`` (mapping-like; ``config`` is the resolved training
    config the logger gave to ``wandb.init``), ``.name`` and ``.id``. Mapping:

    - ``run_name`` <- ``run.name``, ``run_id`` <- ``run.id``, ``seed`` <- ``config["seed"]``,
      ``steps`` <- ``config["trainer"]["steps"]``, ``wall_time_s`` <- ``summary["_runtime"]``;
    - ``credit``, ``data``, ``policy`` <- ``config[group]["name"]`` for each group;
    - ``eval.final[k]`` <- ``summary[k]`` for keys ``eval/*`` (the final evaluation: the logger
      writes it into the summary when the run finishes);
    - ``train_mean[k]`` <- ``summary[k]`` for keys ``perf/*`` and ``credit/*``. W&B keeps the
      *last logged* value there, not the mean over training that ``summary.json`` holds;
    - ``eval.curve`` <- the ``history`` rows that hold ``eval/rm_score`` (``step`` <- ``_step``),
      and ``eval.gold_auc`` <- :func:`gold_auc` of that curve.
    """
    summary, config = run.summary, _dict(run.config)
    keys = [k for k in summary.keys() if isinstance(k, str)]
    curve = [
        {
            "step": row.get("_step"),
            "gold": row.get("eval/gold"),
            "rm_score": row.get("eval/rm_score"),
        }
        for row in history
        if "eval/rm_score" in row
    ]
    curve.sort(key=lambda p: _num(p["step"]) or 0.0)
    points = [
        (p["step"], g)
        for p in curve
        if _int(p["step"]) is not None and (g := _num(p["gold"])) is not None
    ]
    return {
        "run_name": run.name,
        "run_id": run.id,
        "seed": config.get("seed"),
        "credit": _dict(config.get("credit")).get("name"),
        "data": _dict(config.get("data")).get("name"),
        "policy": _dict(config.get("policy")).get("name"),
        "steps": _dict(config.get("trainer")).get("steps"),
        "wall_time_s": summary.get("_runtime"),
        "eval": {
            "final": {k: summary.get(k) for k in keys if k.startswith("eval/")},
            "curve": curve,
            "gold_auc": gold_auc(points),
        },
        "train_mean": {k: summary.get(k) for k in keys if k.startswith(("perf/", "credit/"))},
    }


def load_wandb(project: str) -> LoadResult:
    """Every run of the W&B project ``ENTITY/PROJECT`` (needs network and credentials), mapped
    by :func:`summary_from_wandb`; a run's time for deduplication is its last log time."""
    import wandb  # only this path needs it, and it is slow to import

    runs = []
    for r in wandb.Api().runs(project):
        summary = summary_from_wandb(r, r.scan_history(keys=["eval/rm_score"]))
        mtime = _num(r.summary.get("_timestamp")) or 0.0
        runs.append(run_from_summary(summary, f"wandb:{project}/{r.id}", mtime, str(r.id)))
    return LoadResult(runs)


def deduplicate(runs: Iterable[Run]) -> LoadResult:
    """One run per (data, policy, credit, seed), the one with the newest ``mtime``; each
    dropped run is warned about. Runs without a seed are told apart by ``run_name``."""
    best: dict[tuple[str, str, str, int | str], Run] = {}
    warns = []
    for run in runs:
        key = (run.data, run.policy, run.credit, run.seed if run.seed is not None else run.run_name)
        if key not in best:
            best[key] = run
            continue
        keep, drop = (run, best[key]) if run.mtime > best[key].mtime else (best[key], run)
        best[key] = keep
        warns.append(
            f"duplicate run {keep.run_name} ({keep.setting}, {keep.credit}, seed {keep.seed}): "
            f"kept the newest {keep.source}, ignored {drop.source}"
        )
    return LoadResult(list(best.values()), warns)


# ---------------------------------------------------------------- statistics


def t_interval(values: Iterable[float | None]) -> Interval:
    """Mean and 95% Student-t half-width of the values that are not ``None``."""
    xs = np.array([v for v in values if v is not None], dtype=float)
    if len(xs) == 0:
        return Interval(None, None, 0)
    if len(xs) == 1:
        return Interval(float(xs[0]), None, 1)
    t = stats.t.ppf(0.5 + CONFIDENCE / 2, len(xs) - 1)
    return Interval(float(xs.mean()), float(t * xs.std(ddof=1) / math.sqrt(len(xs))), len(xs))


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


def _groups(runs: Iterable[Run]) -> dict[tuple[str, str, str], list[Run]]:
    """Runs by (data, policy, credit), each list sorted by seed."""
    out: dict[tuple[str, str, str], list[Run]] = {}
    for run in runs:
        out.setdefault((run.data, run.policy, run.credit), []).append(run)
    return {
        k: sorted(v, key=lambda r: (r.seed is None, r.seed or 0, r.run_name))
        for k, v in out.items()
    }


def build_report(runs: Sequence[Run], baseline: str = "grpo") -> Report:
    """Aggregate ``runs`` (one per setting, scheme and seed) into table rows and verdicts."""
    groups = _groups(runs)
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
                )
            )
        treat = groups.get((data, policy, TREATMENT))
        verdicts.append(
            Verdict(
                setting=f"{data} / {policy}",
                treatment=TREATMENT,
                baseline=baseline,
                has_treatment=treat is not None,
                has_baseline=base is not None,
                diff=paired_difference(treat, base, "final_gold") if treat and base else None,
            )
        )
    return Report(baseline, list(runs), rows, verdicts)


# ---------------------------------------------------------------- tables and text


@dataclass(frozen=True)
class Cell:
    """Table cell text (``±`` and ``Δ`` are turned into LaTeX math by the LaTeX writer)."""

    text: str
    bold: bool = False


def _interval_text(iv: Interval, n_runs: int, signed: bool = False) -> str:
    if iv.mean is None:
        return "n/a"
    mean = f"{iv.mean:+.3f}" if signed else f"{iv.mean:.3f}"
    hw = "n/a" if iv.half_width is None else f"{iv.half_width:.3f}"
    # Say so when a value is missing from some of the row's runs.
    return f"{mean} ± {hw}" + (f" (n={iv.n})" if iv.n < n_runs else "")


def table_cells(report: Report) -> tuple[list[str], list[list[Cell]]]:
    """The comparison table as a header and rows of cells, shared by Markdown and LaTeX."""
    b = report.baseline
    header = ["setting", "scheme"]
    for m in METRICS:
        header.append(m.label)
        if m.key in PAIRED_METRICS:
            header.append(f"Δ {m.label} vs {b}")
    header.append("n seeds")
    body = []
    for row in report.rows:
        has_base = any(r.setting == row.setting and r.scheme == b for r in report.rows)
        cells = [Cell(row.setting), Cell(row.scheme)]
        for m in METRICS:
            cells.append(Cell(_interval_text(row.cells[m.key], row.n_runs)))
            if m.key not in PAIRED_METRICS:
                continue
            if row.scheme == b:
                cells.append(Cell("(baseline)"))
            elif not has_base:
                cells.append(Cell(f"n/a (no {b} run)"))
            elif not row.vs_baseline[m.key].seeds:
                cells.append(Cell("n/a (no shared seed)"))
            else:
                pd = row.vs_baseline[m.key]
                cells.append(Cell(_interval_text(pd.diff, row.n_runs, signed=True), pd.significant))
        cells.append(Cell(str(row.n_runs)))
        body.append(cells)
    return header, body


LEGEND = (
    "Cells: mean ± half-width of the 95% Student-t interval over seeds (± n/a: one seed; "
    "(n=k): the value is missing from some runs). Δ: paired by seed, scheme minus baseline, "
    "mean ± 95% t half-width; bold where the interval excludes zero. Credit accuracy is "
    "undefined for uniform weights (GRPO): n/a."
)


def markdown_table(report: Report) -> str:
    header, body = table_cells(report)

    def md(c: Cell) -> str:
        return f"**{c.text}**" if c.bold else c.text

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(md(c) for c in cells) + " |" for cells in body]
    return f"{LEGEND}\n\n" + "\n".join(lines) + "\n"


TEX_ESCAPES = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\^{}",
    "±": r"$\pm$",
    "Δ": r"$\Delta$",
    "≥": r"$\geq$",
}


def _tex(text: str) -> str:
    return "".join(TEX_ESCAPES.get(ch, ch) for ch in text)


def latex_table(report: Report) -> str:
    """A booktabs ``tabular`` to ``\\input`` into a table float (needs booktabs)."""
    header, body = table_cells(report)

    def tex(c: Cell) -> str:
        return rf"\textbf{{{_tex(c.text)}}}" if c.bold else _tex(c.text)

    lines = [
        f"% {LEGEND}",
        r"\begin{tabular}{ll" + "r" * (len(header) - 2) + "}",
        r"\toprule",
        " & ".join(_tex(h) for h in header) + r" \\",
        r"\midrule",
    ]
    lines += [" & ".join(tex(c) for c in cells) + r" \\" for cells in body]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


PLOTS = {
    "gold_curves.png": "Held-out gold during training",
    "credit_accuracy.png": "Credit accuracy",
    "rm_vs_gold.png": "Final RM score against final gold",
}


def summary_markdown(report: Report) -> str:
    t, b = TREATMENT.upper(), report.baseline.upper()
    lines = [
        f"# {t} vs {b}",
        "",
        f'"Beat" means a positive mean paired difference in final held-out gold ({t} minus {b}, '
        "paired by seed); it is significant when its 95% Student-t interval excludes zero.",
        "",
    ]
    lines += [f"- {v.sentence}" for v in report.verdicts]
    lines += [
        "",
        "All settings and schemes: [table.md](table.md) ([LaTeX](table.tex)); numbers in "
        "[report.json](report.json); the runs in [runs.csv](runs.csv).",
        "",
        "## Plots",
        "",
    ]
    lines += [f"![{title}]({name})\n" for name, title in PLOTS.items()]
    return "\n".join(lines)


def runs_csv(runs: Sequence[Run]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for run in sorted(
        runs, key=lambda r: (r.data, r.policy, r.credit, r.seed is None, r.seed or 0, r.run_name)
    ):
        writer.writerow({k: "" if (v := getattr(run, k)) is None else v for k in CSV_FIELDS})
    return buf.getvalue()


def report_json(report: Report, warnings: Sequence[str]) -> str:
    def row(r: Row) -> dict[str, Any]:
        return {
            "setting": r.setting,
            "data": r.data,
            "policy": r.policy,
            "scheme": r.scheme,
            "n_runs": r.n_runs,
            "seeds": list(r.seeds),
            "metrics": {k: asdict(iv) for k, iv in r.cells.items()},
            "vs_baseline": {
                k: {**asdict(pd.diff), "seeds": list(pd.seeds), "significant": pd.significant}
                for k, pd in r.vs_baseline.items()
            },
        }

    def verdict(v: Verdict) -> dict[str, Any]:
        d = v.diff
        return {
            "setting": v.setting,
            "treatment": v.treatment,
            "baseline": v.baseline,
            "has_treatment": v.has_treatment,
            "has_baseline": v.has_baseline,
            "final_gold_diff": None
            if d is None
            else {**asdict(d.diff), "seeds": list(d.seeds), "significant": d.significant},
            "sentence": v.sentence,
        }

    obj = {
        "confidence": CONFIDENCE,
        "baseline": report.baseline,
        "treatment": TREATMENT,
        "rows": [row(r) for r in report.rows],
        "verdicts": [verdict(v) for v in report.verdicts],
        "warnings": list(warnings),
    }
    return json.dumps(obj, indent=2) + "\n"


# ---------------------------------------------------------------- plots


def _colors(report: Report) -> dict[str, Any]:
    cmap = matplotlib.colormaps["tab10"]
    return {s: cmap(i % 10) for i, s in enumerate(report.schemes)}


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # render with Agg whatever pyplot's backend is
    return fig


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    return buf.getvalue()


def plot_gold_curves(report: Report) -> bytes:
    """One subplot per setting, one line per scheme: mean gold over seeds by step, with the
    95% t-interval shaded where at least 2 seeds were evaluated at that step."""
    settings, colors, groups = report.settings, _colors(report), _groups(report.runs)
    ncols = 1 if len(settings) == 1 else 2
    nrows = math.ceil(len(settings) / ncols)
    fig = _figure(5.5 * ncols, 3.6 * nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, setting in zip(axes, settings, strict=False):
        for row in (r for r in report.rows if r.setting == setting):
            band = curve_band(groups[(row.data, row.policy, row.scheme)])
            if band is None:
                continue
            c = colors[row.scheme]
            ax.plot(band.steps, band.mean, color=c, label=f"{row.scheme} (n={int(band.n.max())})")
            ax.fill_between(
                band.steps,
                band.mean - band.half_width,
                band.mean + band.half_width,
                color=c,
                alpha=0.2,
                linewidth=0,
            )
        if not ax.lines:
            ax.text(
                0.5, 0.5, "no eval curve recorded", ha="center", va="center", transform=ax.transAxes
            )
        else:
            ax.legend(fontsize="small")
        ax.set(title=setting, xlabel="step", ylabel="held-out gold")
    for ax in axes[len(settings) :]:
        ax.set_visible(False)
    fig.suptitle(
        "Held-out gold: mean over seeds; band = 95% Student-t interval (steps with ≥2 seeds)"
    )
    return _png(fig)


def plot_credit_accuracy(report: Report) -> bytes:
    """Grouped bars: settings along x, one bar per scheme (uniform-credit schemes left out),
    height = mean credit accuracy over seeds, error bar = 95% t half-width (none for n = 1)."""
    rows = [
        r
        for r in report.rows
        if r.scheme not in UNIFORM_CREDIT and r.cells["credit_accuracy"].mean is not None
    ]
    settings = [s for s in report.settings if any(r.setting == s for r in rows)]
    schemes = [s for s in report.schemes if any(r.scheme == s for r in rows)]
    colors = _colors(report)
    fig = _figure(max(6.0, 1.2 + 0.6 * len(settings) * max(len(schemes), 1)), 4.0)
    ax = fig.subplots()
    width = 0.8 / max(len(schemes), 1)
    for i, scheme in enumerate(schemes):
        ivs = {r.setting: r.cells["credit_accuracy"] for r in rows if r.scheme == scheme}
        xs = [j + (i - (len(schemes) - 1) / 2) * width for j, s in enumerate(settings) if s in ivs]
        present = [ivs[s] for s in settings if s in ivs]
        ax.bar(
            xs,
            [iv.mean for iv in present],
            width,
            color=colors[scheme],
            label=scheme,
            yerr=[np.nan if iv.half_width is None else iv.half_width for iv in present],
            capsize=3,
        )
    if not rows:
        ax.text(
            0.5,
            0.5,
            "no credit accuracy recorded",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    else:
        ax.legend(fontsize="small")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(settings)), settings)
    ax.set_ylabel("credit accuracy (Spearman ρ)")
    ax.set_title(
        "Credit accuracy: mean over seeds ± 95% t-interval "
        f"({', '.join(sorted(UNIFORM_CREDIT))}: undefined)"
    )
    return _png(fig)


def plot_rm_vs_gold(report: Report) -> bytes:
    """One point per run: final RM score (y) against final held-out gold (x), coloured by scheme,
    marker by setting, with y = x. Points above the line are runs the RM over-rates."""
    colors = _colors(report)
    markers = {s: MARKERS[i % len(MARKERS)] for i, s in enumerate(report.settings)}
    runs = [r for r in report.runs if r.final_gold is not None and r.final_rm_score is not None]
    fig = _figure(6.5, 5.0)
    ax = fig.subplots()
    for run in runs:
        ax.scatter(
            run.final_gold,
            run.final_rm_score,
            color=colors[run.credit],
            marker=markers[run.setting],
            alpha=0.8,
            edgecolors="none",
        )
    if runs:
        vals = [v for r in runs for v in (r.final_gold, r.final_rm_score)]
        lo, hi = min(vals), max(vals)
        pad = 0.05 * (hi - lo) or 0.1
        ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], "k--", linewidth=0.8, zorder=0)
        used = {r.credit for r in runs}, {r.setting for r in runs}
        handles = [
            Line2D([], [], color=colors[s], marker="o", linestyle="", label=s)
            for s in report.schemes
            if s in used[0]
        ]
        handles += [
            Line2D([], [], color="gray", marker=markers[s], linestyle="", label=s)
            for s in report.settings
            if s in used[1]
        ]
        handles.append(
            Line2D([], [], color="black", linestyle="--", linewidth=0.8, label="RM = gold")
        )
        ax.legend(handles=handles, fontsize="small")
    else:
        ax.text(
            0.5,
            0.5,
            "no run has both final RM score and gold",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.set(
        xlabel="final held-out gold",
        ylabel="final RM score",
        title="Final RM score vs gold, one point per run (above the line: RM over-rates)",
    )
    return _png(fig)


# ---------------------------------------------------------------- writing


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` so readers see the old or the new content, never a torn file."""
    atomic_write_bytes(path, data)


def write_outputs(report: Report, out: str | Path, warnings: Sequence[str] = ()) -> list[Path]:
    """Write every output file under ``out`` (created if needed); returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    contents = {
        "table.md": markdown_table(report).encode(),
        "table.tex": latex_table(report).encode(),
        "summary.md": summary_markdown(report).encode(),
        "runs.csv": runs_csv(report.runs).encode(),
        "report.json": report_json(report, warnings).encode(),
        "gold_curves.png": plot_gold_curves(report),
        "credit_accuracy.png": plot_credit_accuracy(report),
        "rm_vs_gold.png": plot_rm_vs_gold(report),
    }
    paths = []
    for name, data in contents.items():
        write_atomic(out / name, data)
        paths.append(out / name)
    return paths


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="datc-compare",
        description="Compare runs across settings (data, policy) and credit schemes: "
        "tables, summary, plots.",
    )
    p.add_argument(
        "roots", nargs="*", metavar="ROOT", help="directories searched for **/summary.json"
    )
    p.add_argument("--out", required=True, help="output directory, e.g. results/four_settings")
    p.add_argument(
        "--wandb-project", metavar="ENTITY/PROJECT", help="also read the runs of this W&B project"
    )
    p.add_argument(
        "--baseline",
        default="grpo",
        help="credit scheme the others are paired against (default: grpo)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.roots and not args.wandb_project:
        parser.error("give at least one ROOT or --wandb-project")
    loaded = load_run_dirs(args.roots)
    runs, warns = list(loaded.runs), list(loaded.warnings)
    if args.wandb_project:
        try:
            remote = load_wandb(args.wandb_project)
        except Exception as e:
            # No network, no credentials or no such project: one line instead of a traceback.
            raise SystemExit(
                f"datc-compare: reading W&B project {args.wandb_project} failed "
                f"({type(e).__name__}: {e})"
            ) from e
        runs += remote.runs
        warns += remote.warnings
    unique = deduplicate(runs)
    warns += unique.warnings
    if unique.runs and not any(r.credit == args.baseline for r in unique.runs):
        warns.append(f"no run of the baseline scheme {args.baseline!r}: no paired differences")
    for w in warns:
        print(f"datc-compare: warning: {w}", file=sys.stderr)
    if not unique.runs:
        sources = [*args.roots, *([args.wandb_project] if args.wandb_project else [])]
        raise SystemExit(f"datc-compare: no runs found in {', '.join(map(str, sources))}")
    for path in write_outputs(build_report(unique.runs, args.baseline), args.out, warns):
        print(path)
