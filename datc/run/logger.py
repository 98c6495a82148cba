"""Run logging: every metric goes to the run directory's ``metrics.jsonl`` first; with
``logger=<tracker>`` (``wandb``, ``tensorboard``: :mod:`datc.run.trackers`) also to that
tracker, with the eval samples and the completions table where it has tables. A tracker's
failure never stops training: it is reported once and the local files keep everything.

``run.json`` records the trackers a run was sent to. A run resumed with a tracker it was not sent
to before sends that tracker its earlier rows first; a finished run asked again with one
(``datc-train logger=tensorboard`` after ``make demo``) is sent there whole
(:func:`send_finished_run`), ``metrics.jsonl`` untouched.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from typing import Any

from datc.atomic import append_line
from datc.config import LoggerConfig
from datc.run.completions import Completions, completions_of, credit_html  # noqa: F401  (their home before the trackers)
from datc.run.rundir import RunDir
from datc.run.trackers import NONE, TRACKERS, TrackedRun, Tracker
from datc.run.trackers.wandb_tracker import COMPLETIONS_KEY, completions_table, job_type, run_tags  # noqa: F401


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)
    return v


def _unclean(v: Any) -> Any:
    """A ``metrics.jsonl`` value as it was logged: ``"inf"`` back to a float, None (NaN) to NaN."""
    return float(v) if v in ("inf", "-inf") else math.nan if v is None else v


def keeps_completions(cfg: LoggerConfig) -> bool:
    """Whether the chosen tracker shows the completions table (the step before an eval keeps them)."""
    return cfg.name != NONE and cfg.name in TRACKERS and TRACKERS.get(cfg.name).tables


class RunLogger:
    def __init__(self, run: RunDir, cfg: LoggerConfig, run_name: str, config: dict[str, Any], start: int = 0,
                 metrics: bool = True) -> None:
        """``start``: the step the run resumes after (0: from the beginning); ``metrics``: False
        when the rows are only sent to the tracker (a finished run's, :func:`send_finished_run`)."""
        self.metrics_file = run.metrics_file
        self._write = metrics
        self.tracker: Tracker | None = None
        self.label = ""
        self.new = False  # the run had not been sent to this tracker before: :meth:`catch_up` sends its earlier rows
        self._failed = False
        if cfg.name == NONE:
            return
        cls = TRACKERS.get(cfg.name)
        self.label, self.new = cls.label, cfg.name not in run.trackers()
        # the tracker holds the run's steps through ``start`` unless it is new to the run (or the run starts over)
        first = start + 1 if start > 0 and not self.new else 0
        try:
            self.tracker = cls(TrackedRun(run.path, cfg, run_name, run.wandb_id, config, first))
        except Exception as e:  # a tracker must not take the run down with it
            self._report(e)
            return
        if run.lock is not None:
            run.record_tracker(cfg.name)

    def _report(self, e: Exception) -> None:
        if not self._failed:
            goes_on = "training continues, metrics" if self._write else "the metrics"
            print(f"{self.label} logging failed ({type(e).__name__}: {e}); {goes_on} are in {self.metrics_file}",
                  file=sys.stderr)
        self._failed = True
        if self.tracker is not None:  # closed, so nothing half-written stays open (W&B: the next init would return it)
            try:
                self.tracker.close_failed()
            except Exception:
                pass
        self.tracker = None

    def _send(self, method: str, *args: Any) -> None:
        if self.tracker is None:
            return
        try:
            getattr(self.tracker, method)(*args)
        except Exception as e:
            self._report(e)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self._write:
            row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
            append_line(self.metrics_file, json.dumps(row) + "\n")  # whole or not at all, even on a full disk
        self._send("log", metrics, step)

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        if rows:
            self._send("log_samples", rows, step)

    def log_completions(self, completions: Completions | None, step: int) -> None:
        """The completions table at ``step``; nothing where the tracker has no tables."""
        if completions is not None:
            self._send("log_completions", completions, step)

    def catch_up(self, rows: Iterable[dict[str, Any]]) -> int:
        """Send the rows of ``metrics.jsonl`` a resumed run already holds to a tracker new to the run
        (the tracker only: ``metrics.jsonl`` keeps them). Returns how many were sent."""
        if not self.new:
            return 0
        n = 0
        for row in rows:
            if self.tracker is None:
                break
            metrics = {k: _unclean(v) for k, v in row.items() if k != "step"}
            self._send("log", metrics, int(row["step"]))
            n += 1
        return n

    def finish(self, summary: dict[str, Any]) -> None:
        self._send("finish", summary)

    def where(self) -> str:
        return self.tracker.where() if self.tracker is not None else ""


def send_finished_run(run: RunDir, cfg: LoggerConfig, run_name: str, config: dict[str, Any],
                      summary: dict[str, Any]) -> str | None:
    """A finished run asked again with a tracker it was not sent to: its ``metrics.jsonl`` rows and
    final evaluation sent there (``metrics.jsonl`` is not rewritten). Returns the line that says
    so, or None when there was nothing to send (no tracker, or the run was sent to it already)."""
    if cfg.name == NONE or cfg.name in run.trackers():
        return None
    label = TRACKERS.get(cfg.name).label
    if run.lock is None:  # a finished run in a directory this process cannot write
        return f"not sent to {label}: {run.path} is not writable (copy the run directory elsewhere and ask there)"
    logger = RunLogger(run, cfg, run_name, config, metrics=False)
    n = logger.catch_up(run.read_metrics())
    where = logger.where()
    logger.finish(dict((summary.get("eval") or {}).get("final") or {}))
    if logger.tracker is None:
        return None  # the failure was said in one line
    return f"sent this finished run's {n} metric rows to {label} ({where})"
