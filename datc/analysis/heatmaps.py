"""Token-credit heatmaps: how each scheme shares a response's advantage among its tokens,
written to <out>/<data>-<policy>.{html,png}.

The first ``--examples`` held-out prompts are sampled once (one group each) with the policy
(the warm start, or with ``--run`` that run's latest checkpoint: plain, DeepSpeed or a LoRA run's adapters); from each group the responses
with the highest and the lowest advantage are shown, so both signs of A appear. Every scheme
weighs the *same* responses. One row per scheme, one cell per response token, coloured on a
diverging scale centred at w = 1 (white; red above, blue below); the first row is the task's
gold contribution per token, centred at 0 (red: the token raised the gold reward).

With ``--run``, the run's own resolved config (``<run>/config.yaml``) says the policy, data,
testbed assets and credit settings, so nothing has to be repeated; only plain fields may be
overridden (e.g. ``cache_dir=...``). Without it, the Hydra overrides compose the config.
Output goes to ``<run>/heatmaps`` (with ``--run``) or ``runs/heatmaps``, never into the checkout
unless ``--out`` says so (the committed figures: ``--out results/four_settings/heatmaps``).

    datc-heatmaps [--run RUN_DIR] [--examples 4] [--out DIR] [--wandb] [overrides ...]

(or ``python -m datc.analysis.heatmaps``). The rows are every credit config and registered
scheme (:func:`datc.analysis.schemes.analysed_schemes`), ``grpo`` first.
"""

from __future__ import annotations

import argparse
import html
import io
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LinearSegmentedColormap, TwoSlopeNorm, to_hex, to_rgb
from matplotlib.figure import Figure

GOLD_ROW = "gold contribution"
# Blue below the centre, white at it, red above. An odd N puts a LUT entry exactly at 0.5, so
# the centre value (w = 1, gold 0) is drawn pure white.
CMAP = LinearSegmentedColormap.from_list("credit", ["#2166ac", "#ffffff", "#b2182b"], N=257)
MIN_HALF_SPAN = 0.05  # a scale spans at least ±5 % around its centre: near-uniform rows stay pale


@dataclass
class ShownResponse:
    """One response as drawn: its n valid tokens only (padding dropped)."""

    prompt: str
    label: str  # which response of its group: "highest A", "lowest A" or "all A equal"
    advantage: float  # A_i
    gold: float | None  # gold reward; None without a testbed task
    tokens: list[str]  # (n,) token texts
    weights: dict[str, np.ndarray]  # scheme name -> (n,) weights w_t
    gold_contrib: np.ndarray | None  # (n,) per-token gold contribution


@dataclass
class Scales:
    """Colour scales shared by every response of a figure, so equal colours mean equal values."""

    weight: TwoSlopeNorm  # weights, centred at w = 1
    gold: TwoSlopeNorm  # gold contributions, centred at 0


def token_text(tok, token_id: int) -> str:
    """A token as it reads in the text (leading space kept); a line break shows as ↵."""
    return tok.decode([token_id]).replace("\n", "↵")


def shown_responses(session, n_examples: int) -> list[ShownResponse]:
    """Sample one group for each of the first ``n_examples`` held-out prompts and keep, per
    group, the responses with the highest and the lowest advantage, weighed by every scheme
    (:func:`datc.analysis.schemes.analysed_schemes`) on the same rollouts."""
    from datc.analysis.inputs import credit_inputs
    from datc.analysis.schemes import analysed_schemes, scheme_outputs

    examples = [session.assets.eval[i] for i in range(n_examples)]
    inputs = credit_inputs(session, examples, generator_seed=session.c.seed)
    outputs = scheme_outputs(inputs, analysed_schemes())
    ro, adv, G = inputs.rollout, inputs.advantages, session.c.trainer.num_generations
    contrib = inputs.gold_contrib
    shown = []
    for start in range(0, len(ro.examples), G):
        group = adv[start : start + G]
        hi, lo = start + int(group.argmax()), start + int(group.argmin())
        picks = {hi: "highest A", lo: "lowest A"} if hi != lo else {hi: "all A equal"}
        for i, label in picks.items():
            n = int(ro.response_mask[i].sum())
            shown.append(ShownResponse(
                prompt=ro.examples[i][session.c.data.prompt_field],
                label=label,
                advantage=float(adv[i]),
                gold=float(inputs.gold[i]) if inputs.gold is not None else None,
                tokens=[token_text(session.m.tok, t) for t in ro.response_ids[i, :n].tolist()],
                weights={k: out.weights[i, :n].cpu().numpy() for k, out in outputs.items()},
                gold_contrib=contrib[i, :n].cpu().numpy() if contrib is not None else None,
            ))
    return shown


