"""The lock that keeps one writer per run directory, and the clean-up of what a refused command
left behind.

:meth:`RunLock.acquire` takes an exclusive ``flock`` on ``<run_dir>/.lock`` and the holder keeps
it for the run's life. The kernel releases it when the process ends, however it ends, so a lock
left by a killed run never blocks its resume.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from datc.config import ConfigError
from datc.errors import note, warn  # noqa: F401  (the run's one-line messages, imported from here by the loop)

LOCK_FILE = ".lock"



class RunBusyError(ConfigError):
    """Another live process holds the run directory."""


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock`` holding ``"<pid> <host>"`` of its owner."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        path = run_dir / LOCK_FILE
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                who = f"process {holder[0]} on host {holder[1]}" if holder else "another process"
                raise RunBusyError(
                    f"run_dir: {run_dir} is in use by {who}; one process writes a run directory at a time: "
                    "wait for it to end (or stop it), or choose another run_name or run_dir"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            # The file may have been removed by a refused command between our open and flock.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        me = f"{os.getpid()} {socket.gethostname()}\n".encode()
        os.pwrite(fd, me, 0)
        os.ftruncate(fd, len(me))
        return cls(path, fd)

    def release(self, remove: bool = False) -> None:
        if self.fd < 0:
            return
        if remove:
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(self.fd)  # closing the last descriptor releases the flock
        self.fd = -1


def _holder(fd: int, wait_s: float = 2.0) -> tuple[str, str] | None:
    """(pid, host) the lock's holder wrote; the holder writes it just after taking the lock,
    so an empty file, or one naming a process of this host that is gone, is read again."""
    deadline = time.monotonic() + wait_s
    while True:
        parts = os.pread(fd, 200, 0).decode(errors="replace").split()
        if len(parts) >= 2 and parts[0].isdigit():
            pid, host = parts[0], parts[1]
            if host != socket.gethostname() or pid_alive(int(pid)):
                return pid, host
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) is running; another user's counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_HELD: list[RunLock] = []  # locks this process holds (released by release_run_locks)


def hold(lock: RunLock) -> None:
    """Keep ``lock`` until :func:`release_run_locks` (or the process's end)."""
    _HELD.append(lock)


def release_run_locks() -> None:
    """Release every run-directory lock this process took (the end of :func:`datc.training.trainer.train`)."""
    while _HELD:
        _HELD.pop().release()


def remove_stray(path: str | Path, own_log: bool = False) -> None:
    """Remove ``path`` if a refused command left it holding nothing of a run (only an unheld
    ``.lock`` and empty log files): a refused command leaves no directories behind. ``own_log``:
    this command created ``path``, so its ``train.log`` holds only this command's lines (said on
    stderr too), whatever their number."""
    path = Path(path)
    try:
        names = {p.name: p for p in path.iterdir()}
    except OSError:
        return
    if not set(names) <= {LOCK_FILE, "train.log"}:
        return
    if not own_log and any(p.stat().st_size for n, p in names.items() if n != LOCK_FILE):
        return
    if LOCK_FILE in names:
        try:
            lock = RunLock.acquire(path)
        except (ConfigError, OSError):
            return
        lock.release(remove=True)
    with contextlib.suppress(OSError):
        (path / "train.log").unlink(missing_ok=True)
        path.rmdir()


class NewDirs(Callback):
    """Remembers the highest directory of ``hydra.run.dir`` that does not exist yet, before
    Hydra creates it with its parents, so that a refused command removes all it created."""

    top: Path | None = None

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        try:
            d = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()
        except Exception:  # a config that does not resolve: validation says why later
            return
        while not d.exists() and d != d.parent:
            NewDirs.top, d = d, d.parent


def remove_new_dirs(run_dir: str) -> None:
    """A refused command leaves no directory behind: the run directory if it holds nothing of
    a run, then the parents this command created, while they are empty."""
    top = NewDirs.top
    own = Path(run_dir).absolute()
    remove_stray(run_dir, own_log=top is not None and top in (own, *own.parents))
    d = own.parent
    while top is not None and top in (d, *d.parents) and not Path(run_dir).exists():
        try:
            d.rmdir()
        except OSError:
            return
        if d == top:
            return
        d = d.parent
