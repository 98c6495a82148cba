"""``datc-study`` / ``python -m datc.study``: METHOD §6's tuned comparison of one setting, end to end.

    datc-study --policy tiny_gpt2 --data keywords --schemes grpo,oracle,datc --stage all trainer.threads=1
    datc-study ... --stage all hydra/launcher=joblib hydra.launcher.n_jobs=2       # two at a time
    datc-study ... --stage all hydra/launcher=slurm hydra.launcher.partition=gpu   # a Slurm cluster
    datc-study ... --stage lr --plan                                               # the cost, nothing run
    datc-compare --tuned runs/tuned/keywords-tiny_gpt2 --out results/tuned/keywords-tiny_gpt2

Stages (``all``: in order): ``lr`` (each scheme's learning rate by the bracketing rule, at its
knob's default, on the selection seeds), ``knob`` (the knob at the chosen rate, likewise),
``eval`` (the chosen configurations, then the moved schemes' defaults, on the evaluation seeds),
``kl`` (the matched-KL control at ±5%). A finished run is skipped and a cut one resumes; a stage
whose inputs are incomplete is refused in one line (exit 2). Runs go through the launcher Hydra
is configured with (``hydra/...`` arguments); other ``key=value`` arguments go to every run.
Before the first run it starts, the files this machine prepares are checked against those the
finished runs trained on (``datc.study.assets``). Exit status: 0 done, 1 a run failed (named; run the stage
again: it resumes), 2 refused before any run, 130 interrupted. docs/study.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from datc.study.protocol import STAGES, Refused, check_seeds_and_overrides, seeds, split_overrides
from datc.study.reading import TuningError

MAX_ROUNDS = 16  # rounds of one stage at most (the bracketing needs at most 7, the KL search 6 + 1)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="datc-study", description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", required=True, help="policy config (e.g. tiny_gpt2)")
    p.add_argument("--data", required=True, help="data config (e.g. keywords)")
    p.add_argument("--schemes", required=True, help="comma-separated credit configs, the baseline among them")
    p.add_argument("--stage", choices=[*STAGES, "all"], required=True)
    p.add_argument("--plan", action="store_true", help="print the runs the stage(s) will start and their cost; run nothing")
    p.add_argument("--root", default="runs/tuned", help="the studies' root; one folder per setting below it")
    p.add_argument("--experiment", default="four_settings")
    p.add_argument("--baseline", default="grpo", help="the scheme the matched-KL control runs at other rates")
    p.add_argument("--kl-schemes", default="",
                   help="comma-separated schemes whose matched-KL control runs whatever their gain (METHOD §6 runs it for "
                        "every resolved gain; a loss at equal tuning may be a smaller step, not worse credit); remembered")
    p.add_argument("--select-draw", type=int, default=0, help="prepare_seed of the selection runs")
    p.add_argument("--select-seeds", type=seeds, default=seeds("100,101"))
    p.add_argument("--eval-draws", default="0,1,2", help="prepare_seeds of the evaluation, the seeds split evenly among them")
    p.add_argument("--eval-seeds", type=seeds, default=seeds("200-205"))
    p.add_argument("--batch-size", type=int, default=None,
                   help="jobs handed to the launcher per call (submitit_local starts a whole call at once)")
    p.add_argument("--run-seconds", type=float, default=None, help="--plan: one run's wall time, if this study measured none")
    p.add_argument("--defaults-later", action="store_true",
                   help="stage eval: the chosen configurations only; the default ones (shown beside them in the tables) "
                        "wait for an invocation without this flag (a long study's claims first)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep finished runs' checkpoints and final weights (removed by default, after each batch)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="hydra/...: the launcher; anything else: every run")
    return p


def main(argv: list[str] | None = None) -> None:
    try:
        code = _main(argv)
    except (Refused, TuningError) as e:
        print(f"datc-study: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt as e:
        print(f"datc-study: interrupted{': ' + str(e) if str(e) else ''}; run the same command again to resume", file=sys.stderr)
        code = 130
    raise SystemExit(code)


def _main(argv: list[str] | None) -> int:
    import os

    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    from datc.paths import CONFIG_DIR
    from datc.study.assets import check_assets
    from datc.study.launch import StudyLauncher, StudyLock, say
    from datc.study.plan import print_plan
    from datc.study.protocol import merge_manifest, new_manifest, scheme_spec, write_manifest
    from datc.training.job import hydra_error_line

    args = _parser().parse_intermixed_args(argv)  # options and KEY=VALUE in any order
    os.environ["HYDRA_FULL_ERROR"] = "1"
    folder = Path(args.root).absolute() / f"{args.data}-{args.policy}"
    task, hydra_args = split_overrides(args.overrides)
    draws = [int(d) for d in args.eval_draws.split(",")]
    check_seeds_and_overrides(args.select_seeds, args.eval_seeds, draws, task)
    schemes = [s for s in args.schemes.split(",") if s]
    stages = STAGES if args.stage == "all" else (args.stage,)
    # the jobs are datc-train's: named "train", their Hydra log is the run directory's train.log,
    # which a run directory may hold before its run starts (a library that logs on import, vLLM's,
    # creates it then); any other file there is refused as not a datc run
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="train"):
        launcher = StudyLauncher(hydra_args, folder, args.batch_size, args.keep_checkpoints)
        specs = {}
        for s in schemes:
            try:
                cfg = launcher.loader.load_configuration(
                    config_name="train", run_mode=_run_mode(),
                    overrides=[f"experiment={args.experiment}", f"policy={args.policy}", f"data={args.data}", f"credit={s}", *task])
            except HydraException as e:
                raise Refused(hydra_error_line(e)) from None
            specs[s] = scheme_spec(cfg)
        if "kl" in stages and args.baseline not in specs and args.stage == "kl":
            raise Refused(f"--stage kl: the baseline {args.baseline} is not among --schemes")
        if bad := [s for s in kl_schemes(args) if s not in specs or s == args.baseline]:
            raise Refused(f"--kl-schemes: {', '.join(bad)}: not among --schemes other than the baseline {args.baseline} "
                          f"(choose from {', '.join(s for s in specs if s != args.baseline)})")
        m, note = merge_manifest(folder, new_manifest(args.data, args.policy, args.experiment, task, args.select_draw,
                                                      args.select_seeds, draws, args.eval_seeds, specs))
        if note:
            print(f"datc-study: {note}", file=sys.stderr)
        if len(args.eval_seeds) < 6:
            print(f"datc-study: warning: {len(args.eval_seeds)} evaluation seeds; METHOD §6 asks for at least 6 pairs",
                  file=sys.stderr)
        if args.plan:
            print_plan(stages, m, folder, launcher, args.baseline, args.run_seconds, kl_schemes(args),
                       defaults=not args.defaults_later)
            return 0
        lock = StudyLock(folder)
        try:
            write_manifest(folder, m)
            return _run_stages(stages, m, folder, launcher, args,
                               lambda: check_assets(folder, lambda draw: _run_config(launcher, m, folder, draw), say=say))
        finally:
            lock.close()


def kl_schemes(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(s for s in args.kl_schemes.split(",") if s)


def _run_config(launcher, m: dict, folder: Path, draw: int):
    """The validated config of this study's runs of one draw (what its assets depend on)."""
    from omegaconf import open_dict

    from datc.checks import validate
    from datc.study.jobs import base
    from datc.study.reading import SELECT_DIR

    c = launcher.compose([*base(m, folder, SELECT_DIR), f"prepare_seed={draw}"])
    with open_dict(c):
        c.pop("hydra", None)
    return validate(c)


