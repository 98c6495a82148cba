"""Trackers: the dashboards a run's metrics also go to (``logger=<name>``, configs/logger/).

``metrics.jsonl`` in the run directory keeps every metric whatever the tracker; a tracker gets
the same rows, the eval samples and the completions table where it has tables, and the run's
config. A failing tracker is reported once and the run goes on without it. A tracker plugs in by
name (:class:`Tracker` and ``TRACKERS.register``), as the rollout engines do.

| ``logger.name`` | module | what it shows | needs |
|---|---|---|---|
| ``none`` | — | the local files only | — |
| ``wandb`` | :mod:`datc.run.trackers.wandb_tracker` | W&B runs (online, else offline) | ``wandb`` (a dependency) |
| ``tensorboard`` | :mod:`datc.run.trackers.tensorboard_tracker` | ``<run_dir>/tensorboard/`` | ``pip install 'datc[tensorboard]'`` |
"""

from __future__ import annotations

from datc.registry import Registry
from datc.run.trackers.base import TrackedRun, Tracker

TRACKERS: Registry[type[Tracker]] = Registry("tracker")
NONE = "none"  # logger=none: the run's own files only


def _register() -> None:
    from datc.run.trackers.tensorboard_tracker import TensorBoardTracker
    from datc.run.trackers.wandb_tracker import WandbTracker

    TRACKERS.register("wandb")(WandbTracker)
    TRACKERS.register("tensorboard")(TensorBoardTracker)


_register()

__all__ = ["NONE", "TRACKERS", "TrackedRun", "Tracker"]
