"""Reading runs for the comparison: ``summary.json`` files under run directories and W&B
projects, flattened to :class:`Run` records, and duplicates removed."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Schemes with constant token weights: credit accuracy (a rank correlation of the weights with
# gold contributions) is undefined for them, so it is shown as n/a whatever was logged.
UNIFORM_CREDIT = frozenset({"grpo"})
UNKNOWN = "unknown"


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
    # its identity less the scheme and the seed (datc.report.grouping); None: unknown
    config: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    variant: str = ""  # what sets it apart from other configs of its (data, policy), e.g. "trainer.steps=20"
    # METHOD §6: the first step whose rollout batch collapsed in length (summary's length_collapse.step); None: none or unknown
    collapse_step: int | None = None

    @property
    def policy_label(self) -> str:
        """The policy, with the variant that splits its setting (if any)."""
        return f"{self.policy} [{self.variant}]" if self.variant else self.policy

    @property
    def setting(self) -> str:
        return f"{self.data} / {self.policy_label}"

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
    "collapse_step",
)


@dataclass(frozen=True)
class LoadResult:
    """Runs read from some source, and the problems met on the way (one line each)."""

    runs: list[Run]
    warnings: list[str] = field(default_factory=list)


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
        collapse_step=_int(_dict(s.get("length_collapse")).get("step")),
    )


def load_run_dirs(roots: Sequence[str | Path]) -> LoadResult:
    """Every ``summary.json`` found recursively under ``roots`` (a file found under two
    overlapping roots is read once). Unreadable files, summaries that are not a JSON object,
    missing roots and run directories without a summary (unfinished or killed runs) are warned
    about and skipped."""
    runs: list[Run] = []
    warns: list[str] = []
    seen: set[Path] = set()
    for root in map(Path, roots):
        if not root.is_dir():
            warns.append(f"{root}: not a directory, skipped")
            continue
        for run_json in sorted(root.glob("**/run.json")):
            if not (run_json.parent / "summary.json").exists():
                warns.append(f"{run_json.parent}: no summary.json (an unfinished run), skipped")
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
            if not isinstance(summary, dict):
                warns.append(f"{path}: not a run summary (a JSON {type(summary).__name__}, not an object), skipped")
                continue
            run = run_from_summary(summary, _shown(path), mtime, path.parent.name)
            runs.append(dataclasses.replace(run, config=_run_config(path.parent / "run.json")))
    return LoadResult(runs, warns)


def load_runs_csv(paths: Sequence[str | Path]) -> LoadResult:
    """The runs of ``runs.csv`` files as this tool writes them (:data:`CSV_FIELDS`): for runs
    whose directories are gone. A row has no gold curve (the plots leave it out) and no config
    (:func:`datc.report.grouping.adopt_configs` gives it one); its ``mtime`` is 0, so a run read
    from a directory is kept over the same run read from a table."""
    runs: list[Run] = []
    warns: list[str] = []
    for path in map(Path, paths):
        try:
            rows = list(csv.DictReader(path.read_text().splitlines()))
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            warns.append(f"{path}: unreadable ({type(e).__name__}: {e}), skipped")
            continue
        missing = [k for k in ("data", "policy", "credit", "seed", "final_gold") if rows and k not in rows[0]]
        if missing:
            warns.append(f"{path}: not a runs.csv (no {', '.join(missing)} column), skipped")
            continue

        def num(row: dict[str, str], k: str) -> float | None:
            try:
                return _num(float(row.get(k) or "nan"))
            except ValueError:
                return None

        for row in rows:
            credit = row.get("credit") or UNKNOWN
            seed, steps = num(row, "seed"), num(row, "steps")
            runs.append(Run(
                run_name=row.get("run_name") or f"{path}:{len(runs)}", run_id=row.get("run_id") or None,
                data=row.get("data") or UNKNOWN, policy=row.get("policy") or UNKNOWN, credit=credit,
                seed=None if seed is None else int(seed), steps=None if steps is None else int(steps),
                final_gold=num(row, "final_gold"), gold_auc=num(row, "gold_auc"),
                final_rm_score=num(row, "final_rm_score"), final_kl=num(row, "final_kl"),
                credit_accuracy=None if credit in UNIFORM_CREDIT else num(row, "credit_accuracy"),
                step_s=num(row, "step_s"), wall_time_s=num(row, "wall_time_s"),
                git_commit=row.get("git_commit") or None, curve=(), source=row.get("source") or str(path),
                mtime=0.0, collapse_step=None if (c := num(row, "collapse_step")) is None else int(c),
            ))
    return LoadResult(runs, warns)


IGNORED_IN_COMPARISON = ("credit", "seed")  # what a comparison may vary (datc.report.grouping)
# Settings of the identity that change no number a run trains to: how often (and how many)
# checkpoints are written, and how often held-out gold is evaluated (in a forked RNG, so the
# training draws are the same). The last evaluation is at the final step whatever the cadence,
# so the final figures are equal; the curve is sampled at other steps, so where the runs of a
# setting were evaluated at different steps, the gold AUC and the curves are taken over the
# steps all of them evaluated (datc.report.grouping.align_curves).
CADENCE_KEYS = ("trainer.checkpoint_every", "trainer.keep_checkpoints", "trainer.eval_every")


def comparison_config(identity: dict[str, Any]) -> dict[str, Any]:
    """The part of a run's identity that must be equal for runs to be compared: all of it but the
    scheme, the seed and the :data:`CADENCE_KEYS`."""
    out = {k: v for k, v in identity.items() if k not in IGNORED_IN_COMPARISON}
    if isinstance(out.get("trainer"), dict):
        cadence = {k.split(".", 1)[1] for k in CADENCE_KEYS}
        out["trainer"] = {k: v for k, v in out["trainer"].items() if k not in cadence}
    return out


def _run_config(run_json: Path) -> dict[str, Any] | None:
    """The comparison config of the run whose ``run.json`` this is; None if it has none."""
    try:
        ident = json.loads(run_json.read_text()).get("identity")
    except (OSError, ValueError, AttributeError):
        return None
    return comparison_config(ident) if isinstance(ident, dict) else None


def _shown(path: Path) -> str:
    """``path`` relative to the working directory where it lies below it (so committed tables name
    ``runs/...``, not where one machine keeps its checkout), else as given."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


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
        run = run_from_summary(summary, f"wandb:{project}/{r.id}", mtime, str(r.id))
        runs.append(dataclasses.replace(run, config=_wandb_config(r.config)))
    return LoadResult(runs)


def _wandb_config(config: Any) -> dict[str, Any] | None:
    from datc.run.identity import identity

    try:
        return comparison_config(identity(dict(config)))
    except (KeyError, TypeError, AttributeError):
        return None


def deduplicate(runs: Iterable[Run]) -> LoadResult:
    """One run per (data, policy and variant, credit, seed), the one with the newest ``mtime``; each
    dropped run is warned about. Runs without a seed are told apart by ``run_name``."""
    best: dict[tuple[str, str, str, int | str], Run] = {}  # (data, policy and variant, credit, seed)
    warns = []
    for run in runs:
        key = (run.data, run.policy_label, run.credit, run.seed if run.seed is not None else run.run_name)
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