def _run_mode():
    from hydra.types import RunMode

    return RunMode.RUN


def _run_stages(stages: tuple[str, ...], m: dict, folder: Path, launcher, args: argparse.Namespace,
                check: Callable[[], None] | None = None) -> int:
    """The stages in order; ``check`` once, before the first run starts (the prepared files)."""
    from datc.study.jobs import eval_jobs, kl_jobs, knob_jobs, lr_jobs
    from datc.study.launch import prune_checkpoints, say
    from datc.study.matched import MATCHED_DIR
    from datc.study.reading import EVAL_DIR, SELECT_DIR, read_setting

    if not args.keep_checkpoints:  # runs that finished under a driver stopped before its batch ended
        prune_checkpoints(folder, (SELECT_DIR, EVAL_DIR, MATCHED_DIR))
    for stage in stages:
        if stage == "kl" and args.baseline not in m["schemes"]:
            say(f"stage kl: no matched-KL control without the baseline {args.baseline} in the study")
            continue
        said: set[str] = set()
        for rnd in range(1, MAX_ROUNDS + 1):
            st = read_setting(folder, m)
            notes: list[str] = []
            if stage == "lr":
                jobs = lr_jobs(m, folder, st)
            elif stage == "knob":
                jobs = knob_jobs(m, folder, st)
            elif stage == "eval":
                jobs, notes = eval_jobs(m, folder, st, defaults=not args.defaults_later)
            else:
                jobs, notes = kl_jobs(m, folder, st, args.baseline, requested=kl_schemes(args))
            for n in notes:
                if n not in said:
                    say(f"stage {stage}: {n}")
                    said.add(n)
            todo = launcher.todo(jobs)
            say(f"stage {stage}, round {rnd}: {len(todo)} to run ({len(jobs) - len(todo)} finished, skipped), "
                f"launcher {launcher.name}")
            if not todo:
                break
            if check is not None:
                check()
                check = None
            failed = launcher.launch(todo)
            if not args.keep_checkpoints:
                prune_checkpoints(folder, (SELECT_DIR, EVAL_DIR, MATCHED_DIR))
            if failed:
                for j in failed:
                    say(f"stage {stage}: {j.label} failed ({j.run_dir}, job {j.measure.get('job_id')}): {j.error}")
                say(f"stage {stage}: {len(failed)} of {len(todo)} runs failed; run the stage again: it resumes")
                return 1
        else:
            say(f"stage {stage}: still runs to do after {MAX_ROUNDS} rounds; run the stage again")
    return 0
