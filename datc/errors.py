"""The project's one error for bad input, and its one-line messages on stderr, importable by any
layer (the config schema re-exports the error)."""

from __future__ import annotations

import sys


class ConfigError(ValueError):
    """A bad config value; the message names the field and what would be valid."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (at most ``limit`` characters), for one-line
    reports; its type's name where the message is empty."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


def warn(msg: str) -> None:
    """One line on stderr: something was recovered or left out, and the run goes on."""
    print(f"datc: warning: {msg}", file=sys.stderr, flush=True)


def note(msg: str) -> None:
    """One line on stderr about what the command is doing (resuming, already finished)."""
    print(f"datc: {msg}", file=sys.stderr, flush=True)
