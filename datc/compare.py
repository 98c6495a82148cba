"""``datc-compare`` / ``python -m datc.compare``: read runs, build the report, write every output file.

The command of :mod:`datc.report` (which reads, aggregates and writes) and, with ``--tuned``, of
:mod:`datc.study`'s tables: it sits above both rooms, so the report stays below the study that runs
``datc-train``'s jobs."""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Sequence

# The report's modules (pandas, matplotlib) are imported in _main, inside main's handler: a Ctrl-C
# in the command's first second is its one line too, not a traceback out of an import.
PUT_IN_PLACE = "the outputs were put in place"  # datc.report.cli's: a Ctrl-C held off until they were


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
        "--runs-csv", action="append", default=[], metavar="CSV",
        help="also read the runs of a runs.csv this tool wrote (runs whose directories are gone; "
        "each takes the config its setting's run directories share); repeatable",
    )
    p.add_argument(
        "--pool", action="append", default=[], metavar="KEY",
        help="a config key whose values may differ within a setting (e.g. prepare_seed: pool the "
        "asset draws; pair them apart by giving each draw its own seeds); repeatable",
    )
    p.add_argument(
        "--tuned", metavar="ROOT",
        help="read a tuned sweep (METHOD §6; docs/tuned.md) instead of ROOTs: the configuration chosen per "
        "setting and scheme, its selection score, and the evaluation table of tuned beside default",
    )
    p.add_argument(
        "--baseline",
        default="grpo",
        help="credit scheme the others are paired against (default: grpo)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> None:
    try:
        _main(argv)
    except KeyboardInterrupt as e:
        done = e.args == (PUT_IN_PLACE,)
        print("datc-compare: interrupted (SIGINT); " + ("the outputs had just been written, whole" if done else
              "nothing was written (what --out held is as it was)"), file=sys.stderr)
        raise SystemExit(130) from None


def _unwritable(out: str, e: OSError) -> SystemExit:
    """One line for an ``--out`` that cannot be written (a file in the way, no permission, a full disk)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        why = "no space left on device (or quota exceeded)"
    else:
        why = f"cannot write there ({e.strerror or e})"
    print(f"datc-compare: --out {out}: {why}; nothing was written (what --out held is as it was)", file=sys.stderr)
    return SystemExit(2)


def _main(argv: Sequence[str] | None) -> None:
    from datc.report.cli import write_outputs
    from datc.report.grouping import adopt_configs, align_curves, grouped, split_by_config
    from datc.report.loading import deduplicate, load_run_dirs, load_runs_csv, load_wandb
    from datc.report.statistics import build_report

    parser = _parser()
    args = parser.parse_args(argv)
    if args.tuned:  # datc/study/reading.py
        if args.roots or args.runs_csv or args.wandb_project:
            parser.error("--tuned reads the runs of its own ROOT: give no other ROOT, --runs-csv or --wandb-project")
        from datc.study.tables import compare_tuned

        try:
            return print(*compare_tuned(args.tuned, args.out, args.baseline, write_outputs), sep="\n")
        except OSError as e:
            raise _unwritable(args.out, e) from None
    if not args.roots and not args.wandb_project and not args.runs_csv:
        parser.error("give at least one ROOT, --runs-csv or --wandb-project")
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
    if args.runs_csv:
        tabled = load_runs_csv(args.runs_csv)
        adopted = adopt_configs(tabled.runs, runs, args.pool)
        runs += adopted.runs
        warns += tabled.warnings + adopted.warnings
    split = split_by_config(runs, args.pool)  # only configs that differ in the scheme and the seed share a setting
    unique = deduplicate(split.runs)
    aligned = align_curves(unique.runs)  # runs of another eval cadence: compared over the steps they share
    warns += split.warnings + unique.warnings + aligned.warnings
    unique = aligned
    if unique.runs and not any(r.credit == args.baseline for r in unique.runs):
        warns.append(f"no run of the baseline scheme {args.baseline!r}: no paired differences")
    for w in warns:
        print(f"datc-compare: warning: {w}", file=sys.stderr)
    if not unique.runs:
        sources = [*args.roots, *args.runs_csv, *([args.wandb_project] if args.wandb_project else [])]
        raise SystemExit(f"datc-compare: no runs found in {', '.join(map(str, sources))}")
    print(f"datc-compare: {grouped(unique.runs)}", file=sys.stderr)
    try:
        written = write_outputs(build_report(unique.runs, args.baseline), args.out, warns)
    except OSError as e:  # a file in the way, no permission, a full disk: one line, nothing half-written
        raise _unwritable(args.out, e) from None
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
