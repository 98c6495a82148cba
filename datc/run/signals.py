"""Stopping on SIGTERM (what Slurm and most schedulers send before SIGKILL), SIGINT (Ctrl-C) and
SIGHUP (the terminal closed).

The first signal asks the run to stop at the next safe point, between two training steps:
the trainer writes a checkpoint of the step it just finished and raises :class:`Interrupted`,
and ``datc-train`` exits with one line (exit code 128 + the signal number). Re-running the same
command resumes from that checkpoint. A second signal exits at once, without a checkpoint: the
last periodic checkpoint remains, as after ``kill -9``. One exception: a SIGTERM within
:data:`ESCALATION_S` of a SIGINT is the same stop, not a second one (DeepSpeed's and torchrun's
launchers send SIGTERM on top of the Ctrl-C they pass on).

Under DeepSpeed every rank checks, and the ranks agree (a sum over ranks) so that all of them
write the same checkpoint and stop together.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
ESCALATION_S = 3.0  # a launcher's SIGTERM this soon after a SIGINT is the same stop
_received: list[int] = []  # signals received since the handlers were installed
_first_at: list[float] = []  # when the first one came (time.monotonic)
_run_scopes: list[int] = []  # how many stop_signals scopes began in this process (until_said reads it)


class Interrupted(Exception):
    """The run stopped on a signal at a step boundary, after writing a checkpoint."""

    def __init__(self, signum: int, step: int, saved: bool, prepare: str | None = None) -> None:
        self.signum, self.step, self.saved = signum, step, saved
        name = signal.Signals(signum).name
        if prepare is not None:
            super().__init__(f"stopped by {name} in the prepare step ({prepare}): the cache keeps every part finished "
                             "before it; run the same command again to go on")
            return
        where = f"checkpoint of step {step} written" if saved else f"nothing new to save (step {step})"
        super().__init__(f"stopped by {name} at step {step}: {where}; run the same command again to resume")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a closed terminal (SIGHUP) or stream: the stop goes on unsaid
        pass


def _handler(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    # on a terminal, off the progress bar's line first (a signal handler takes no lock tqdm may hold)
    brk = "\n" if sys.stderr.isatty() else ""
    if _received:
        if (signum == signal.SIGTERM and _received[0] == signal.SIGINT and signal.SIGTERM not in _received
                and time.monotonic() - _first_at[0] < ESCALATION_S):
            _received.append(signum)  # a launcher escalating the Ctrl-C it passed on: the same stop
            return
        _say(f"{brk}datc-train: second signal ({name}): exiting now without a checkpoint; the last periodic checkpoint "
             "remains")
        raise SystemExit(128 + signum)
    _received.append(signum)
    _first_at[:] = [time.monotonic()]
    _say(f"{brk}datc-train: {name} received: stopping at the next safe point (after the current training step, with a "
         "checkpoint; in the prepare step within seconds, keeping what is cached); send it again to exit at once")


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Handle SIGTERM, SIGINT and SIGHUP as above while the block runs (main thread only; elsewhere,
    e.g. a test calling ``train`` in a thread, the default behaviour stays)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    _first_at.clear()
    _run_scopes.append(1)
    try:
        with _handling(SIGNALS, _handler):
            yield
    finally:
        _received.clear()


@contextlib.contextmanager
def _handling(signals: tuple[int, ...], handler: Any) -> Iterator[None]:
    """``handler`` for ``signals`` while the block runs; the former handlers after."""
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


ENDING = (signal.SIGTERM, signal.SIGHUP)  # what a launcher sends the other ranks when one of them died


@contextlib.contextmanager
def until_said() -> Iterator[None]:
    """For a command's whole job (``datc-train``): a SIGTERM or SIGHUP that arrives after the run's
    :func:`stop_signals` scope ended, while the run unwinds to its one line (another rank died:
    DeepSpeed's and torchrun's launchers SIGTERM the survivors within a second, just as their
    collective fails), is noted instead of ending the process before the line is printed; the
    process then ends with the line and the run's own status. Before the run's scope began (the
    config, the models loading) such a signal acts as before, and so does a second one while
    ending: the process ends. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    started, noted = len(_run_scopes), []

    def ending(signum: int, frame: Any) -> None:
        if len(_run_scopes) > started and not noted:  # the run is ending already: its line follows
            noted.append(signum)
            return
        signal.signal(signum, signal.SIG_DFL)  # before the run, or a second signal: the default action
        os.kill(os.getpid(), signum)

    with _handling(ENDING, ending):
        yield


def stop_requested(dist: Any = None) -> bool:
    """Whether a stop signal arrived (on any rank, under DeepSpeed: every rank calls this at the
    same step, so every rank gets the same answer)."""
    hit = bool(_received)
    if dist is not None and dist.world_size > 1:
        hit = dist.sum(float(hit)) > 0
    return hit


def stop_if_requested(stopping: bool, step: int, saved: bool = True) -> None:
    """Raise :class:`Interrupted` when ``stopping`` (the trainer has just written the checkpoint)."""
    if stopping:
        raise Interrupted(_received[0] if _received else signal.SIGTERM, step, saved)


def stop_in_prepare(what: str) -> None:
    """Between two steps of the prepare step (warm start, reward-model samples and training): a
    stop signal stops it here, within seconds, instead of after minutes of training a cache
    entry that is then thrown away. Entries already written stay in the cache (each appears
    whole or not at all)."""
    if _received:
        raise Interrupted(_received[0], 0, False, prepare=what)
