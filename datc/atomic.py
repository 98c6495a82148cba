"""Atomic file and directory writes (no torch import, so light tools can use them).

Files and folders are created with the user's umask, as ``open`` and ``mkdir`` would create
them (``tempfile`` alone would leave them 0600 / 0700, unreadable to colleagues on a shared
folder)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def umask() -> int:
    """The process's umask, read without changing it where ``/proc`` says it (Linux >= 4.7);
    elsewhere set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write a file so that readers see either the old or the new content, never a torn one:
    a temporary sibling, fsync, then ``os.replace``. The file gets ``0o666 & ~umask``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def append_line(path: str | Path, line: str) -> None:
    """Append one line (``line`` ends with a newline) so that it is in the file whole or not at
    all: a single ``os.write`` of the full line, and if the disk fills mid-line (a short write
    or ENOSPC) the file is cut back to where it was and the error raised."""
    data = line.encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # mode: 0o666 & ~umask
    try:
        size = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"only {written} of {len(data)} bytes written (disk full?)", str(path))
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)  # never leave a torn row behind
            raise
    finally:
        os.close(fd)


def follow_umask(root: str | Path) -> None:
    """Give every file and folder under ``root`` the modes ``open`` and ``mkdir`` would under the
    user's umask (files ``0o666``, executables and folders ``0o777``, less the umask). Libraries
    do not all follow it: safetensors creates ``model.safetensors`` 0600, unreadable to
    colleagues on a shared folder."""
    mask = umask()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            mode = os.stat(p).st_mode
            os.chmod(p, (0o777 if mode & 0o100 else 0o666) & ~mask)
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o777 & ~mask)


EXIST = ("keep", "replace", "refuse")


@contextlib.contextmanager
def atomic_dir(path: str | Path, exist: str = "keep") -> Iterator[Path]:
    """Yield a temporary sibling directory that is renamed to ``path`` when the block succeeds
    (mode ``0o777 & ~umask``, and everything written into it by the user's umask too, whatever
    mode the library that wrote it chose: :func:`follow_umask`).

    ``exist`` says what a ``path`` that exists means, decided once, never guessed:

    - ``keep``: a cache entry by key: another writer finished the same content first; it wins and
      ours is discarded (the prepare step's assets, a file out of a wheel);
    - ``replace``: ours replaces a directory there (moved aside, ours renamed in, the old one
      removed); a file there is refused;
    - ``refuse``: ``FileExistsError`` before anything is written (and again if one appeared
      meanwhile); an empty directory counts as free.
    """
    if exist not in EXIST:
        raise ValueError(f"exist must be one of {EXIST}, got {exist!r}")
    path = Path(path)

    def taken() -> bool:
        if path.is_dir() and not path.is_symlink():
            return exist == "refuse" and any(path.iterdir())
        if path.exists() or path.is_symlink():
            return exist != "keep"
        return False

    if taken():
        raise FileExistsError(f"{path} exists; nothing was written there")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        os.chmod(tmp, 0o777 & ~umask())
        yield tmp
        follow_umask(tmp)
        if taken():
            raise FileExistsError(f"{path} appeared while it was being written; ours was discarded")
        if exist != "keep" and path.is_dir() and not path.is_symlink():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
            os.rename(path, old / "x")  # aside, then ours in: the path is never half-written
            try:
                os.rename(tmp, path)
            except BaseException:  # an error, or a Ctrl-C between the two renames: the old one back
                if not path.exists():
                    os.rename(old / "x", path)
                shutil.rmtree(old, ignore_errors=True)
                raise
            shutil.rmtree(old, ignore_errors=True)
            return
        try:
            os.rename(tmp, path)
        except OSError:
            if not path.exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def held_lock(path: str | Path, wait: bool = True) -> Iterator[None]:
    """An exclusive ``flock`` on the file ``path`` for the block (``wait=False``: a
    ``BlockingIOError`` at once where another process holds it), the file removed at the block's
    end so no lock file stays behind.

    Removing it never lets two holders in: the holder unlinks the file while it still holds the
    lock, after its work; a process that was waiting on the removed file then takes a lock on a
    file no longer at ``path``, sees so (``samestat``) and starts again on the file now there,
    which every later process locks too."""
    import fcntl

    path = Path(path)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
