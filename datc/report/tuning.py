"""The tuned comparison of METHOD §6, read back: ``datc-compare --tuned ROOT``.

A tuned sweep (written by ``python -m scripts.tuned_sweep``, docs/tuned.md) holds one folder per
setting, ``ROOT/<data>-<policy>/``, with its protocol in ``tuning.json`` (the selection draw and
seeds, the evaluation draws and seeds, and per scheme its default learning rate, the credit knob
searched second and both grids) and its runs in ``select/`` and ``eval/``. Per setting and scheme
the configuration is chosen by a coordinate search on the selection runs: the learning rate first
(at the knob's default), then the knob at that rate, each by the mean final held-out gold over
the selection seeds; a step whose grid is not complete chooses nothing. The evaluation table pairs
the chosen configurations, and beside them the default ones, by seed on the evaluation runs only:
a selection seed never enters an evaluation figure, and an evaluation that shares a seed with its
selection is refused. Runs that collapsed in length (METHOD §6) are named in every table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datc.report.loading import Run, deduplicate, load_run_dirs
from datc.report.matched_kl import load_matched, matched_json, matched_markdown, matched_rows
from datc.report.statistics import (
    Interval,
    Report,
    build_report,
    collapsed_seeds,
    paired_difference,
    t_interval,
)
from datc.report.tables import MIN_INTERVAL_N, _interval_text, collapse_note

MANIFEST = "tuning.json"
SELECT_DIR, EVAL_DIR = "select", "eval"
LR_FACTORS = (0.5, 1.0, 2.0)  # x the setting's default learning rate, every scheme
KNOB_FACTORS = (0.5, 1.0, 2.0)  # x the knob's default (tau: 0.5, 1, 2), at the chosen rate
# The shared weight step's knob by normalizer (schemes whose output is scores), and a peer's own
# main knob where its weights are its own (output: weights); lam stays 1.
STEP5_KNOBS = {"softmax": "tau", "linear": "alpha", "rank_power": "alpha"}
PEER_KNOBS = {"delta": "tau", "grail": "std", "prob_reweight": "alpha", "entropy_top": "rho"}


class TuningError(ValueError):
    """A tuned sweep that cannot be read as one: one line, for the command to print."""


def knob_for(credit: Mapping[str, Any], output: str) -> str | None:
    """The credit field searched after the learning rate for a scheme of this config: the shared
    weight step's (``tau`` under its softmax) for a scheme that returns scores, a peer's own knob
    for one that makes its weights, None for a scheme with none (``grpo``)."""
    if output == "scores":
        return STEP5_KNOBS.get(str(credit.get("normalizer", "softmax")))
    for name in (credit.get("name"), credit.get("scheme")):
        if name in PEER_KNOBS and PEER_KNOBS[name] in credit:
            return PEER_KNOBS[name]
    return None


def grid(default: float, factors: Sequence[float] = LR_FACTORS) -> list[float]:
    return [float(f) * float(default) for f in factors]


def _same(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9))


@dataclass(frozen=True)
class Candidate:
    """One configuration of a scheme on the selection seeds."""

    lr: float
    knob: float | None
    score: Interval  # final held-out gold over its selection runs
    seeds: tuple[int, ...]
    collapsed: tuple[int | str, ...]
    kl: Interval = Interval(None, None, 0)  # final KL(π‖π_ref) over its selection runs (the matched-KL control's target)


@dataclass(frozen=True)
class SchemeTuning:
    """A scheme's search in one setting: its protocol (``spec``), the candidates, the rate and
    knob chosen (None while their grid is incomplete), and its evaluation runs."""

    scheme: str
    spec: dict[str, Any]
    candidates: list[Candidate]
    lr: float | None
    knob: float | None
    tuned: list[Run]  # evaluation runs of the chosen configuration
    default: list[Run]  # evaluation runs of the default configuration

    @property
    def chosen(self) -> Candidate | None:
        return self.find(self.lr, self.knob) if self.lr is not None and (self.knob is not None or not self.spec.get("knob")) else None

    @property
    def default_candidate(self) -> Candidate | None:
        return self.find(self.spec["lr"], self.spec.get("knob_default"))

    def find(self, lr: float | None, knob: float | None) -> Candidate | None:
        return next((c for c in self.candidates if _same(c.lr, lr) and _same(c.knob, knob)), None)

    def label(self, lr: float | None, knob: float | None) -> str:
        if lr is None:
            return "not chosen (selection incomplete)"
        parts = [f"lr {lr:g} (×{lr / self.spec['lr']:g})"]
        if self.spec.get("knob"):
            parts.append("knob not chosen" if knob is None else f"{self.spec['knob']} {knob:g}")
        return ", ".join(parts)


@dataclass(frozen=True)
class SettingTuning:
    data: str
    policy: str
    manifest: dict[str, Any]
    schemes: dict[str, SchemeTuning]
    warnings: list[str]
    matched: list[tuple[float, Run]] = dataclasses.field(default_factory=list)  # the baseline's matched-KL runs (lr, run)

    @property
    def setting(self) -> str:
        return f"{self.data} / {self.policy}"


def read_manifest(folder: Path) -> dict[str, Any]:
    try:
        m = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise TuningError(f"{folder / MANIFEST}: unreadable ({type(e).__name__}: {e})") from None
    for key in ("setting", "selection", "evaluation", "schemes"):
        if not isinstance(m, dict) or key not in m:
            raise TuningError(f"{folder / MANIFEST}: not a tuning manifest (no {key!r})")
    return m


def _identity(run: Run) -> dict[str, Any] | None:
    try:
        ident = json.loads((Path(run.source).parent / "run.json").read_text()).get("identity")
    except (OSError, ValueError, AttributeError):
        return None
    return ident if isinstance(ident, dict) else None


def _coordinates(run: Run, spec: Mapping[str, Any]) -> tuple[float, float | None, str] | None:
    """A run's (learning rate, knob value, the rest of its config as JSON), from its run.json."""
    ident = _identity(run)
    if ident is None:
        return None
    knob = spec.get("knob")
    field = knob.removeprefix("credit.") if knob else None
    trainer, credit = dict(ident.get("trainer") or {}), dict(ident.get("credit") or {})
    lr = trainer.pop("lr", None)
    if not isinstance(lr, (int, float)):
        return None
    value = credit.pop(field, None) if field else None
    rest = {k: v for k, v in ident.items() if k not in ("seed", "prepare_seed", "trainer", "credit")}
    rest["trainer"], rest["credit." + str(credit.get("name"))] = trainer, credit  # a scheme's own fields: its own
    return float(lr), None if value is None else float(value), json.dumps(rest, sort_keys=True, default=str)


