"""The project's one error for bad input, importable by any layer (the config schema re-exports it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad config value; the message names the field and what would be valid."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (at most ``limit`` characters), for one-line
    reports; its type's name where the message is empty."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]
