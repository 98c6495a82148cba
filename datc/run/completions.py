"""The completions table's rows: training responses of the step before an evaluation with their
reward, advantage and per-token credit weights, as TRL's ``GRPOTrainer`` logs its completions
table. Each tracker draws them its own way (:mod:`datc.run.trackers`): W&B as a table with the
credit as a heatmap, TensorBoard as a Markdown table."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass


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


def weight_span(c: Completions) -> float:
    """The colour scale's half-width around w = 1: one scale per table, so equal colours mean equal weights."""
    return max([0.05, *(abs(w - 1.0) for ws in c.weights for w in ws if math.isfinite(w))])


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