def _coordinate_search(scheme: str, spec: Mapping[str, Any], cands: list[Candidate], n_seeds: int) -> tuple[float | None, float | None]:
    """METHOD §6's search: the rate by mean selection gold at the knob's default, then the knob at
    that rate; ties keep the default. None where a grid point lacks a selection seed."""
    def best(points: list[tuple[float, float | None]], default_at: int) -> int | None:
        found = [next((c for c in cands if _same(c.lr, lr) and _same(c.knob, k)), None) for lr, k in points]
        if any(c is None or len(c.seeds) < n_seeds or c.score.mean is None for c in found):
            return None
        scores = [c.score.mean for c in found]
        top = max(scores)
        return default_at if scores[default_at] == top else scores.index(top)

    kd = spec.get("knob_default")
    lrs = [float(x) for x in spec["lr_grid"]]
    i = best([(lr, kd) for lr in lrs], next(j for j, x in enumerate(lrs) if _same(x, spec["lr"])))
    if i is None:
        return None, None
    if not spec.get("knob"):
        return lrs[i], None
    ks = [float(x) for x in spec["knob_grid"]]
    j = best([(lrs[i], k) for k in ks], next(j for j, x in enumerate(ks) if _same(x, kd)))
    return lrs[i], None if j is None else ks[j]


