"""What a tracker is: one dashboard a run's metrics also go to, beside ``metrics.jsonl``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from datc.config import LoggerConfig
from datc.run.completions import Completions


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker is told of the run it logs."""

    run_dir: Path  # the run directory: a tracker writes its local files below it
    cfg: LoggerConfig  # the ``logger`` config group
    run_name: str
    run_id: str  # the tracker's id for this run directory (run.json's ``wandb_id``): a resumed run continues it
    config: dict[str, Any]  # the resolved config
    first_step: int  # the first step it is sent; whatever it holds from this step on is replaced (a resume redoes those steps)


class Tracker:
    """A dashboard the run logger (:class:`datc.run.logger.RunLogger`) sends every metric row to.

    ``metrics.jsonl`` is written first whatever the tracker; every call below may raise, and the
    run logger then reports the failure once, calls :meth:`close_failed` and goes on without the
    tracker. A tracker registers by name in :data:`datc.run.trackers.TRACKERS` and is chosen
    with ``logger.name`` (``logger=<name>``, ``configs/logger/<name>.yaml``)."""

    label: ClassVar[str] = ""  # how messages name it ("W&B")
    package: ClassVar[str | None] = None  # the module it needs, checked before any model loads
    install: ClassVar[str] = ""  # how to install that module
    tables: ClassVar[bool] = False  # it shows the completions table (the step before each eval keeps its completions)

    def __init__(self, run: TrackedRun) -> None:
        self.run = run

    def where(self) -> str:
        """Where the run's data went, for a message (a folder, a URL)."""
        return ""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """The eval's held-out samples (prompt, response, rm_score, gold), ``logger.log_samples`` rows."""

    def log_completions(self, completions: Completions, step: int) -> None:
        """The completions table (:class:`Completions`), where the tracker has tables."""

    def finish(self, summary: dict[str, Any]) -> None:
        """The run's final evaluation; the tracker's files are complete after this."""

    def close_failed(self) -> None:
        """Close after a failure, quietly (the failure was reported)."""
