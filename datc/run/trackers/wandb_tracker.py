"""Weights & Biases (``logger=wandb``): online with an API key, else offline (``wandb sync`` later).

A run is named by its run name, its id is drawn once per run directory (``run.json``), its
``group`` is the setting (``<data>-<policy>`` by default), its ``job_type`` the credit scheme,
and its tags say the credit scheme, data, policy, seed and DeepSpeed stage, so a four-setting
sweep slices by any of them. At each evaluation it also records the eval samples and a table of
training completions with each response's reward, advantage and per-token credit weights drawn
as a heatmap (``wandb.Html``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from datc.errors import first_line
from datc.run.completions import Completions, credit_html, weight_span
from datc.run.trackers.base import TrackedRun, Tracker

COMPLETIONS_KEY = "rollout/completions"  # the table of training completions and their credit


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


class WandbTracker(Tracker):
    label = "W&B"
    package = "wandb"
    install = "pip install wandb (a dependency of datc)"
    tables = True

    def __init__(self, run: TrackedRun) -> None:
        """Online, offline or disabled as ``logger.mode`` says. An online start that cannot reach
        the server within ``logger.init_timeout_s`` (W&B retries until then) goes on offline under
        the same run id, one line saying so, so ``wandb sync`` uploads it later into the same run."""
        super().__init__(run)
        import wandb

        cfg, config = run.cfg, run.config
        mode = cfg.mode if cfg.mode != "auto" else ("online" if _has_wandb_key() else "offline")

        def start(mode: str):
            return wandb.init(
                project=cfg.project, entity=cfg.entity, group=cfg.group, job_type=job_type(config),
                tags=[*cfg.tags, *run_tags(config)], name=run.run_name, id=run.run_id, resume="allow",
                dir=str(run.run_dir), config=config, mode=mode, settings=wandb.Settings(init_timeout=float(cfg.init_timeout_s)),
            )

        why = "no API key"
        try:
            self._wandb = start(mode)
        except Exception as e:  # noqa: BLE001  wandb.errors.CommError and what the network raises
            if mode != "online":
                raise
            why = f"the server did not answer within {cfg.init_timeout_s:g} s ({type(e).__name__}: {first_line(e)})"
            wandb.teardown()  # the failed start keeps the run id "in use" in this process
            self._wandb, mode = start("offline"), "offline"
        self.mode = mode
        if mode == "offline":
            print(f"W&B: {why}, logging offline to {self._wandb.dir}; upload with `wandb sync {Path(self._wandb.dir).parent}`",
                  file=sys.stderr)

    def where(self) -> str:
        url = getattr(self._wandb, "url", None)
        return url if self.mode == "online" and url else f"{self.mode}, {Path(self._wandb.dir).parent}"

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._wandb.log(metrics, step=step)

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        import wandb

        cols = list(rows[0])
        self._wandb.log({"eval/samples": wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows])}, step=step)

    def log_completions(self, completions: Completions, step: int) -> None:
        self._wandb.log({COMPLETIONS_KEY: completions_table(completions)}, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        for k, v in summary.items():
            if isinstance(v, (int, float, str)):
                self._wandb.summary[k] = v
        self._wandb.finish()

    def close_failed(self) -> None:
        self._wandb.finish(exit_code=1)  # or the next wandb.init in this process returns this broken run


def job_type(config: dict[str, Any]) -> str | None:
    """W&B's job type: the credit scheme (one colour per scheme in a grouped sweep)."""
    return (config.get("credit") or {}).get("name")


def run_tags(config: dict[str, Any]) -> list[str]:
    """Tags that slice a sweep in the W&B UI: ``credit:``, ``data:``, ``policy:``, ``seed:``, ``deepspeed:``."""
    tags = [f"{group}:{(config.get(group) or {}).get('name')}" for group in ("credit", "data", "policy", "deepspeed")
            if (config.get(group) or {}).get("name") is not None]
    if config.get("seed") is not None:
        tags.append(f"seed:{config['seed']}")
    return tags


def completions_table(c: Completions):
    """A ``wandb.Table``: prompt, completion, reward, advantage, the credit heatmap
    (``wandb.Html``; one colour scale per table, so equal colours mean equal weights) and the
    weights as text."""
    import wandb

    span = weight_span(c)
    rows = [[p, "".join(t), r, a, wandb.Html(credit_html(t, w, span), inject=False), " ".join(f"{x:.3f}" for x in w)]
            for p, t, w, r, a in zip(c.prompts, c.tokens, c.weights, c.rewards, c.advantages, strict=True)]
    return wandb.Table(columns=["prompt", "completion", "reward", "advantage", "credit", "weights"], data=rows)