def read_setting(folder: str | Path) -> SettingTuning:
    """One setting's tuned sweep: its manifest, every scheme's candidates and choice, and the
    evaluation runs of the chosen and the default configurations. Refuses (:class:`TuningError`)
    an evaluation that shares a seed with its selection, and runs whose configs differ in more
    than the searched coordinates, the seed and the asset draw."""
    folder = Path(folder)
    m = read_manifest(folder)
    sel, ev = load_run_dirs([folder / SELECT_DIR]), load_run_dirs([folder / EVAL_DIR])
    warns = [w for w in sel.warnings + ev.warnings if "not a directory" not in w]
    sel_seeds = {int(s) for s in m["selection"]["seeds"]} | {r.seed for r in sel.runs if r.seed is not None}
    eval_seeds = {int(s) for ss in m["evaluation"]["seeds"].values() for s in ss} | {r.seed for r in ev.runs if r.seed is not None}
    if shared := sorted(sel_seeds & eval_seeds):
        raise TuningError(f"{folder}: the evaluation shares seed(s) {', '.join(map(str, shared))} with its selection "
                          "(METHOD §6: evaluate on fresh seeds); refused")
    data, policy = m["setting"]["data"], m["setting"]["policy"]
    n_seeds = len(m["selection"]["seeds"])
    rests: dict[str, set[str]] = {}  # the config less the searched coordinates and the scheme's fields: one per setting
    schemes_rest: dict[str, set[str]] = {}  # a scheme's fields less its knob: one per scheme
    schemes = {}
    for scheme, spec in m["schemes"].items():
        placed: dict[str, list[tuple[Run, float, float | None]]] = {SELECT_DIR: [], EVAL_DIR: []}
        for where, runs in ((SELECT_DIR, sel.runs), (EVAL_DIR, ev.runs)):
            for r in runs:
                if r.credit != scheme:
                    continue
                if (r.data, r.policy) != (data, policy):
                    raise TuningError(f"{r.source}: a run of {r.data} / {r.policy} in the folder of {data} / {policy}")
                coords = _coordinates(r, spec)
                if coords is None:
                    warns.append(f"{r.source}: no run.json beside it, so its configuration is unknown: left out")
                    continue
                rest = json.loads(coords[2])
                schemes_rest.setdefault(scheme, set()).add(json.dumps(rest.pop(f"credit.{scheme}", None), sort_keys=True))
                rests.setdefault(json.dumps(rest, sort_keys=True), set()).add(r.source)
                placed[where].append((r, coords[0], coords[1]))
        by_config: dict[tuple[float, float | None], list[Run]] = {}
        for r, lr, k in placed[SELECT_DIR]:
            key = next((c for c in by_config if _same(c[0], lr) and _same(c[1], k)), (lr, k))
            by_config.setdefault(key, []).append(r)
        cands = []
        for (lr, k), rs in sorted(by_config.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0.0)):
            rs = deduplicate(rs).runs
            cands.append(Candidate(lr, k, t_interval(r.final_gold for r in rs), tuple(sorted(r.seed for r in rs if r.seed is not None)),
                                   collapsed_seeds(rs), t_interval(r.final_kl for r in rs)))
        lr, knob = _coordinate_search(scheme, spec, cands, n_seeds)
        tuned = _runs_at(placed[EVAL_DIR], lr, knob) if lr is not None and (knob is not None or not spec.get("knob")) else []
        default = _runs_at(placed[EVAL_DIR], float(spec["lr"]), spec.get("knob_default"))
        other = [r for r, x, k in placed[EVAL_DIR] if r not in tuned and r not in default]
        if other:
            warns.append(f"{data} / {policy}, {scheme}: {len(other)} evaluation run(s) of neither the chosen nor the "
                         f"default configuration (e.g. {other[0].run_name}): left out")
        schemes[scheme] = SchemeTuning(scheme, dict(spec), cands, lr, knob, deduplicate(tuned).runs, deduplicate(default).runs)
    if stray := sorted({r.credit for r in sel.runs + ev.runs} - set(m["schemes"])):
        warns.append(f"{data} / {policy}: runs of scheme(s) {', '.join(stray)} that its {MANIFEST} does not list: left out")
    split = next((v for v in schemes_rest.values() if len(v) > 1), None) or (set(rests) if len(rests) > 1 else None)
    if split:
        a, b = (json.loads(x) for x in list(split)[:2])
        raise TuningError(f"{folder}: runs differ in more than the learning rate, the knob, the seed and the draw "
                          f"(at {', '.join(_differing(a, b)[:6])}); one tuned sweep holds one setting's config")
    try:
        matched, more = load_matched(folder, m["selection"]["seeds"])
    except ValueError as e:
        raise TuningError(str(e)) from None
    return SettingTuning(data, policy, m, schemes, warns + more, matched)


def _runs_at(placed: list[tuple[Run, float, float | None]], lr: float | None, knob: float | None) -> list[Run]:
    return [r for r, x, k in placed if _same(x, lr) and _same(k, knob)]


