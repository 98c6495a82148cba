"""Run logging: every metric goes to the run directory's ``metrics.jsonl``; with
``logger=wandb`` also to Weights & Biases. A W&B failure never stops training: it is reported
once and the local files keep everything.

In W&B a run is named by its run name, its id is drawn once per run directory (``run.json``),
its ``group`` is the setting (``<data>-<policy>`` by default), its ``job_type`` the credit
scheme, and its tags say the credit scheme, data, policy, seed and DeepSpeed stage, so a
four-setting sweep slices by any of them. At each evaluation the logger also records a table
of training completions, as TRL's ``GRPOTrainer`` logs its completions table, with each
response's reward, advantage and per-token credit weights drawn as a heatmap (``wandb.Html``).
"""

from __future__ import annotations

import html
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datc.atomic import append_line
from datc.config import LoggerConfig
from datc.errors import first_line

COMPLETIONS_KEY = "rollout/completions"  # the W&B table of training completions and their credit


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
        """``run_id``: W&B's id for this run directory (``RunDir.wandb_id``), so a resumed run
        continues its W&B run and two directories of one config stay two runs."""
        self.metrics_file = metrics_file
        self._wandb = None
        self._failed = False
        if cfg.name == "wandb":
            self._start_wandb(run_dir, cfg, run_name, run_id, config)

    def _start_wandb(self, run_dir: Path, cfg: LoggerConfig, run_name: str, run_id: str, config: dict[str, Any]) -> None:
        """Online, offline or disabled as ``cfg.mode`` says. An online start that cannot reach the
        server within ``cfg.init_timeout_s`` (W&B retries until then) goes on offline under the
        same run id, one line saying so, so ``wandb sync`` uploads it later into the same run."""
        mode = cfg.mode if cfg.mode != "auto" else ("online" if _has_wandb_key() else "offline")
        try:
            import wandb

            def start(mode: str):
                return wandb.init(
                    project=cfg.project, entity=cfg.entity, group=cfg.group, job_type=job_type(config),
                    tags=[*cfg.tags, *run_tags(config)], name=run_name, id=run_id, resume="allow", dir=str(run_dir),
                    config=config, mode=mode, settings=wandb.Settings(init_timeout=float(cfg.init_timeout_s)),
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
            if mode == "offline":
                print(f"W&B: {why}, logging offline to {self._wandb.dir}; upload with `wandb sync {Path(self._wandb.dir).parent}`",
                      file=sys.stderr)
        except Exception as e:  # a logging backend must not take the run down with it
            self._report(e)

    def _report(self, e: Exception) -> None:
        if not self._failed:
            print(f"W&B logging failed ({type(e).__name__}: {e}); training continues, metrics are in {self.metrics_file}",
                  file=sys.stderr)
        self._failed = True
        if self._wandb is not None:  # close it, or the next wandb.init in this process returns this broken run
            try:
                self._wandb.finish(exit_code=1)
            except Exception:
                pass
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

    def log_completions(self, completions: Completions | None, step: int) -> None:
        """The completions table (:func:`completions_table`) at ``step``; nothing without W&B."""
        if self._wandb is None or completions is None:
            return
        try:
            self._wandb.log({COMPLETIONS_KEY: completions_table(completions)}, step=step)
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


# ---- the completions table ---------------------------------------------------------------------


@dataclass
class Completions:
    """Training responses of one step as the completions table shows them (n rows)."""

    prompts: list[str]  # (n,) prompt texts
    tokens: list[list[str]]  # (n, T_i) each response's valid tokens, as text
    weights: list[list[float]]  # (n, T_i) credit weight w of each token
    rewards: list[float]  # (n,) total reward
    advantages: list[float]  # (n,) group advantage A


def completions_of(tok, prompts: list[str], response_ids, response_mask, rewards, advantages, weights,
                   n: int) -> Completions:
    """The first ``n`` responses of a batch (whole groups first: they are contiguous).
    ``response_ids`` / ``response_mask`` / ``weights`` (B, T); ``rewards`` / ``advantages`` (B,)."""
    n = min(n, len(prompts))
    toks, ws = [], []
    for i in range(n):
        k = int(response_mask[i].sum())
        toks.append([tok.decode([t]) for t in response_ids[i, :k].tolist()])
        ws.append([float(w) for w in weights[i, :k].tolist()])
    return Completions(prompts[:n], toks, ws, [float(r) for r in rewards[:n].tolist()],
                       [float(a) for a in advantages[:n].tolist()])


def _weight_colour(w: float, span: float) -> str:
    """Blue below w = 1, white at 1, red above (as datc-heatmaps, datc/analysis/heatmaps.py), on ±span around 1."""
    x = max(-1.0, min(1.0, (w - 1.0) / span)) if math.isfinite(w) else 0.0
    lo, hi = (0x21, 0x66, 0xAC), (0xB2, 0x18, 0x2B)
    end = hi if x > 0 else lo
    rgb = [round(255 + (e - 255) * abs(x)) for e in end]
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def credit_html(tokens: list[str], weights: list[float], span: float) -> str:
    """One response as inline-coloured token cells; a cell's tooltip holds its weight."""
    cells = "".join(
        f'<span style="background:{_weight_colour(w, span)};font-family:monospace;white-space:pre;padding:1px 2px" '
        f'title="w = {w:.4f}">{html.escape(t)}</span>'
        for t, w in zip(tokens, weights, strict=True)
    )
    return f'<div style="line-height:1.9">{cells}</div>'


def completions_table(c: Completions):
    """A ``wandb.Table``: prompt, completion, reward, advantage, the credit heatmap
    (``wandb.Html``; one colour scale per table, so equal colours mean equal weights) and the
    weights as text."""
    import wandb

    flat = [abs(w - 1.0) for ws in c.weights for w in ws if math.isfinite(w)]
    span = max([0.05, *flat])
    rows = [[p, "".join(t), r, a, wandb.Html(credit_html(t, w, span), inject=False), " ".join(f"{x:.3f}" for x in w)]
            for p, t, w, r, a in zip(c.prompts, c.tokens, c.weights, c.rewards, c.advantages, strict=True)]
    return wandb.Table(columns=["prompt", "completion", "reward", "advantage", "credit", "weights"], data=rows)
