"""The project's one error for bad input, importable by any layer (the config schema re-exports it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad config value; the message names the field and what would be valid."""
