"""The project's one error for bad input, and its one-line messages on stderr, importable by any
layer (the config schema re-exports the error)."""

from __future__ import annotations

import errno
import sys


class ConfigError(ValueError):
    """A bad config value; the message names the field and what would be valid."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (at most ``limit`` characters), for one-line
    reports; its type's name where the message is empty."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


_SAID: set[str] = set()


def _say(line: str) -> None:
    """``line`` on stderr on a line of its own: through tqdm where a progress bar may be drawn
    there (it clears the bar, prints, and redraws it), so a message is never glued to the bar."""
    try:
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)
        sys.stderr.flush()
    except ImportError:  # pragma: no cover (tqdm is a dependency)
        print(line, file=sys.stderr, flush=True)


def warn(msg: str, once: bool = False) -> None:
    """One line on stderr: something was recovered or left out, and the run goes on. ``once``:
    said once per process (a config check made twice, before and after torch loads)."""
    if once:
        if msg in _SAID:
            return
        _SAID.add(msg)
    _say(f"datc: warning: {msg}")


def note(msg: str) -> None:
    """One line on stderr about what the command is doing (resuming, already finished)."""
    _say(f"datc: {msg}")


# How a full disk reads in a library's own error: safetensors' "I/O error: No space left on device
# (os error 28)", torch's zip writer's "unexpected pos" / "file write failed".
_FULL = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122", "unexpected pos",
         "write failed")


def full_disk(e: BaseException) -> bool:
    """Whether ``e``, what caused it, or a rank's failure inside DCP's ``CheckpointException``
    (``failures``: rank -> (exception, traceback)) is a full disk or quota."""
    seen: list[BaseException] = [e]
    for _ in range(32):
        if not seen:
            return False
        x = seen.pop()
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(x, (OSError, RuntimeError)) and any(t in str(x) for t in _FULL):
            return True
        if type(x).__name__ == "SafetensorError" and any(t in str(x) for t in _FULL):
            return True
        for f in (getattr(x, "failures", None) or {}).values():
            seen.append(f[0] if isinstance(f, tuple) else f)
        seen += [c for c in (x.__cause__, x.__context__) if isinstance(c, BaseException)]
    return False
