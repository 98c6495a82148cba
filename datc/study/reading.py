"""The tuned comparison of METHOD §6, read back: ``datc-compare --tuned ROOT`` (and ``datc-study``
between its stages).

A study (written by ``datc-study``, docs/study.md; before it ``scripts/tuned_sweep.py``) holds one folder per
setting, ``ROOT/<data>-<policy>/``, with its protocol in ``tuning.json`` (the selection draw and
seeds, the evaluation draws and seeds, and per scheme its default learning rate, the credit knob
searched second and both grids) and its runs in ``select/`` and ``eval/``. Per setting and scheme
the configuration is chosen by a coordinate search on the selection runs: the learning rate first
(at the knob's default), then the knob at that rate, each by the mean final held-out gold over
the selection seeds; a step whose grid is not complete chooses nothing. A manifest with a
``"search"`` brackets each coordinate (:mod:`datc.study.search`); one without it is the legacy
fixed grid ×0.5/×1/×2, read as it always was. The evaluation table pairs
the chosen configurations, and beside them the default ones, by seed on the evaluation runs only:
a selection seed never enters an evaluation figure, and an evaluation that shares a seed with its
selection is refused. Runs that collapsed in length (METHOD §6) are named in every table.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datc.report.loading import Run, deduplicate, load_run_dirs
from datc.report.statistics import (
    Interval,
    collapsed_seeds,
    same_value,
    t_interval,
)
from datc.run.fingerprint import file_hashes
from datc.study.errors import TuningError
from datc.study.matched import (
    MATCHED_DIR,
    SEARCH_FILE,
    matched_rows,
    read_search,
)
from datc.study.search import bracket_search, diverged_runs, limits
from datc.study.search import on_path as search_on_path

MANIFEST = "tuning.json"
SELECT_DIR, EVAL_DIR = "select", "eval"
LR_FACTORS = (0.5, 1.0, 2.0)  # x the setting's default learning rate, every scheme
KNOB_FACTORS = (0.5, 1.0, 2.0)  # x the knob's default (tau: 0.5, 1, 2), at the chosen rate
# The shared weight step's knob by normalizer (schemes whose output is scores), and a peer's own
# main knob where its weights are its own (output: weights); lam stays 1.
STEP5_KNOBS = {"softmax": "tau", "linear": "alpha", "rank_power": "alpha"}
PEER_KNOBS = {"delta": "tau", "grail": "std", "prob_reweight": "alpha", "entropy_top": "rho"}


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


_same = same_value


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
    rate_step: Any = None  # a bracketing study's (datc.study.search): the rate's and the knob's last Step
    knob_step: Any = None
    diverged: tuple[dict[str, Any], ...] = ()  # its selection runs that diverged (datc.study.search.diverged_runs)

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
    matched: list[tuple[float, Run]] = dataclasses.field(default_factory=list)  # the matched-KL runs (lr, run)
    kl_baseline: str | None = None  # the scheme the matched-KL control ran at other rates (matched.json), if it ran
    kl_requested: tuple[str, ...] = ()  # schemes controlled whatever their gain (matched.json's "requested")

    def control(self, baseline: str) -> list:
        """The matched-KL rows against ``baseline``, where the control ran for it."""
        return matched_rows(self, baseline, self.matched, self.kl_requested) if baseline == self.kl_baseline else []

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


def _inputs(run: Run) -> dict[str, Any] | None:
    """The ``inputs`` of the ``inputs.json`` beside the run's summary (the prepared policy, reward
    model and data files, each file's hash); None without one or where it is not what a run writes."""
    try:
        record = json.loads((Path(run.source).parent / "inputs.json").read_text())
    except (OSError, ValueError):
        return None
    inputs = record.get("inputs") if isinstance(record, dict) else None
    return inputs if isinstance(inputs, dict) else None


def _assets(run: Run) -> dict[str, str] | None:
    """What the run trained on, ``{"reward/model.safetensors": sha256, ...}``; None without it."""
    if (inputs := _inputs(run)) is None:  # not the file a run writes (a list, a number): nothing to check, as without one
        return None
    return file_hashes(inputs)


def reward_models(runs: Iterable[Run]) -> dict[str, int]:
    """The reward models ``runs`` scored with, as their ``inputs.json`` hashes the weights
    (``reward/model.safetensors``; ``sha256`` of the whole file, or "edges": of its size and first
    and last MB, for a large one), with how many runs each; "not recorded" for runs without one."""
    out: dict[str, int] = {}
    for r in runs:
        try:
            meta = (_inputs(r) or {})["reward"]["files"]["model.safetensors"]
            key = f"`{meta['sha256'][:12]}`" + ("" if meta.get("hashed", "whole") == "whole" else f" ({meta['hashed']} hash)")
        except (KeyError, TypeError):
            key = "not recorded"
        out[key] = out.get(key, 0) + 1
    return out


