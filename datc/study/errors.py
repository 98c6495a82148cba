"""The study's one error for a sweep that cannot be read (its files, its runs): one line, for
``datc-study`` and ``datc-compare --tuned`` to print, exit 2."""

from __future__ import annotations


class TuningError(ValueError):
    """A tuned sweep that cannot be read as one: one line, for the command to print."""