def _differing(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differing(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if a != b else []


def find_settings(root: str | Path) -> list[Path]:
    """The setting folders (each holding a ``tuning.json``) at or below ``root``."""
    root = Path(root)
    return sorted(p.parent for p in root.glob(f"**/{MANIFEST}"))


def _seeds_text(seeds: Mapping[str, Sequence[int]] | Sequence[int]) -> str:
    if isinstance(seeds, Mapping):
        return "; ".join(f"draw {d}: {', '.join(map(str, s))}" for d, s in seeds.items())
    return ", ".join(map(str, seeds))


def _score_text(c: Candidate | None, n_seeds: int) -> str:
    if c is None:
        return "n/a"
    mean = "n/a" if c.score.mean is None else f"{c.score.mean:.3f}"
    return f"{mean} (seeds {', '.join(map(str, c.seeds))}{'; incomplete' if len(c.seeds) < n_seeds else ''})" + \
        collapse_note(c.collapsed)


def _eval_cells(runs: list[Run], base: list[Run] | None) -> tuple[str, str, bool]:
    gold = t_interval(r.final_gold for r in runs)
    if base is None:
        return _interval_text(gold, len(runs)), "(baseline)", False
    pd = paired_difference(runs, base, "final_gold")
    if not pd.seeds:
        return _interval_text(gold, len(runs)), "n/a (no shared seed)", False
    return _interval_text(gold, len(runs)), _interval_text(pd.diff, len(runs), signed=True), pd.significant and pd.diff.n >= MIN_INTERVAL_N


def setting_markdown(st: SettingTuning, baseline: str) -> str:
    m = st.manifest
    n_sel = len(m["selection"]["seeds"])
    lines = [
        f"## {st.setting}", "",
        f"Selection: draw {m['selection']['prepare_seed']}, seeds {_seeds_text(m['selection']['seeds'])}. "
        f"Evaluation (selection seeds left out of every figure below): {_seeds_text(m['evaluation']['seeds'])}.", "",
        f"| scheme | configuration chosen | selection score (mean final gold) | default's selection score | tuned: final gold "
        f"| tuned: Δ vs {baseline} (tuned) | default: final gold | default: Δ vs {baseline} (default) | n eval seeds (tuned / default) |",
        "|" + "---|" * 9,
    ]
    base = st.schemes.get(baseline)
    order = ([baseline] if base else []) + sorted(s for s in st.schemes if s != baseline)
    for name in order:
        sc = st.schemes[name]
        cells = [name, sc.label(sc.lr, sc.knob), _score_text(sc.chosen, n_sel), _score_text(sc.default_candidate, n_sel)]
        for runs, base_runs in ((sc.tuned, base.tuned if base else None), (sc.default, base.default if base else None)):
            if not runs:
                cells += ["n/a (no runs)", "n/a"]
                continue
            if base is None:
                g, d, bold = _interval_text(t_interval(r.final_gold for r in runs), len(runs)), f"n/a (no {baseline} run)", False
            else:
                g, d, bold = _eval_cells(runs, None if name == baseline else base_runs)
            cells += [g, f"**{d}**" if bold else d]
        cells.append(f"{len(sc.tuned)}{collapse_note(collapsed_seeds(sc.tuned))} / {len(sc.default)}"
                     f"{collapse_note(collapsed_seeds(sc.default))}")
        lines.append("| " + " | ".join(cells) + " |")
    if control := matched_markdown(matched_rows(st, baseline, st.matched), baseline, float(base.spec["lr"]) if base else 1.0):
        lines += ["", control.rstrip("\n")]
    lines += ["", "Every candidate on the selection seeds:", "",
              "| scheme | configuration | search step | mean final gold (selection) |", "|---|---|---|---|"]
    for name in order:
        sc = st.schemes[name]
        lines += [f"| {name} | {sc.label(c.lr, c.knob)} | {_step(sc, c)} | {_score_text(c, n_sel)} |" for c in sc.candidates]
    return "\n".join(lines) + "\n"


def _step(sc: SchemeTuning, c: Candidate) -> str:
    """Where a candidate lies on the search: the rate grid, the knob grid at the chosen rate, or off it."""
    on_rate = _same(c.knob, sc.spec.get("knob_default")) and any(_same(c.lr, x) for x in sc.spec["lr_grid"])
    on_knob = sc.lr is not None and _same(c.lr, sc.lr) and any(_same(c.knob, x) for x in sc.spec.get("knob_grid") or [])
    where = " and ".join(w for w, ok in (("rate", on_rate), ("knob", on_knob)) if ok) or "off the search path (not eligible)"
    return where + (" (chosen)" if sc.chosen is c else "")


LEGEND = (
    "METHOD §6's tuned comparison. Per setting and scheme: the configuration chosen by the coordinate search "
    "(learning rate ×0.5/×1/×2 of the default at the knob's default, then the knob ×0.5/×1/×2 at that rate), by mean "
    "final held-out gold on the selection seeds; its selection score and the default's; then, on the evaluation seeds "
    "only, final held-out gold (mean ± 95% t half-width over seeds; below 3 values the mean and its n) and the difference "
    "to the baseline paired by seed, tuned against tuned and default against default (bold where the interval excludes "
    "zero). (k collapsed: seeds ...): runs with a length collapse (METHOD §6), kept in the means and named here."
)


def tuned_markdown(settings: Sequence[SettingTuning], baseline: str) -> str:
    return "# Tuned comparison\n\n" + LEGEND + "\n\n" + "\n".join(setting_markdown(s, baseline) for s in settings)


def tuned_json(settings: Sequence[SettingTuning], warnings: Sequence[str], baseline: str) -> str:
    def cand(c: Candidate | None) -> dict[str, Any] | None:
        return None if c is None else {**dataclasses.asdict(c), "score": dataclasses.asdict(c.score)}

    out = [{
        "setting": st.setting, "selection": st.manifest["selection"], "evaluation": st.manifest["evaluation"],
        "schemes": {n: {"spec": sc.spec, "chosen": {"lr": sc.lr, "knob": sc.knob}, "chosen_score": cand(sc.chosen),
                        "default_score": cand(sc.default_candidate), "candidates": [cand(c) for c in sc.candidates],
                        "tuned_runs": [r.run_name for r in sc.tuned], "default_runs": [r.run_name for r in sc.default],
                        "tuned_collapsed": list(collapsed_seeds(sc.tuned)),
                        "default_collapsed": list(collapsed_seeds(sc.default))}
                    for n, sc in st.schemes.items()},
        "matched_kl": matched_json(matched_rows(st, baseline, st.matched)),
    } for st in settings]
    return json.dumps({"settings": out, "warnings": list(warnings)}, indent=2, default=str) + "\n"


def _relabel(runs: Iterable[Run]) -> list[Run]:
    return [dataclasses.replace(r, variant="") for r in runs]


def compare_tuned(root: str | Path, out: str | Path, baseline: str,
                  write_outputs: Callable[[Report, Path, Sequence[str]], list[Path]]) -> list[Path]:
    """``datc-compare --tuned ROOT --out OUT``: ``OUT/tuned.md`` and ``tuned.json`` (the choices,
    the selection scores, the evaluation table), and the usual outputs of the chosen
    configurations' evaluation runs in ``OUT/evaluation/`` and the default ones' in ``OUT/default/``.
    A refusal is one line and exit status 2."""
    from datc.run.atomic import atomic_write_text

    folders = find_settings(root)
    try:
        if not folders:
            raise TuningError(f"{root}: no {MANIFEST} at or below it (a tuned sweep's setting folders hold one)")
        settings = [read_setting(f) for f in folders]
    except TuningError as e:
        print(f"datc-compare: --tuned {e}", file=sys.stderr)
        raise SystemExit(2) from None
    warns = [w for st in settings for w in st.warnings]
    for w in warns:
        print(f"datc-compare: warning: {w}", file=sys.stderr)
    out = Path(out)
    written = []
    for sub, pick in (("evaluation", lambda sc: sc.tuned), ("default", lambda sc: sc.default)):
        runs = _relabel(r for st in settings for sc in st.schemes.values() for r in pick(sc))
        if runs:
            written += write_outputs(build_report(runs, baseline), out / sub, warns)
    atomic_write_text(out / "tuned.json", tuned_json(settings, warns, baseline))
    atomic_write_text(out / "tuned.md", tuned_markdown(settings, baseline))
    return [*written, out / "tuned.json", out / "tuned.md"]