def _asset_keys(runs: Sequence[Run]) -> set[str]:
    """The distinct asset sets of ``runs`` (those with an ``inputs.json``)."""
    return {json.dumps(a, sort_keys=True) for r in runs if (a := _assets(r)) is not None}


def _one_asset_set(groups: Mapping[str, list[Run]], why: str) -> int:
    """Refuses (:class:`TuningError`) a group of runs trained on different assets (a reward model
    prepared again on another machine is another reward model); returns the number of distinct
    asset sets over all groups. Runs without an ``inputs.json`` are not checked."""
    every: set[str] = set()
    for label, runs in groups.items():
        seen: dict[str, Run] = {}
        for r in runs:
            if (a := _assets(r)) is not None:
                seen.setdefault(json.dumps(a, sort_keys=True), r)
        if len(seen) > 1:
            (x, ra), (y, rb) = list(seen.items())[:2]
            ax, ay = json.loads(x), json.loads(y)
            files = sorted(k for k in set(ax) | set(ay) if ax.get(k) != ay.get(k))
            raise TuningError(f"{label}: {ra.run_name} and {rb.run_name} were trained on different assets ({', '.join(files[:3])} "
                              f"differ{': the prepare step made them again, e.g. on another machine' if files else ''}); {why}")
        every |= set(seen)
    return len(every)


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


def _on_path(spec: Mapping[str, Any], lr_chosen: float | None, lr: float, knob: float | None) -> bool:
    """Whether a selection run at (``lr``, ``knob``) is a point of the scheme's coordinate search:
    the rate grid at the knob's default, or the knob grid at the chosen rate."""
    if any(_same(lr, float(x)) for x in spec["lr_grid"]) and _same(knob, spec.get("knob_default")):
        return True
    return (lr_chosen is not None and _same(lr, lr_chosen) and bool(spec.get("knob"))
            and any(_same(knob, float(k)) for k in spec["knob_grid"]))


