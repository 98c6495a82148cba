"""TensorBoard (``logger=tensorboard``): a local dashboard, no account or network.

Event files go to ``<run_dir>/tensorboard/`` (``tensorboard --logdir <run_dir>``, or the folder
holding several run directories to compare them). Every metric row is a scalar per key (float32,
as TensorBoard keeps them); the eval samples and the completions table are Markdown tables in the
Text tab (``eval/samples``, ``rollout/completions``: each token with its credit weight); the
resolved config is a YAML block (``config``) and its scalar fields the run's hyperparameters
(HParams tab); the final evaluation a table (``summary``). A resumed run writes a new event file
into the same folder that starts with a purge at the first step it redoes
(``SummaryWriter(purge_step=...)``), so TensorBoard drops the steps logged after the checkpoint
the run resumed from: one value per step (docs/trackers.md).
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from datc.run.completions import Completions
from datc.run.trackers.base import TrackedRun, Tracker

FOLDER = "tensorboard"  # below the run directory
HPARAM_METRICS = ("eval/gold", "eval/rm_score", "eval/kl")  # shown beside the hyperparameters (HParams tab)


class TensorBoardTracker(Tracker):
    label = "TensorBoard"
    package = "tensorboard"
    install = "pip install 'datc[tensorboard]' (or pip install tensorboard)"
    tables = True

    def __init__(self, run: TrackedRun) -> None:
        super().__init__(run)
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(run.run_dir) / FOLDER
        # Each writer opens with a session start at first_step (SummaryWriter's purge_step): the
        # steps from there on are logged again, so TensorBoard drops what the folder holds of them.
        # (Its loaders take a run's first start for the session's beginning, purging nothing, and
        # each later one for a restart: a fresh run writes one too.)
        self._writer = SummaryWriter(str(self.dir), purge_step=run.first_step, flush_secs=30)
        self._last = run.first_step
        if run.first_step == 0:
            self._log_config(run.config)

    def where(self) -> str:
        return f"{self.dir}; view with `tensorboard --logdir {self.dir.parent}`"

    def _log_config(self, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        self._writer.add_text("config", "```yaml\n" + OmegaConf.to_yaml(OmegaConf.create(config)) + "```", 0)
        flat = {k: v for k, v in _flatten(config).items() if isinstance(v, (bool, int, float, str))}
        for summary in hparams(flat, dict.fromkeys(HPARAM_METRICS, 0.0)):  # the metrics' values are their scalars
            self._writer.file_writer.add_summary(summary, 0)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for k, v in metrics.items():
            if isinstance(v, (bool, int, float)):
                self._writer.add_scalar(k, float(v), step)  # float32 (what TensorBoard's fast loader reads)
        self._last = max(self._last, step)
        self._writer.flush()  # on disk before the next checkpoint: a killed run resumes with no gap

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        self._writer.add_text("eval/samples", markdown_table(list(rows[0]), [list(r.values()) for r in rows]), step)
        self._writer.flush()

    def log_completions(self, completions: Completions, step: int) -> None:
        c = completions
        rows = [[p, "".join(t), r, a, " ".join(f"{tok.strip() or repr(tok)} ({x:.2f})" for tok, x in zip(t, w, strict=True))]
                for p, t, w, r, a in zip(c.prompts, c.tokens, c.weights, c.rewards, c.advantages, strict=True)]
        self._writer.add_text("rollout/completions",
                              markdown_table(["prompt", "completion", "reward", "advantage", "credit: token (w)"], rows), step)
        self._writer.flush()

    def finish(self, summary: dict[str, Any]) -> None:
        rows = [[k, v] for k, v in summary.items() if isinstance(v, (bool, int, float, str))]
        if rows:
            self._writer.add_text("summary", markdown_table(["final eval", "value"], rows), self._last)
        self._writer.close()

    def close_failed(self) -> None:
        self._writer.close()


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _cell(v: Any) -> str:
    """One Markdown table cell: numbers to 4 significant digits, text escaped (no pipe, newline or HTML)."""
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    if v is None:
        return ""
    text = html.escape(str(v), quote=False).replace("\\", "\\\\").replace("|", "\\|")
    for ch in "*_`[]":
        text = text.replace(ch, "\\" + ch)
    return " ".join(text.split("\n")) or " "


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (TensorBoard's Text tab renders it)."""
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
