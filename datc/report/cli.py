"""``datc-compare``: read runs, build the report, write every output file."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from datc.report.grouping import adopt_configs, grouped, split_by_config
from datc.report.loading import deduplicate, load_run_dirs, load_runs_csv, load_wandb
from datc.report.plots import plot_credit_accuracy, plot_gold_curves, plot_rm_vs_gold
from datc.report.statistics import Report, build_report
from datc.report.tables import latex_table, markdown_table, report_json, runs_csv, summary_markdown
from datc.run.atomic import atomic_write_bytes, follow_umask, umask


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` so readers see the old or the new content, never a torn file."""
    atomic_write_bytes(path, data)


def write_outputs(report: Report, out: str | Path, warnings: Sequence[str] = ()) -> list[Path]:
    """Write every output file under ``out`` as one unit; returns the paths written.

    The files are rendered, then written into a temporary sibling directory (with whatever else
    ``out`` already held), which replaces ``out`` in one rename (Linux's ``RENAME_EXCHANGE``
    where available, else two renames), under an exclusive lock on ``.<out>.lock`` beside it:
    two comparisons writing one ``--out`` leave the whole of one of them, never a mix."""
    out = Path(out)
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
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / f".{out.name}.lock"), atomic_dir_swap(out) as tmp:
        for name, data in contents.items():
            write_atomic(tmp / name, data)
    return [out / name for name in contents]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits for the other comparison (seconds)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_dir_swap(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` holding ``out``'s other files (hard links), that replaces
    ``out`` when the block succeeds; removed if it fails, ``out`` untouched."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(out))
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        if out.is_dir():
            for p in out.iterdir():
                _carry(p, tmp / p.name)
        yield tmp
        follow_umask(tmp)
        os.chmod(tmp, 0o777 & ~umask())
        if not out.exists():
            os.rename(tmp, out)
        elif _exchange(tmp, out):
            shutil.rmtree(tmp)  # it holds the old outputs now
        else:
            old = tmp.with_name(tmp.name + ".old")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _carry(src: Path, dst: Path) -> None:
    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, dst)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (``renameat2(RENAME_EXCHANGE)``); False where the
    kernel or libc cannot."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


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
    parser = _parser()
    args = parser.parse_args(argv)
    if args.tuned:  # datc/report/tuning.py
        if args.roots or args.runs_csv or args.wandb_project:
            parser.error("--tuned reads the runs of its own ROOT: give no other ROOT, --runs-csv or --wandb-project")
        from datc.report.tuning import compare_tuned

        return print(*compare_tuned(args.tuned, args.out, args.baseline, write_outputs), sep="\n")
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
    warns += split.warnings + unique.warnings
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
    except (FileExistsError, NotADirectoryError, PermissionError) as e:
        print(f"datc-compare: --out {args.out}: cannot write there ({e.strerror or e})", file=sys.stderr)
        raise SystemExit(2) from e
    for path in written:
        print(path)
