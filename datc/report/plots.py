"""The comparison's plots (PNG bytes): gold curves, credit accuracy, final RM score against
final gold."""

from __future__ import annotations

import io
import math
import textwrap
from typing import Any

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from datc.report.loading import UNIFORM_CREDIT
from datc.report.statistics import Report, curve_band, group_runs

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
SCHEME_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p", "d", "H", "8")
LINESTYLES = ("-", "--", "-.", ":")
# tab20 without its two greys (indices 14, 15), so no scheme is mistaken for the black baseline:
# its nine saturated colours first, then their light twins (in tab20's order a colour's twin came
# next, and two curves of 8 schemes were near-identical oranges)
_PALETTE = [i for i in range(0, 20, 2) if i != 14] + [i for i in range(1, 20, 2) if i != 15]


class Style(dict):
    """Per-scheme ``color``, ``marker``, ``linestyle``, ``linewidth``, ``zorder``: the baseline
    black, thick and on top; every other scheme its own (colour, marker, line style): the first 18
    schemes each a colour of their own, and no two schemes share all three for up to
    18 × 15 × 4 = 1080 schemes (:func:`scheme_style`)."""


def scheme_style(i: int) -> tuple[int, str, str]:
    """The ``i``-th non-baseline scheme's (palette index, marker, line style). Colour ``i mod 18``;
    marker ``(i + i // 18) mod 15``, which differs between two schemes of one colour (their
    indices differ by 18 m, their markers by 19 m, not a multiple of 15 for m < 15); then the line
    style every 270 schemes."""
    nc, nm = len(_PALETTE), len(SCHEME_MARKERS)
    return _PALETTE[i % nc], SCHEME_MARKERS[(i + i // nc) % nm], LINESTYLES[(i // (nc * nm)) % len(LINESTYLES)]


def _styles(report: Report) -> dict[str, Style]:
    cmap = matplotlib.colormaps["tab20"]
    out, i = {}, 0
    for s in report.schemes:
        if s == report.baseline:
            out[s] = Style(color="black", marker="o", linestyle="-", linewidth=2.6, zorder=5)
            continue
        color, marker, linestyle = scheme_style(i)
        out[s] = Style(color=cmap(color), marker=marker, linestyle=linestyle, linewidth=1.4, zorder=3)
        i += 1
    return out


def _colors(report: Report) -> dict[str, Any]:
    return {s: st["color"] for s, st in _styles(report).items()}


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # render with Agg whatever pyplot's backend is
    return fig


def wrapped(text: str, fig: Figure, fontsize_pt: float = 12.0) -> str:
    """``text`` wrapped to the figure's width (a title on a one-panel figure was cut off at its
    edges): about 0.55 em per character of the default sans-serif font."""
    chars = max(20, int(fig.get_figwidth() * 72 / (0.55 * fontsize_pt)))
    return textwrap.fill(text, chars)


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    return buf.getvalue()


def plot_gold_curves(report: Report) -> bytes:
    """One subplot per setting, one line per scheme: mean gold over seeds by step, with the
    95% t-interval shaded where at least 2 seeds were evaluated at that step."""
    settings, styles, groups = report.settings, _styles(report), group_runs(report.runs)
    ncols = 1 if len(settings) == 1 else 2
    nrows = math.ceil(len(settings) / ncols)
    fig = _figure(5.5 * ncols, 3.6 * nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, setting in zip(axes, settings, strict=False):
        for row in (r for r in report.rows if r.setting == setting):
            band = curve_band(groups[(row.data, row.policy, row.scheme)])
            if band is None:
                continue
            st = styles[row.scheme]
            c = st["color"]
            collapsed = f", {len(row.collapsed)} collapsed" if row.collapsed else ""
            ax.plot(band.steps, band.mean, color=c, marker=st["marker"], markersize=4, linewidth=st["linewidth"],
                    linestyle=st["linestyle"], zorder=st["zorder"],
                    # a scheme with length-collapsed runs (METHOD §6): hollow markers, and said in its label
                    markerfacecolor="white" if row.collapsed else c,
                    label=f"{row.scheme} (n={int(band.n.max())}{collapsed})")
            # light fill and a thin edge of the scheme's colour: overlapping bands stay readable
            ax.fill_between(band.steps, band.mean - band.half_width, band.mean + band.half_width,
                            facecolor=c, alpha=0.10, edgecolor=c, linewidth=0.5)
        if not ax.lines:
            ax.text(
                0.5, 0.5, "no eval curve recorded", ha="center", va="center", transform=ax.transAxes
            )
        else:
            ax.legend(fontsize="x-small", ncols=2 if len(ax.lines) > 6 else 1)
        ax.set(title=setting, xlabel="step", ylabel="held-out gold")
    for ax in axes[len(settings) :]:
        ax.set_visible(False)
    fig.suptitle(wrapped("Held-out gold: mean over seeds; band = 95% Student-t interval (steps with ≥2 seeds); "
                         "hollow markers: a scheme with length-collapsed runs (METHOD §6)", fig))
    return _png(fig)


def plot_credit_accuracy(report: Report) -> bytes:
    """One panel per setting (two columns), one horizontal bar per scheme (uniform-credit schemes
    left out): mean credit accuracy over seeds, error bar = 95% t half-width (none for n = 1).
    Horizontal bars keep every scheme's name readable whatever the number of schemes."""
    rows = [
        r
        for r in report.rows
        if r.scheme not in UNIFORM_CREDIT and r.cells["credit_accuracy"].mean is not None
    ]
    settings = [s for s in report.settings if any(r.setting == s for r in rows)]
    schemes = [s for s in report.schemes if any(r.scheme == s for r in rows)]
    colors = _colors(report)
    ncols = 1 if len(settings) <= 1 else 2
    nrows = max(1, math.ceil(len(settings) / ncols))
    fig = _figure(5.5 * ncols, 0.9 + (0.3 * max(len(schemes), 1) + 0.8) * nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, setting in zip(axes, settings, strict=False):
        ivs = {r.scheme: r.cells["credit_accuracy"] for r in rows if r.setting == setting}
        present = [s for s in schemes if s in ivs]
        ys = list(range(len(present)))[::-1]  # the first scheme at the top
        ax.barh(
            ys,
            [ivs[s].mean for s in present],
            color=[colors[s] for s in present],
            xerr=[np.nan if ivs[s].half_width is None else ivs[s].half_width for s in present],
            capsize=3,
        )
        ax.set_yticks(ys, present)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set(title=setting, xlabel="credit accuracy (Spearman ρ)")
    if not rows:
        axes[0].text(
            0.5, 0.5, "no credit accuracy recorded", ha="center", va="center", transform=axes[0].transAxes
        )
    for ax in axes[max(len(settings), 1) :]:
        ax.set_visible(False)
    fig.suptitle(wrapped("Credit accuracy: mean over seeds ± 95% t-interval "
                         f"({', '.join(sorted(UNIFORM_CREDIT))}: undefined)", fig))
    return _png(fig)


def plot_rm_vs_gold(report: Report) -> bytes:
    """One point per run: final RM score (y) against final held-out gold (x), coloured by scheme,
    marker by setting, with y = x. Points above the line are runs the RM over-rates."""
    styles = _styles(report)
    colors = {s: st["color"] for s, st in styles.items()}
    markers = {s: MARKERS[i % len(MARKERS)] for i, s in enumerate(report.settings)}
    runs = [r for r in report.runs if r.final_gold is not None and r.final_rm_score is not None]
    fig = _figure(6.5, 5.0)
    ax = fig.subplots()
    for run in runs:
        collapsed = run.collapse_step is not None  # METHOD §6: drawn hollow, not folded in silently
        ax.scatter(
            run.final_gold,
            run.final_rm_score,
            facecolors="none" if collapsed else colors[run.credit],
            edgecolors=colors[run.credit] if collapsed else "none",
            marker=markers[run.setting],
            alpha=0.8,
            s=60 if run.credit == report.baseline else 30,
            zorder=styles[run.credit]["zorder"],
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
        if any(r.collapse_step is not None for r in runs):
            handles.append(Line2D([], [], color="gray", marker="o", markerfacecolor="none", linestyle="",
                                  label="hollow: length collapse"))
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
        title=wrapped("Final RM score vs gold, one point per run (above the line: RM over-rates)", fig),
    )
    return _png(fig)

