"""What the test run's processes share: a folder of all of pytest-xdist's workers, made once by
the first worker that asks (:func:`once_per_run`), and the finished sweep they read (:class:`Sweep`)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A folder every worker of this test run shares (``pytest -n``: pytest-xdist's workers have
    their own temporary folders under one run folder), or this process's own without workers."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(exist_ok=True)
    return folder


@contextmanager
def once_per_run(folder: Path):
    """Holds ``folder``'s lock: the first worker to take it makes what the folder holds, the
    others wait for it and find it made."""
    from filelock import FileLock

    with FileLock(str(folder) + ".lock"):
        yield


@dataclass(frozen=True)
class Sweep:
    dir: Path  # hydra.sweep.dir: one run directory per job
    cmd: list[str]  # the command without its hydra.sweep.dir
    env: dict[str, str]  # on top of the test process's (tests/helpers/cli.py)
