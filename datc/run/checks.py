"""The run room's config checks, called by :func:`datc.checks.validate` before any model loads."""

from __future__ import annotations

import importlib.util

from datc.config import ConfigError, TrainConfig
from datc.run.trackers import NONE, TRACKERS


def check_logger(c: TrainConfig) -> None:
    """``logger.name``: ``none`` or a registered tracker whose package is installed."""
    name = c.logger.name
    if name == NONE:
        return
    if name not in TRACKERS:
        raise ConfigError(f"logger.name: {name!r} is not valid; choose one of {', '.join([NONE, *TRACKERS.names()])}")
    tracker = TRACKERS.get(name)
    if tracker.package is not None and importlib.util.find_spec(tracker.package) is None:
        raise ConfigError(f"logger.name: {name} needs the {tracker.package} package, which is not installed; "
                          f"install it with {tracker.install}, or use logger=none")
