"""The package's commands (``python -m datc.train ...``, ``python -m datc.commands.export ...``) run in
a process forked from a server that imported the heavy libraries once (multiprocessing's
forkserver, as scripts/gpu_check/check.py runs its cases), instead of a fresh interpreter that spends
about 5 s importing torch and transformers before the command starts.

Each command is still a process of its own: its exit status, its stdout and stderr (file
descriptors 1 and 2, so what C code writes is caught too), its working directory and its
environment. What differs from a fresh interpreter: the modules the server preloaded are already
imported, so an environment variable that a library reads when it is imported (``HF_HUB_OFFLINE``,
``HF_HOME``, ``OMP_NUM_THREADS``, ...) would not take effect; :func:`run` accepts only
variables the package reads at run time, and a test that needs another one starts a fresh
interpreter. Signals are not forwarded: a test that stops a run uses ``subprocess.Popen``."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ENTRY_POINTS = {"datc.train": "main", "datc.commands.export": "main"}  # module -> its entry function
PRELOAD = ["datc.training.trainer", "datc.train", "datc.commands.export"]
RUN_TIME_ENV = {"DATC_CACHE"}  # variables the package reads when a command runs, not when imported

_ctx: mp.context.BaseContext | None = None


def _context() -> mp.context.BaseContext:
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def _child(module: str, args: list[str], cwd: str | None, env: dict[str, str], out: str, err: str) -> None:
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (fd 1 and 2 stay open for the process)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update(env)  # over the server's: what its imports set (DS_ACCELERATOR) stays, as in a fresh interpreter
    mod = importlib.import_module(module)
    sys.argv = [mod.__file__, *args]
    code = getattr(mod, ENTRY_POINTS[module])()
    sys.exit(code if isinstance(code, int) else 0)


def run(argv: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, ...)`` for ``argv`` =
    ``[sys.executable, "-m", <an entry point of ENTRY_POINTS>, *args]``, in a forked process.
    ``env``: extra variables, among :data:`RUN_TIME_ENV`, on top of this process's environment."""
    assert argv[:2] == [sys.executable, "-m"] and argv[2] in ENTRY_POINTS, argv[:3]
    extra = dict(env or {})
    assert set(extra) <= RUN_TIME_ENV, f"read when imported, so they need a fresh interpreter: {set(extra) - RUN_TIME_ENV}"
    with tempfile.TemporaryDirectory(prefix="datc-cli-") as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        p = _context().Process(target=_child, args=(argv[2], list(argv[3:]), None if cwd is None else str(cwd),
                                                    {**os.environ, **extra}, out, err))
        p.start()
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired(argv, timeout)
        read = [Path(f).read_text(errors="replace") if Path(f).exists() else "" for f in (out, err)]
        return subprocess.CompletedProcess(argv, p.exitcode, *read)