def _centred(values: np.ndarray, centre: float) -> TwoSlopeNorm:
    # TwoSlopeNorm needs vmin < centre < vmax, which uniform weights (GRPO) alone would not give
    return TwoSlopeNorm(vcenter=centre, vmin=min(float(values.min()), centre - MIN_HALF_SPAN),
                        vmax=max(float(values.max()), centre + MIN_HALF_SPAN))


def scales_for(responses: list[ShownResponse]) -> Scales:
    w = np.concatenate([[1.0], *(x for r in responses for x in r.weights.values())])
    g = np.concatenate([[0.0], *(r.gold_contrib for r in responses if r.gold_contrib is not None)])
    return Scales(_centred(w, 1.0), _centred(g, 0.0))


def colour(value: float, norm: TwoSlopeNorm) -> str:
    """The heatmap colour of a value, as #rrggbb."""
    return to_hex(CMAP(float(norm(value))))


# ---- HTML -------------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h2 { font-size: 1.05em; margin: 1.6em 0 0.3em; }
p.meta { margin: 0.2em 0 0.4em; }
table.credit { border-collapse: collapse; }
table.credit th { text-align: right; font-weight: normal; padding: 1px 8px; white-space: nowrap; }
table.credit td { font-family: ui-monospace, monospace; white-space: pre; padding: 2px 4px;
                  border: 1px solid #e4e4e4; }
.legend span { display: inline-block; min-width: 3.2em; text-align: center; font-size: 0.8em;
               padding: 2px 0; border: 1px solid #e4e4e4; }
"""


def _cell_style(value: float, norm: TwoSlopeNorm) -> str:
    bg = colour(value, norm)
    dark = float(np.dot(to_rgb(bg), [0.299, 0.587, 0.114])) < 0.5  # keep the token text legible
    return f"background:{bg}" + (";color:#fff" if dark else "")


def _row(name: str, tokens: list[str], values: np.ndarray, norm: TwoSlopeNorm, fmt: str) -> str:
    cells = "".join(
        f'<td style="{_cell_style(v, norm)}" title="{html.escape(name)}: {fmt.format(v)}">'
        f"{html.escape(t)}</td>"
        for t, v in zip(tokens, values.tolist(), strict=True)
    )
    return f'<tr data-row="{html.escape(name)}"><th>{html.escape(name)}</th>{cells}</tr>'


def scale_marks(norm: TwoSlopeNorm) -> list[float]:
    """Seven values spread evenly over each half of a scale: its legend and colourbar ticks."""
    c = float(norm.vcenter)
    return [*np.linspace(norm.vmin, c, 4).tolist(), *np.linspace(c, norm.vmax, 4)[1:].tolist()]


def _legend(norm: TwoSlopeNorm, label: str, fmt: str) -> str:
    swatches = "".join(f'<span style="{_cell_style(v, norm)}">{fmt.format(v)}</span>'
                       for v in scale_marks(norm))
    return f'<p class="legend">{html.escape(label)}: {swatches}</p>'


def render_html(responses: list[ShownResponse], title: str, scales: Scales) -> str:
    """A self-contained page (inline CSS): per response its prompt, A and gold reward, and a
    table of one row per scheme (gold contribution first) and one cell per token; a cell's
    tooltip holds its value."""
    parts = [
        f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        _legend(scales.weight, "weight w (white = 1: the advantage unchanged)", "{:.2f}"),
        _legend(scales.gold, "gold contribution (white = 0)", "{:+.2f}"),
    ]
    for i, r in enumerate(responses):
        gold = "n/a" if r.gold is None else f"{r.gold:.3f}"
        rows = [_row(k, r.tokens, w, scales.weight, "w = {:.4f}") for k, w in r.weights.items()]
        if r.gold_contrib is not None:
            rows.insert(0, _row(GOLD_ROW, r.tokens, r.gold_contrib, scales.gold, "{:+.4f}"))
        parts += [
            f"<h2>Response {i + 1} ({html.escape(r.label)} of its group)</h2>",
            f'<p class="meta">prompt: <code>{html.escape(r.prompt)}</code> · '
            f"A = {r.advantage:+.3f} · gold reward = {gold}</p>",
            f'<table class="credit" data-response="{i}">{"".join(rows)}</table>',
        ]
    parts.append("</body></html>\n")
    return "\n".join(parts)


# ---- PNG --------------------------------------------------------------------------------------


def _tick(token: str) -> str:
    return token.replace("$", r"\$")  # a literal $, not matplotlib mathtext


def _wrapped(text: str, width_in: float, fontsize: float) -> str:
    """``text`` broken into lines that fit ``width_in`` inches at ``fontsize`` points (an
    average glyph is about 0.6 em wide), so a long title is wrapped instead of clipped."""
    chars = max(20, int(width_in * 72 / (0.6 * fontsize)))
    return _tick("\n".join(textwrap.wrap(text, chars, break_long_words=True)))


def render_png(responses: list[ShownResponse], title: str, scales: Scales) -> bytes:
    """:func:`figure` as PNG bytes."""
    buf = io.BytesIO()
    figure(responses, title, scales).savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def figure(responses: list[ShownResponse], title: str, scales: Scales) -> Figure:
    """One subplot per response: schemes × tokens (gold contribution on top, on its own
    scale), token texts along x; one horizontal colourbar per scale in a row of its own below
    them (constrained layout gives each its own space, so a bar covers no title or tick label),
    ticked at its ends and centre. Rendered with Agg; titles are wrapped to the figure's width."""
    n_max = max(len(r.tokens) for r in responses)
    n_rows = 1 + len(responses[0].weights)
    width = min(60.0, 3.0 + 0.32 * n_max)  # inches; very long responses get narrow cells
    panel = 0.9 + 0.28 * n_rows
    height = 0.9 + len(responses) * panel + 0.9  # the colourbars' row: bar, ticks and label
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(len(responses) + 1, 2, height_ratios=[*[panel] * len(responses), 0.12])
    axes = [fig.add_subplot(grid[i, :]) for i in range(len(responses))]
    for ax, r in zip(axes, responses, strict=True):
        names = list(r.weights)
        n, R = len(r.tokens), len(names)
        # Scheme rows at y = 1..R; the gold row, on its own scale, drawn over y = 0.
        ax.imshow(np.stack([r.weights[k] for k in names]), cmap=CMAP, norm=scales.weight,
                  aspect="auto", interpolation="nearest", extent=(-0.5, n - 0.5, R + 0.5, 0.5))
        first = 1
        if r.gold_contrib is not None:
            ax.imshow(r.gold_contrib[None, :], cmap=CMAP, norm=scales.gold, aspect="auto",
                      interpolation="nearest", extent=(-0.5, n - 0.5, 0.5, -0.5))
            first, names = 0, [GOLD_ROW, *names]
        ax.set_ylim(R + 0.5, first - 0.5)
        ax.set_xlim(-0.5, n - 0.5)
        ax.set_xticks(range(n), [_tick(t) for t in r.tokens], rotation=90, fontsize=7)
        ax.set_yticks(range(first, R + 1), names, fontsize=7)
        gold = "n/a" if r.gold is None else f"{r.gold:.3f}"
        ax.set_title(_wrapped(f"{r.prompt}  ({r.label}: A = {r.advantage:+.3f}, gold = {gold})", width * 0.8, 8),
                     fontsize=8, loc="left")
    for col, (norm, label) in enumerate(((scales.weight, "weight w (white = 1)"),
                                         (scales.gold, "gold contribution (white = 0)"))):
        # explicit ticks at the ends and the centre: the default ones skip the short half of a
        # lopsided scale, and seven labels crowd a bar half the figure wide
        bar = fig.colorbar(ScalarMappable(norm, CMAP), cax=fig.add_subplot(grid[-1, col]), orientation="horizontal",
                           ticks=[float(norm.vmin), float(norm.vcenter), float(norm.vmax)], format="%.2f")
        bar.set_label(label, fontsize=8)
        bar.ax.tick_params(labelsize=7)
    fig.suptitle(_wrapped(title, width, 12), fontsize=12)
    return fig


# ---- output -----------------------------------------------------------------------------------


def log_to_wandb(key: str, page: str, png: Path, out_dir: Path) -> None:
    """Log the page and the image to the active W&B run, or to a new offline one in
    ``out_dir``. A failure is reported and never stops the script: the files are written."""
    try:
        import wandb

        run, started = wandb.run, wandb.run is None
        if started:
            run = wandb.init(project="datc", job_type="heatmaps", name=f"heatmaps-{key}",
                             dir=str(out_dir), mode="offline")
        run.log({f"heatmaps/{key}/html": wandb.Html(page),
                 f"heatmaps/{key}/png": wandb.Image(str(png))})
        if started:
            run.finish()  # flushes the offline run; W&B prints how to sync it
    except Exception as e:  # W&B is optional here; the local files hold everything
        print(f"W&B logging failed ({type(e).__name__}: {e}); the heatmaps are in {out_dir}",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="datc-heatmaps", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, help="run directory; the policy loads its last checkpoint")
    ap.add_argument("--examples", type=int, default=4, help="held-out prompts, one group each")
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default: <run>/heatmaps with --run, else runs/heatmaps)")
    ap.add_argument("--wandb", action="store_true", help="also log to W&B (offline without a run)")
    ap.add_argument("overrides", nargs="*",
                    help="Hydra overrides without --run (e.g. policy=tiny_llama data=arithmetic); "
                         "with --run only plain fields (e.g. cache_dir=...)")
    a = ap.parse_args(argv)
    if a.examples < 1:
        ap.error("--examples must be at least 1")
    torch.set_num_threads(1)
    from datc.analysis.inputs import RunRefused, run_session, session_for
    from datc.atomic import atomic_write_bytes, atomic_write_text
    from datc.utils import quiet_libraries

    quiet_libraries()
    if a.run is not None:
        try:
            s, ckpt = run_session(a.run, list(a.overrides))
        except RunRefused as e:  # one line, exit 2, as a usage error
            print(f"datc-heatmaps: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        source = f"run {a.run.resolve().name}, step {int(ckpt.name.split('_')[1])}"
        out = a.out or a.run / "heatmaps"
    else:
        s, source, out = session_for(list(a.overrides)), "warm-started policy", a.out or Path("runs") / "heatmaps"
    responses = shown_responses(s, a.examples)
    key = f"{s.c.data.name}-{s.c.policy.name}"
    title = f"Token credit on {key} ({source})"
    scales = scales_for(responses)
    page = render_html(responses, title, scales)
    html_path, png_path = out / f"{key}.html", out / f"{key}.png"
    atomic_write_text(html_path, page)
    atomic_write_bytes(png_path, render_png(responses, title, scales))
    print(html_path)
    print(png_path)
    if a.wandb:
        log_to_wandb(key, page, png_path, out)


if __name__ == "__main__":
    main()