def read_setting(folder: str | Path, manifest: dict[str, Any] | None = None) -> SettingTuning:
    """One setting's tuned sweep: its manifest, every scheme's candidates and choice, and the
    evaluation runs of the chosen and the default configurations. Refuses (:class:`TuningError`)
    an evaluation that shares a seed with its selection, and runs whose configs differ in more
    than the searched coordinates, the seed and the asset draw."""
    folder = Path(folder)
    m = manifest if manifest is not None else read_manifest(folder)  # datc-study's, before it is written (--plan)
    sel, ev = load_run_dirs([folder / SELECT_DIR]), load_run_dirs([folder / EVAL_DIR])
    warns = [w for w in sel.warnings + ev.warnings if "not a directory" not in w]
    sel_seeds = {int(s) for s in m["selection"]["seeds"]} | {r.seed for r in sel.runs if r.seed is not None}
    eval_seeds = {int(s) for ss in m["evaluation"]["seeds"].values() for s in ss} | {r.seed for r in ev.runs if r.seed is not None}
    if shared := sorted(sel_seeds & eval_seeds):
        raise TuningError(f"{folder}: the evaluation shares seed(s) {', '.join(map(str, shared))} with its selection "
                          "(METHOD §6: evaluate on fresh seeds); refused")
    data, policy = m["setting"]["data"], m["setting"]["policy"]
    n_seeds = len(m["selection"]["seeds"])
    lims = limits(m)  # None: the legacy fixed grid
    diverged = diverged_runs(folder / SELECT_DIR) if lims else []
    rests: dict[str, set[str]] = {}  # the config less the searched coordinates and the scheme's fields: one per setting
    schemes_rest: dict[str, set[str]] = {}  # a scheme's fields less its knob: one per scheme
    schemes, on_path = {}, {}
    for scheme, spec in m["schemes"].items():
        placed: dict[str, list[tuple[Run, float, float | None]]] = {SELECT_DIR: [], EVAL_DIR: []}
        for where, runs in ((SELECT_DIR, sel.runs), (EVAL_DIR, ev.runs)):
            for r in runs:
                if r.credit != scheme:
                    continue
                # the folder names the policy's config (smollm2_135m_instruct), a run the policy's own
                # name (smollm2_135m): one policy per folder is held by the config check below
                if r.data != data:
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
        div = tuple(d for d in diverged if d.get("credit") == scheme)
        steps = (None, None)
        if lims is None:
            lr, knob = _coordinate_search(scheme, spec, cands, n_seeds)
        else:
            lr, knob, *steps = bracket_search(spec, cands, div, m["selection"]["seeds"], lims)
        tuned = _runs_at(placed[EVAL_DIR], lr, knob) if lr is not None and (knob is not None or not spec.get("knob")) else []
        default = _runs_at(placed[EVAL_DIR], float(spec["lr"]), spec.get("knob_default"))
        other = [r for r, x, k in placed[EVAL_DIR] if r not in tuned and r not in default]
        if other:
            warns.append(f"{data} / {policy}, {scheme}: {len(other)} evaluation run(s) of neither the chosen nor the "
                         f"default configuration (e.g. {other[0].run_name}): left out")
        schemes[scheme] = SchemeTuning(scheme, dict(spec), cands, lr, knob, deduplicate(tuned).runs, deduplicate(default).runs,
                                       *steps, div)
        on_path[scheme] = [(r, _on_path(spec, lr, x, k) if lims is None else search_on_path(spec, lims, lr, x, k))
                           for r, x, k in placed[SELECT_DIR]]
    if stray := sorted({r.credit for r in sel.runs + ev.runs} - set(m["schemes"])):
        warns.append(f"{data} / {policy}: runs of scheme(s) {', '.join(stray)} that its {MANIFEST} does not list: left out")
    split = next((v for v in schemes_rest.values() if len(v) > 1), None) or (set(rests) if len(rests) > 1 else None)
    if split:
        a, b = (json.loads(x) for x in list(split)[:2])
        raise TuningError(f"{folder}: runs differ in more than the learning rate, the knob, the seed and the draw "
                          f"(at {', '.join(_differing(a, b)[:6])}); one tuned sweep holds one setting's config")
    try:
        matched, more = _load_matched(folder, m["selection"]["seeds"])
    except ValueError as e:
        raise TuningError(str(e)) from None
    # A scheme's candidates are compared on one set of assets, and so are the runs paired at a seed
    # (the chosen configurations and the matched-KL control's runs; the default configurations
    # apart, which may run in a later batch); different seeds may have different ones (another draw
    # of the same prepare step, as prepare_seed gives). The matched-KL control's search runs of its
    # baseline (off the baseline's grid) choose nothing of the baseline's and may be on other
    # assets; a warning says so, since its proposals then mix them.
    search_baseline = read_search(folder).get("baseline")
    _one_asset_set({f"{data} / {policy}, {s}'s selection": [r for r, on in rs if on or s != search_baseline]
                    for s, rs in on_path.items()}, "a selection compares its candidates on one draw's assets: "
                   "run the scheme's selection again in one prepare cache")
    if search_baseline in on_path:
        grid, off = ([r for r, on in on_path[search_baseline] if on is want] for want in (True, False))
        if _asset_keys(off) - _asset_keys(grid):
            warns.append(f"{data} / {policy}: the matched-KL search's {search_baseline} runs were trained on other assets "
                         f"than {search_baseline}'s grid: the rates it proposed read KLs of both")
    at_seed: dict[str, list[Run]] = {}
    for r in [*(r for sc in schemes.values() for r in sc.tuned), *(r for _, r in matched)]:
        at_seed.setdefault(f"{data} / {policy}, evaluation seed {r.seed} (chosen configurations)", []).append(r)
    for r in (r for sc in schemes.values() for r in sc.default):
        at_seed.setdefault(f"{data} / {policy}, evaluation seed {r.seed} (default configurations)", []).append(r)
    sets = _one_asset_set(at_seed, "the runs paired at a seed must share their assets: run them again in one prepare cache")
    if sets > len(m["evaluation"]["seeds"]):
        warns.append(f"{data} / {policy}: the evaluation's seeds span {sets} sets of assets over "
                     f"{len(m['evaluation']['seeds'])} draw(s) (prepared again between seeds); every pair is within one")
    search = read_search(folder)
    requested = search.get("requested", [])
    if not isinstance(requested, list) or not all(isinstance(x, str) for x in requested):
        raise TuningError(f"{folder / SEARCH_FILE}: \"requested\" is not a list of scheme names ({requested!r}); "
                          "it is the matched-KL search's log: mend or move it aside")
    return SettingTuning(data, policy, m, schemes, warns + more, matched, search.get("baseline"), tuple(requested))


def _load_matched(folder: Path, selection_seeds: Sequence[int]) -> tuple[list[tuple[float, Run]], list[str]]:
    """The runs in ``folder/matched/`` (the matched-KL control's) with their learning rates. A run
    without a known rate is left out with a warning; one on a selection seed is refused
    (:class:`ValueError`)."""
    if not (folder / MATCHED_DIR).is_dir():
        return [], []
    loaded = load_run_dirs([folder / MATCHED_DIR])
    warns = [w for w in loaded.warnings if "not a directory" not in w]
    at: dict[float, list[Run]] = {}  # the folder holds one rate per scheme matched, each at every evaluation seed
    for r in loaded.runs:
        if r.seed in set(selection_seeds):
            raise ValueError(f"{r.source}: a matched-KL evaluation run on selection seed {r.seed} "
                             "(METHOD §6: evaluate on fresh seeds); refused")
        lr = (_identity(r) or {}).get("trainer", {}).get("lr")
        if not isinstance(lr, (int, float)):
            warns.append(f"{r.source}: no run.json with a learning rate beside it: left out of the matched-KL control")
            continue
        at.setdefault(float(lr), []).append(r)
    out = [(lr, r) for lr in sorted(at) for r in deduplicate(at[lr]).runs]  # one run a seed at each rate
    return out, warns


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
