"""The tuned comparison's tables (``datc-compare --tuned``): per setting the choices, the
selection scores, the evaluation table, the matched-KL control and every candidate, as Markdown
(:func:`tuned_markdown`) and JSON (:func:`tuned_json`), made from :mod:`datc.study.reading`'s
reading of a sweep."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from datc.report.loading import Run
from datc.report.statistics import (
    Report,
    build_report,
    collapsed_seeds,
    detectable_difference,
    paired_difference,
    t_interval,
)
from datc.report.tables import MIN_INTERVAL_N, _interval_text, collapse_note
from datc.study.bracket import lattice_k
from datc.study.matched import MatchedRow, matched_json, matched_markdown
from datc.study.reading import (
    MANIFEST,
    Candidate,
    SchemeTuning,
    SettingTuning,
    TuningError,
    _same,
    find_settings,
    read_setting,
    reward_models,
)
from datc.study.search import limits, on_path, points, step_text


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
    rms = reward_models([*(r for sc in st.schemes.values() for r in (*sc.tuned, *sc.default)), *(r for _, r in st.matched)])
    lines = [
        f"## {st.setting}", "",
        f"Selection: draw {m['selection']['prepare_seed']}, seeds {_seeds_text(m['selection']['seeds'])}. "
        f"Evaluation (selection seeds left out of every figure below): {_seeds_text(m['evaluation']['seeds'])}. "
        f"Reward model(s) of the evaluation runs (`model.safetensors` as each run's `inputs.json` hashes it): "
        + (", ".join(f"{k} ({n} runs)" for k, n in sorted(rms.items())) or "no evaluation run yet") + ".", "",
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
    if lims := limits(m):
        lines += ["", "Search (METHOD §6, bracketing): the lattice points each coordinate needed, and how it ended "
                  "(bracketed: the best point has a tried neighbour on each side).", "",
                  "| scheme | learning rate: points tried | knob: points tried |", "|---|---|---|"]
        for name in order:
            sc = st.schemes[name]
            sel = m["selection"]["seeds"]
            rate = step_text(points(sc.spec, sc.candidates, sc.diverged, sel, lims[0]), sc.rate_step)
            knob = "no knob" if not sc.spec.get("knob") else step_text(
                points(sc.spec, sc.candidates, sc.diverged, sel, lims[1], sc.lr) if sc.lr is not None else None, sc.knob_step)
            lines.append(f"| {name} | {rate} | {knob} |")
    control = st.control(baseline)
    if power := _power_lines(st, baseline, control):
        lines += ["", "Power of each comparison (paired by seed): the 95% half-width reached and the smallest "
                  "difference such a test detects 80% of the time at this number of pairs and the observed spread "
                  "of the differences:", "", *power]
    if table := matched_markdown(control, baseline, float(base.spec["lr"]) if base else 1.0):
        lines += ["", table.rstrip("\n")]
    lines += ["", "Every candidate on the selection seeds:", "",
              "| scheme | configuration | search step | mean final gold (selection) |", "|---|---|---|---|"]
    for name in order:
        sc = st.schemes[name]
        lines += [f"| {name} | {sc.label(c.lr, c.knob)} | {_step(sc, c, name == st.kl_baseline, limits(m))} | {_score_text(c, n_sel)} |"
                  for c in sc.candidates]
    return "\n".join(lines) + "\n"


def _power_lines(st: SettingTuning, baseline: str, control: Sequence[MatchedRow] = ()) -> list[str]:
    """Per scheme: the tuned comparison's power, then the matched-KL control's where it has pairs."""
    base = st.schemes.get(baseline)
    if base is None or not base.tuned:
        return []
    at_matched = {r.scheme: r.vs_matched.diff for r in control if r.vs_matched is not None and r.vs_matched.seeds}
    out = []
    for name in sorted(s for s in st.schemes if s != baseline):
        for what, d in ((f"{name} − {baseline}", paired_difference(st.schemes[name].tuned, base.tuned, "final_gold").diff),
                        (f"{name} − {baseline} at matched KL", at_matched.get(name))):
            if d is not None and (mde := detectable_difference(d)) is not None:
                out.append(f"- {what}: {d.n} pairs, ±{d.half_width:.3f}; detectable: {mde:.3f}")
    return out


def _step(sc: SchemeTuning, c: Candidate, searched: bool = False, lims=None) -> str:
    """Where a candidate lies on the search: the rate grid (a bracketing study: its lattice), the knob
    grid at the chosen rate, or off it."""
    if lims is None:
        on_rate = _same(c.knob, sc.spec.get("knob_default")) and any(_same(c.lr, x) for x in sc.spec["lr_grid"])
        on_knob = sc.lr is not None and _same(c.lr, sc.lr) and any(_same(c.knob, x) for x in sc.spec.get("knob_grid") or [])
    else:
        on_rate = on_path(sc.spec, lims, None, c.lr, c.knob)
        kk = lattice_k(c.knob, sc.spec.get("knob_default")) if sc.spec.get("knob") else None
        on_knob = sc.lr is not None and _same(c.lr, sc.lr) and kk is not None and lims[1].lo <= kk <= lims[1].hi
    off = "matched-KL search (not eligible)" if searched else "off the search path (not eligible)"
    where = " and ".join(w for w, ok in (("rate", on_rate), ("knob", on_knob)) if ok) or off
    return where + (" (chosen)" if sc.chosen is c else "")


LEGEND = (
    "METHOD §6's tuned comparison. Per setting and scheme: the configuration chosen by the coordinate search "
    "(learning rate ×0.5/×1/×2 of the default at the knob's default, then the knob ×0.5/×1/×2 at that rate), by mean "
    "final held-out gold on the selection seeds; its selection score and the default's; then, on the evaluation seeds "
    "only, final held-out gold (mean ± 95% t half-width over seeds; below 3 values the mean and its n) and the difference "
    "to the baseline paired by seed, tuned against tuned and default against default (bold where the interval excludes "
    "zero). (k collapsed: seeds ...): runs with a length collapse (METHOD §6), kept in the means and named here."
)


LEGEND_BRACKET = LEGEND.replace(
    "(learning rate ×0.5/×1/×2 of the default at the knob's default, then the knob ×0.5/×1/×2 at that rate)",
    "(learning rate ×0.5/×1/×2 of the default at the knob's default, extended by ×2 beyond an end that is best, up to "
    "×32 or ×1/32, until the best point is bracketed; then the knob likewise at that rate, up to ×8 or ×1/8)")


def tuned_markdown(settings: Sequence[SettingTuning], baseline: str) -> str:
    legend = LEGEND_BRACKET if any(limits(s.manifest) for s in settings) else LEGEND
    return "# Tuned comparison\n\n" + legend + "\n\n" + "\n".join(setting_markdown(s, baseline) for s in settings)


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
        "matched_kl": matched_json(st.control(baseline)),
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
    from datc.atomic import atomic_write_text

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
    if out.exists() and not out.is_dir():  # before anything is written: nothing half-written
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(out))
    written = []
    picked = {sub: _relabel(r for st in settings for sc in st.schemes.values() for r in pick(sc))
              for sub, pick in (("evaluation", lambda sc: sc.tuned), ("default", lambda sc: sc.default))}
    stale = [out / sub for sub, runs in picked.items() if not runs and stale_outputs(out / sub)]
    for sub, runs in picked.items():
        if runs:
            written += write_outputs(build_report(runs, baseline), out / sub, warns)
    atomic_write_text(out / "tuned.json", tuned_json(settings, warns, baseline))
    atomic_write_text(out / "tuned.md", tuned_markdown(settings, baseline))
    for folder in stale:
        remove_outputs(folder)
        print(f"datc-compare: warning: removed {folder}: an earlier comparison's tables, and this sweep has no "
              f"{folder.name} runs to put there", file=sys.stderr)
    return [*written, out / "tuned.json", out / "tuned.md"]


# What datc-compare writes into an output folder (datc.report.cli.write_outputs)
COMPARE_OUTPUTS = {"table.md", "table.tex", "summary.md", "runs.csv", "report.json", "gold_curves.png",
                   "credit_accuracy.png", "rm_vs_gold.png"}


def stale_outputs(folder: Path) -> bool:
    """Whether ``folder`` (``OUT/default/`` or ``OUT/evaluation/``, which this comparison has no
    runs for) holds an earlier comparison's outputs, to be removed so they do not sit beside this
    comparison's ``tuned.md``; a refusal (exit 2, nothing written) where it holds anything else."""
    if not folder.exists() and not folder.is_symlink():
        return False
    names = {p.name for p in folder.iterdir()} if folder.is_dir() else None
    if names is None or not names <= COMPARE_OUTPUTS:
        print(f"datc-compare: --out: {folder} holds files datc-compare did not write, and this sweep has no "
              f"{folder.name} runs to replace them with; move it aside or choose another --out (nothing written)",
              file=sys.stderr)
        raise SystemExit(2)
    return True


def remove_outputs(folder: Path) -> None:
    """``folder``'s outputs removed (moved aside first, so no half-removed folder stays)."""
    import shutil
    import tempfile

    from datc.atomic import held_lock

    with held_lock(folder.parent / f".{folder.name}.lock"):  # not while another comparison writes it
        if not folder.is_dir() or not {p.name for p in folder.iterdir()} <= COMPARE_OUTPUTS:
            return
        aside = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".old"))
        os.rename(folder, aside / "x")
        shutil.rmtree(aside, ignore_errors=True)
