"""``datc-compare``: read runs, build the report, write every output file."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from datc.atomic import atomic_write_bytes
from datc.report.loading import deduplicate, load_run_dirs, load_wandb
from datc.report.plots import plot_credit_accuracy, plot_gold_curves, plot_rm_vs_gold
from datc.report.statistics import Report, build_report
from datc.report.tables import latex_table, markdown_table, report_json, runs_csv, summary_markdown


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
    try:
        written = write_outputs(build_report(unique.runs, args.baseline), args.out, warns)
    except (FileExistsError, NotADirectoryError, PermissionError) as e:
        print(f"datc-compare: --out {args.out}: cannot write there ({e.strerror or e})", file=sys.stderr)
        raise SystemExit(2) from e
    for path in written:
        print(path)
