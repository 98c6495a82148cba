"""The comparison's plots (PNG bytes): gold curves, credit accuracy, final RM score against
final gold."""

from __future__ import annotations

import io
import math
from typing import Any

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from datc.report.loading import UNIFORM_CREDIT
from datc.report.statistics import Report, curve_band, group_runs

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _colors(report: Report) -> dict[str, Any]:
    cmap = matplotlib.colormaps["tab10"]
    return {s: cmap(i % 10) for i, s in enumerate(report.schemes)}


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # render with Agg whatever pyplot's backend is
    return fig


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    return buf.getvalue()


def plot_gold_curves(report: Report) -> bytes:
    """One subplot per setting, one line per scheme: mean gold over seeds by step, with the
    95% t-interval shaded where at least 2 seeds were evaluated at that step."""
    settings, colors, groups = report.settings, _colors(report), group_runs(report.runs)
    ncols = 1 if len(settings) == 1 else 2
    nrows = math.ceil(len(settings) / ncols)
    fig = _figure(5.5 * ncols, 3.6 * nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, setting in zip(axes, settings, strict=False):
        for row in (r for r in report.rows if r.setting == setting):
            band = curve_band(groups[(row.data, row.policy, row.scheme)])
            if band is None:
                continue
            c = colors[row.scheme]
            ax.plot(band.steps, band.mean, color=c, label=f"{row.scheme} (n={int(band.n.max())})")
            ax.fill_between(
                band.steps,
                band.mean - band.half_width,
                band.mean + band.half_width,
                color=c,
                alpha=0.2,
                linewidth=0,
            )
        if not ax.lines:
            ax.text(
                0.5, 0.5, "no eval curve recorded", ha="center", va="center", transform=ax.transAxes
            )
        else:
            ax.legend(fontsize="small")
        ax.set(title=setting, xlabel="step", ylabel="held-out gold")
    for ax in axes[len(settings) :]:
        ax.set_visible(False)
    fig.suptitle(
        "Held-out gold: mean over seeds; band = 95% Student-t interval (steps with ≥2 seeds)"
    )
    return _png(fig)


def plot_credit_accuracy(report: Report) -> bytes:
    """Grouped bars: settings along x, one bar per scheme (uniform-credit schemes left out),
    height = mean credit accuracy over seeds, error bar = 95% t half-width (none for n = 1)."""
    rows = [
        r
        for r in report.rows
        if r.scheme not in UNIFORM_CREDIT and r.cells["credit_accuracy"].mean is not None
    ]
    settings = [s for s in report.settings if any(r.setting == s for r in rows)]
    schemes = [s for s in report.schemes if any(r.scheme == s for r in rows)]
    colors = _colors(report)
    fig = _figure(max(6.0, 1.2 + 0.6 * len(settings) * max(len(schemes), 1)), 4.0)
    ax = fig.subplots()
    width = 0.8 / max(len(schemes), 1)
    for i, scheme in enumerate(schemes):
        ivs = {r.setting: r.cells["credit_accuracy"] for r in rows if r.scheme == scheme}
        xs = [j + (i - (len(schemes) - 1) / 2) * width for j, s in enumerate(settings) if s in ivs]
        present = [ivs[s] for s in settings if s in ivs]
        ax.bar(
            xs,
            [iv.mean for iv in present],
            width,
            color=colors[scheme],
            label=scheme,
            yerr=[np.nan if iv.half_width is None else iv.half_width for iv in present],
            capsize=3,
        )
    if not rows:
        ax.text(
            0.5,
            0.5,
            "no credit accuracy recorded",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    else:
        ax.legend(fontsize="small")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(settings)), settings)
    ax.set_ylabel("credit accuracy (Spearman ρ)")
    ax.set_title(
        "Credit accuracy: mean over seeds ± 95% t-interval "
        f"({', '.join(sorted(UNIFORM_CREDIT))}: undefined)"
    )
    return _png(fig)


def plot_rm_vs_gold(report: Report) -> bytes:
    """One point per run: final RM score (y) against final held-out gold (x), coloured by scheme,
    marker by setting, with y = x. Points above the line are runs the RM over-rates."""
    colors = _colors(report)
    markers = {s: MARKERS[i % len(MARKERS)] for i, s in enumerate(report.settings)}
    runs = [r for r in report.runs if r.final_gold is not None and r.final_rm_score is not None]
    fig = _figure(6.5, 5.0)
    ax = fig.subplots()
    for run in runs:
        ax.scatter(
            run.final_gold,
            run.final_rm_score,
            color=colors[run.credit],
            marker=markers[run.setting],
            alpha=0.8,
            edgecolors="none",
        )
    if runs:
        vals = [v for r in runs for v in (r.final_gold, r.final_rm_score)]
        lo, hi = min(vals), max(vals)
        pad = 0.05 * (hi - lo) or 0.1
        ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], "k--", linewidth=0.8, zorder=0)
        used = {r.credit for r in runs}, {r.setting for r in runs}
        handles = [
            Line2D([], [], color=colors[s], marker="o", linestyle="", label=s)
            for s in report.schemes
            if s in used[0]
        ]
        handles += [
            Line2D([], [], color="gray", marker=markers[s], linestyle="", label=s)
            for s in report.settings
            if s in used[1]
        ]
        handles.append(
            Line2D([], [], color="black", linestyle="--", linewidth=0.8, label="RM = gold")
        )
        ax.legend(handles=handles, fontsize="small")
    else:
        ax.text(
            0.5,
            0.5,
            "no run has both final RM score and gold",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.set(
        xlabel="final held-out gold",
        ylabel="final RM score",
        title="Final RM score vs gold, one point per run (above the line: RM over-rates)",
    )
    return _png(fig)

