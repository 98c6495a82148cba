"""``datc-study --plan``: the cost said before it is spent. Per stage, the runs it starts now (the
finished and diverged ones skipped) and, from the bracketing's and the matched-KL search's worst
case, how many it may start in all; then the estimated core-hours, from the step time this study
measured (``study.jsonl``), else ``--run-seconds``, else the documented figure for the experiment.
Composes only: no run, no file written."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from datc.study.bracket import extra_at_most
from datc.study.jobs import eval_jobs, kl_jobs, knob_jobs, lr_jobs
from datc.study.launch import StudyLauncher, measured_seconds
from datc.study.protocol import Refused
from datc.study.reading import read_setting
from datc.study.search import limits, points

# seconds of one run on one core, as documented (docs/tuned.md: the testbed's four_settings runs)
DOCUMENTED_S = {"four_settings": 30.0}


def _group(jobs: list[Any]) -> str:
    counts = Counter(j.label.rsplit(" seed ", 1)[0] for j in jobs)
    return "; ".join(f"{k} ×{n}" for k, n in counts.items())


def stage_plan(stage: str, m: dict[str, Any], folder: Path, launcher: StudyLauncher, baseline: str,
               requested: tuple[str, ...] = (), defaults: bool = True) -> tuple[int, int, str]:
    """(runs now, runs at most in the stage, the line to print)."""
    n_sel = len(m["selection"]["seeds"])
    n_eval = sum(len(v) for v in m["evaluation"]["seeds"].values())
    st = read_setting(folder, m)
    lims = limits(m)
    schemes = list(m["schemes"])
    knobbed = [s for s in schemes if m["schemes"][s].get("knob")]
    now: list[Any] = []
    try:
        if stage == "lr":
            now = lr_jobs(m, folder, st)
            most = sum(extra_at_most(points(sc.spec, sc.candidates, sc.diverged, m["selection"]["seeds"], lims[0]), lims[0])
                       for sc in st.schemes.values()) * n_sel
        elif stage == "knob":
            now = knob_jobs(m, folder, st)
            most = sum(extra_at_most(points(sc.spec, sc.candidates, sc.diverged, m["selection"]["seeds"], lims[1], sc.lr), lims[1])
                       for sc in st.schemes.values() if sc.spec.get("knob") and sc.lr is not None) * n_sel
        elif stage == "eval":
            now, _ = eval_jobs(m, folder, st, defaults)
            most = len(now)
        else:
            now, _ = kl_jobs(m, folder, st, baseline, write=False, requested=requested)
            most = (len(schemes) - 1) * (int(m["search"]["kl_max_rounds"]) * n_sel + n_eval)
        now = launcher.todo(now)
        most = max(most, len(now))
    except Refused as e:  # the stage waits for the one before: its worst case from the protocol alone
        most = {"lr": len(schemes) * 7 * n_sel, "knob": len(knobbed) * 4 * n_sel, "eval": (2 if defaults else 1) * len(schemes) * n_eval,
                "kl": (len(schemes) - 1) * (int(m["search"]["kl_max_rounds"]) * n_sel + n_eval)}[stage]
        return 0, most, f"stage {stage}: waits for the stage before ({e}); at most {most} runs"
    return len(now), most, f"stage {stage}: {len(now)} runs now ({_group(now) or 'none'}); at most {most} in all"


def print_plan(stages: tuple[str, ...], m: dict[str, Any], folder: Path, launcher: StudyLauncher, baseline: str,
               run_seconds: float | None, requested: tuple[str, ...] = (), defaults: bool = True) -> None:
    total_now = total_most = 0
    print(f"datc-study --plan: {m['setting']['data']} / {m['setting']['policy']} in {folder}, launcher {launcher.name} "
          f"({launcher.parallel} at a time)")
    for stage in stages:
        n, most, line = stage_plan(stage, m, folder, launcher, baseline, requested, defaults)
        total_now, total_most = total_now + n, total_most + most
        print("  " + line)
    seconds, source = run_seconds, "--run-seconds"
    if seconds is None and (seconds := measured_seconds(folder)) is not None:
        source = f"the median of this study's finished runs ({folder / 'study.jsonl'})"
    if seconds is None and (seconds := DOCUMENTED_S.get(m["experiment"])) is not None:
        source = f"the documented figure for {m['experiment']} (docs/tuned.md)"
    cores = _cores(launcher, m)
    if seconds is None:
        print(f"  cost: {total_now} to {total_most} runs; no step time known for {m['experiment']}: give --run-seconds")
        return
    lo, hi = (x * seconds * cores / 3600 for x in (total_now, total_most))
    wall = -(-total_most // max(1, launcher.parallel)) * seconds / 3600
    print(f"  cost: {total_now} to {total_most} runs × {seconds:.0f} s ({source}) × {cores} core(s) = "
          f"{lo:.2f} to {hi:.2f} core-hours; at most {wall:.2f} h of wall clock at {launcher.parallel} at a time")


def _cores(launcher: StudyLauncher, m: dict[str, Any]) -> int:
    lc = launcher.master.hydra.launcher
    if lc.get("cpus_per_task") is not None:
        return int(lc.get("cpus_per_task")) * int(lc.get("tasks_per_node") or 1) * int(lc.get("nodes") or 1)
    threads = next((o.split("=", 1)[1] for o in m["overrides"] if o.startswith("trainer.threads=")), None)
    return int(threads) if threads and threads.isdigit() and int(threads) > 0 else 1
