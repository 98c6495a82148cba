"""Run logging: every metric goes to the run directory's ``metrics.jsonl``; with
``logger=wandb`` also to Weights & Biases. A W&B failure never stops training: it is reported
once and the local files keep everything."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from datc.atomic import append_line
from datc.config import LoggerConfig


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)
    return v


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


class RunLogger:
    def __init__(self, run_dir: Path, metrics_file: Path, cfg: LoggerConfig, run_name: str, run_id: str, config: dict[str, Any]) -> None:
        self.metrics_file = metrics_file
        self._wandb = None
        self._failed = False
        if cfg.name == "wandb":
            self._start_wandb(run_dir, cfg, run_name, run_id, config)

    def _start_wandb(self, run_dir: Path, cfg: LoggerConfig, run_name: str, run_id: str, config: dict[str, Any]) -> None:
        mode = cfg.mode if cfg.mode != "auto" else ("online" if _has_wandb_key() else "offline")
        try:
            import wandb

            self._wandb = wandb.init(
                project=cfg.project, entity=cfg.entity, group=cfg.group, tags=list(cfg.tags),
                name=run_name, id=run_id, resume="allow", dir=str(run_dir), config=config, mode=mode,
            )
            if mode == "offline":
                print(f"W&B: no API key, logging offline to {self._wandb.dir}; upload with `wandb sync {Path(self._wandb.dir).parent}`",
                      file=sys.stderr)
        except Exception as e:  # a logging backend must not take the run down with it
            self._report(e)

    def _report(self, e: Exception) -> None:
        if not self._failed:
            print(f"W&B logging failed ({type(e).__name__}: {e}); training continues, metrics are in {self.metrics_file}",
                  file=sys.stderr)
        self._failed = True
        self._wandb = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        append_line(self.metrics_file, json.dumps(row) + "\n")  # whole or not at all, even on a full disk
        if self._wandb is not None:
            try:
                self._wandb.log(metrics, step=step)
            except Exception as e:
                self._report(e)

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        if self._wandb is None or not rows:
            return
        try:
            import wandb

            cols = list(rows[0])
            self._wandb.log({"eval/samples": wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows])}, step=step)
        except Exception as e:
            self._report(e)

    def finish(self, summary: dict[str, Any]) -> None:
        if self._wandb is None:
            return
        try:
            for k, v in summary.items():
                if isinstance(v, (int, float, str)):
                    self._wandb.summary[k] = v
            self._wandb.finish()
        except Exception as e:
            self._report(e)
