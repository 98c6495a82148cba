"""``datc-compare``'s writing half: every output file of a report, written as one unit. The command
itself (its arguments, ``--tuned``) is :mod:`datc.compare`, above the study room it also reads."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from datc.atomic import atomic_write_bytes, follow_umask, held_lock, umask
from datc.report.plots import plot_credit_accuracy, plot_gold_curves, plot_rm_vs_gold
from datc.report.statistics import Report
from datc.report.tables import latex_table, markdown_table, report_json, runs_csv, summary_markdown


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` so readers see the old or the new content, never a torn file."""
    atomic_write_bytes(path, data)


def write_outputs(report: Report, out: str | Path, warnings: Sequence[str] = ()) -> list[Path]:
    """Write every output file under ``out`` as one unit; returns the paths written (under
    ``out`` as given).

    ``out`` is resolved first: a symbolic link is written through (the link stays the user's), and
    ``.`` names the working directory. The files are rendered, then written into a temporary
    sibling directory (with whatever else ``out`` already held), which replaces ``out`` in one
    rename (Linux's ``RENAME_EXCHANGE`` where available, else two renames), under an exclusive
    lock on ``.<name>.lock`` beside it: two comparisons writing one ``--out`` leave the whole of
    one of them, never a mix. A folder that holds the working directory (``--out .``) or is a
    mount point cannot be swapped: the files are staged inside it, then renamed into place one by
    one (a lock ``.datc-compare.lock`` inside it). Ctrl-C is held off while the outputs are being
    put in place, so they stay whole."""
    given = Path(out)
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
    if given.is_symlink() and not given.exists():
        raise FileNotFoundError(errno.ENOENT, "a broken symbolic link", str(given))
    target = Path(os.path.realpath(given))
    if target.is_dir() and (_holds_cwd(target) or os.path.ismount(target)):
        with _locked(target / IN_PLACE_LOCK):
            write_in_place(target, contents)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target.parent / f".{target.name}.lock"), atomic_dir_swap(target) as tmp:
            for name, data in contents.items():
                write_atomic(tmp / name, data)
    return [given / name for name in contents]


IN_PLACE_LOCK = ".datc-compare.lock"
PUT_IN_PLACE = "the outputs were put in place"  # a Ctrl-C held off until they were


def _holds_cwd(path: Path) -> bool:
    cwd = Path.cwd().resolve()
    return path == cwd or path in cwd.parents


def _locked(path: Path) -> contextlib.AbstractContextManager[None]:
    """The lock file ``path`` held for the block (another comparison waits, seconds) and removed at
    its end, safely (:func:`datc.atomic.held_lock`): no ``.<name>.lock`` stays behind."""
    return held_lock(path)


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """Ctrl-C (SIGINT) held off for the block and raised at its end: the few renames that put
    the outputs in place are never cut half-way. Outside the main thread (no signals): a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt(PUT_IN_PLACE)


def write_in_place(out: Path, contents: dict[str, bytes]) -> None:
    """The files written into a temporary folder inside ``out`` (where a full disk or an error
    stops them, ``out`` untouched), then renamed into ``out`` with Ctrl-C held off."""
    staged = Path(tempfile.mkdtemp(dir=out, prefix=".datc-compare.", suffix=".tmp"))
    try:
        for name, data in contents.items():
            write_atomic(staged / name, data)
        follow_umask(staged)
        with sigint_held():
            for name in contents:
                os.replace(staged / name, out / name)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir_swap(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` holding ``out``'s other files (hard links), that replaces
    ``out`` when the block succeeds (Ctrl-C held off meanwhile); removed if it fails, ``out``
    untouched."""
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
        with sigint_held():
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
