"""Each stage's jobs, read from the study's finished runs (:func:`datc.study.reading.read_setting`,
the reading ``datc-compare --tuned`` makes its tables with):

- ``lr``: per scheme, the rate lattice points :func:`datc.study.bracket.bracket_step` needs, at the
  knob's default, on the selection draw and seeds (one round; the driver runs rounds until every
  scheme's rate is decided);
- ``knob``: at each scheme's chosen rate, the knob lattice points needed (refused while a rate is
  undecided);
- ``eval``: each scheme's chosen configuration on the evaluation draws and seeds, seed by seed, then
  the default configurations of the schemes whose choice moved;
- ``kl``: one round of the matched-KL search (:func:`datc.study.kl_search.kl_step`) per resolved
  gain on the selection seeds, and the matched rates on the evaluation seeds into ``matched/``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from datc.report.statistics import same_value
from datc.study.bracket import factor
from datc.study.kl_search import kl_step
from datc.study.launch import Job
from datc.study.matched import MATCHED_DIR, matched_rows, read_search, within, write_search
from datc.study.protocol import RUN_NAME, Refused, override_key
from datc.study.reading import EVAL_DIR, MANIFEST, SELECT_DIR, SettingTuning


def _num(x: float) -> str:
    return repr(float(x))


EVAL_CACHE = ".eval_cache"  # the setting's step-0 evaluations, shared by its runs (trainer.eval_cache)


def base(m: dict[str, Any], folder: Path, where: str) -> list[str]:
    """Every task override of a job of this study (the launcher replays only its own arguments).
    Every run of a setting starts from the same weights and evaluates the same prompts, so they
    share one step-0 evaluation (``trainer.eval_cache``, not in a run's identity; an override of
    the study's own ``trainer.eval_cache``, ``null`` included, takes its place)."""
    s = m["setting"]
    own = any(override_key(o) == "trainer.eval_cache" for o in m["overrides"])
    return [f"experiment={m['experiment']}", f"policy={s['policy']}", f"data={s['data']}", RUN_NAME,
            f"hydra.sweep.dir={folder / where}", *([] if own else [f"trainer.eval_cache={folder / EVAL_CACHE}"]),
            *m["overrides"]]


def config(scheme: str, spec: dict[str, Any], lr: float | None = None, knob: float | None = None) -> list[str]:
    """The overrides of a configuration: none beyond the scheme at its defaults."""
    out = [f"credit={scheme}"]
    if lr is not None and not same_value(lr, spec["lr"]):
        out.append(f"trainer.lr={_num(lr)}")
    if spec.get("knob") and knob is not None and not same_value(knob, spec["knob_default"]):
        out.append(f"{spec['knob']}={_num(knob)}")
    return out


def selection(m: dict[str, Any], folder: Path, scheme: str, spec: dict[str, Any], lr: float, knob: float | None,
              what: str) -> list[Job]:
    draw = m["selection"]["prepare_seed"]
    return [Job([*base(m, folder, SELECT_DIR), *config(scheme, spec, lr, knob), f"prepare_seed={draw}", f"seed={s}"],
                f"{scheme} {what} seed {s}") for s in m["selection"]["seeds"]]


def _not_decided(st: SettingTuning, scheme: str, what: str) -> Refused:
    sc = st.schemes[scheme]
    n = sum(len(c.seeds) for c in sc.candidates)
    return Refused(f"{st.setting}, {scheme}: the {what} search is not complete ({n} selection run(s) finished); "
                   f"run --stage {'lr' if what == 'rate' else 'knob'} first (it resumes where it stopped)")


def lr_jobs(m: dict[str, Any], folder: Path, st: SettingTuning) -> list[Job]:
    jobs = []
    for s, sc in st.schemes.items():
        if sc.rate_step is not None and not sc.rate_step.done:
            for k in sc.rate_step.needed:
                jobs += selection(m, folder, s, sc.spec, sc.spec["lr"] * 2.0 ** k, sc.spec.get("knob_default"), f"lr {factor(k)}")
    return jobs


def knob_jobs(m: dict[str, Any], folder: Path, st: SettingTuning) -> list[Job]:
    jobs = []
    for s, sc in st.schemes.items():
        if not sc.spec.get("knob") or (sc.rate_step.done and sc.rate_step.chosen is None):
            continue
        if sc.lr is None:
            raise _not_decided(st, s, "rate")
        if not sc.knob_step.done:
            for k in sc.knob_step.needed:
                jobs += selection(m, folder, s, sc.spec, sc.lr, sc.spec["knob_default"] * 2.0 ** k,
                                  f"lr ×{sc.lr / sc.spec['lr']:g} {sc.spec['knob']} {factor(k)}")
    return jobs


def eval_jobs(m: dict[str, Any], folder: Path, st: SettingTuning, defaults: bool = True) -> tuple[list[Job], list[str]]:
    """The chosen configurations first (the claim rests on them), then the default ones of the
    schemes whose choice moved (without ``defaults``: left for a later invocation, said in the
    notes); each phase seed by seed, every scheme's run at a seed one after the other (a batch cut
    between two seeds leaves whole chosen pairs). Also the schemes left out."""
    tuned, moved, left = [], [], []
    for s, sc in st.schemes.items():
        if sc.rate_step is not None and sc.rate_step.done and sc.rate_step.chosen is None:
            left.append(f"{s}: no usable learning rate ({'; '.join(sc.rate_step.edges)}): not evaluated")
            continue
        if sc.lr is None:
            raise _not_decided(st, s, "rate")
        if sc.spec.get("knob") and sc.knob is None:
            raise _not_decided(st, s, "knob")
        tuned.append((s, config(s, sc.spec, sc.lr, sc.knob)))
        if len(tuned[-1][1]) > 1:
            moved.append((s, [f"credit={s}"]))
    at_seeds = [(draw, seed) for draw, ss in m["evaluation"]["seeds"].items() for seed in ss]
    jobs = []
    for phase, configs in (("chosen", tuned), ("default", moved)):
        if phase == "default" and not defaults:
            if moved:
                left.append(f"the default configurations' evaluation ({', '.join(s for s, _ in moved)}) waits: "
                            "--defaults-later (an invocation without it runs what is missing)")
            continue
        for draw, seed in at_seeds:
            jobs += [Job([*base(m, folder, EVAL_DIR), *c, f"prepare_seed={draw}", f"seed={seed}"],
                         f"{s} {phase} draw {draw} seed {seed}") for s, c in configs]
    return jobs, left


def kl_jobs(m: dict[str, Any], folder: Path, st: SettingTuning, baseline: str, write: bool = True,
            requested: Sequence[str] = ()) -> tuple[list[Job], list[str]]:
    """One round of the matched-KL control (METHOD §6): per resolved gain without a matched rate (and
    per scheme in ``requested`` or asked for before, whatever its gain: kept in the log), the
    search's rate in flight (asked, not finished on every selection seed) or :func:`kl_step`'s next
    one; per matched rate, its evaluation runs not yet finished. The search's log is ``matched.json``
    (per scheme its target, the rates tried, why it stopped). Returns the jobs and notes."""
    if baseline not in st.schemes:
        raise Refused(f"--stage kl: the baseline {baseline} is not a scheme of {folder / MANIFEST}")
    n_eval = sum(len(v) for v in m["evaluation"]["seeds"].values())
    usable = [s for s, sc in st.schemes.items() if not (sc.rate_step is not None and sc.rate_step.done and sc.rate_step.chosen is None)]
    if short := [s for s in usable if st.schemes[s].chosen is None or len(st.schemes[s].tuned) < n_eval]:
        raise Refused(f"--stage kl: the evaluation is not complete for {', '.join(short)} "
                      f"(of {n_eval} evaluation seeds); run --stage eval first (it resumes where it stopped)")
    if bad := [s for s in requested if s not in st.schemes or s == baseline]:
        raise Refused(f"--kl-schemes: {', '.join(bad)}: not a scheme of {folder / MANIFEST} other than the baseline "
                      f"{baseline} (choose from {', '.join(s for s in st.schemes if s != baseline)})")
    search, jobs, notes, asked = read_search(folder), [], [], []
    search["requested"] = sorted({*search.get("requested", []), *requested})
    base_sc = st.schemes[baseline]
    spec, sel = base_sc.spec, set(m["selection"]["seeds"])
    s_cfg = m["search"]
    tol, rounds_max = float(s_cfg["kl_tolerance"]), int(s_cfg["kl_max_rounds"])
    bounds = (spec["lr"] * 2.0 ** s_cfg["lr_exp"][0], spec["lr"] * 2.0 ** s_cfg["lr_exp"][1])
    kd = spec.get("knob_default")
    points: dict[float, float | None] = {c.lr: c.kl.mean for c in base_sc.candidates
                                         if same_value(c.knob, kd) and set(c.seeds) >= sel and c.kl.mean is not None}
    div: dict[float, set[int]] = {}
    for d in base_sc.diverged:
        div.setdefault(float(d["lr"]), set()).add(int(d["seed"]))
    for lr, seeds in div.items():
        done = next((set(c.seeds) for c in base_sc.candidates if same_value(c.lr, lr) and same_value(c.knob, kd)), set())
        if seeds | done >= sel:
            points[lr] = None

    def complete(lr: float) -> bool:
        return any(same_value(lr, x) for x in points)

    def at(lr: float, what: str) -> list[Job]:
        return selection(m, folder, baseline, spec, lr, kd, what)

    for row in sorted(matched_rows(st, baseline, st.matched, search["requested"]), key=lambda r: r.target_kl):
        entry = search.get(row.scheme)
        if not isinstance(entry, dict) or not same_value(entry.get("target_kl"), row.target_kl):
            old = [entry] if isinstance(entry, dict) else []
            entry = search[row.scheme] = {"target_kl": row.target_kl, "tried": [],
                                          **({"history": old + entry.get("history", [])} if old else {})}
        if row.lr is not None:
            have = {r.seed for r in row.matched}
            jobs += [Job([*base(m, folder, MATCHED_DIR), *config(baseline, spec, row.lr), f"prepare_seed={d}", f"seed={x}"],
                         f"{baseline} matched lr {row.lr:g} for {row.scheme} seed {x}")
                     for d, xs in m["evaluation"]["seeds"].items() for x in xs if x not in have]
            continue
        if entry.get("stopped"):
            continue
        if flight := [lr for lr in entry["tried"] if not complete(lr)]:
            jobs += at(flight[-1], f"lr {flight[-1]:g} (KL search for {row.scheme})")
            continue
        if any(within(row.target_kl, t, tol) for t in asked):
            continue  # a target within the tolerance of one searched for in this round waits for its runs
        step = kl_step(sorted(points.items()), row.target_kl, len(entry["tried"]), tol=tol, max_rounds=rounds_max,
                       bounds=bounds)
        if step.stopped:
            entry["stopped"] = step.stopped
            notes.append(f"{st.setting}, {row.scheme}: the matched-KL search stopped: {step.stopped}")
        elif step.propose is not None:
            asked.append(row.target_kl)
            entry["tried"].append(step.propose)
            jobs += at(step.propose, f"lr {step.propose:g} (KL search for {row.scheme})")
    search["baseline"] = baseline
    if write:  # --plan writes nothing
        write_search(folder, search)
    return jobs, notes
