"""A rank's life tied to ``datc-launch``'s: when the launcher ends, however it ends (``kill -9``
included, which it cannot forward), its training processes end too instead of training on,
orphaned.

``datc-launch`` names itself in the environment (:data:`ENV`: its pid and start time, so a pid
reused by another process does not count). A process of the run started under it calls
:func:`die_with_launcher` at start-up: Linux's ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` ends it with
its direct parent (torchrun, DeepSpeed's per-node launcher or ``datc-launch`` itself), and a
watcher thread ends it within half a second of ``datc-launch``'s own end (DeepSpeed puts two
launchers between them). Its last checkpoint stays, as after ``kill -9``: the same command
resumes. Signals ``datc-launch`` receives (SIGINT, SIGTERM, SIGHUP) it forwards to the ranks,
which stop at the next step with a checkpoint (:mod:`datc.run.signals`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

ENV = "DATC_LAUNCH_PID"  # "<pid>:<start time>" of the datc-launch process a rank belongs to
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when the thread that started it ends; False
    where it cannot (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of a process, from ``/proc``; None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], fields[19]
    except (OSError, IndexError):
        return None


def launcher_env() -> dict[str, str]:
    """The variable ``datc-launch`` gives its processes: who they die with."""
    st = _stat(os.getpid())
    return {ENV: f"{os.getpid()}:{st[1] if st else ''}"}


def launcher_gone(value: str) -> bool:
    """Whether the ``datc-launch`` named by ``value`` (:data:`ENV`) has ended (a zombie counts
    as ended; so does another process that took its pid)."""
    pid_s, _, start = value.partition(":")
    if not pid_s.isdigit():
        return False
    st = _stat(int(pid_s))
    return st is None or st[0] in ("Z", "X") or (start != "" and st[1] != start)


def _end(pid: str) -> None:
    with contextlib.suppress(Exception):  # stderr may be a closed terminal
        print(f"datc-train: datc-launch (process {pid}) ended, so this process of its run ends too; the last "
              "checkpoint stays: run the same command again to resume", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher(poll_s: float = 0.5) -> bool:
    """In a process started by ``datc-launch`` (:data:`ENV` set): end with its parent and with
    ``datc-launch``, as above. Returns whether it applies (False outside ``datc-launch``)."""
    value = os.environ.get(ENV)
    if not value:
        return False
    set_parent_death_signal(signal.SIGKILL)
    if launcher_gone(value):  # it ended before this process could ask to follow it
        _end(value.partition(":")[0])

    def watch() -> None:
        while not launcher_gone(value):
            time.sleep(poll_s)
        _end(value.partition(":")[0])

    threading.Thread(target=watch, name="datc-launch-watch", daemon=True).start()
    return True
