"""``datc-heatmaps``' PNG: its colourbars overlap nothing (issue 57: they sat over a panel's title
and their tick labels over each other). Checked on the drawn figure, from its renderer."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from datc.analysis import heatmaps


def _responses(n_tokens: int, n_responses: int = 2) -> list[heatmaps.ShownResponse]:
    rng = np.random.default_rng(0)
    schemes = ["grpo", "datc", "datc_identity", "datc_unsigned", "delta", "grail", "prob_reweight", "entropy_top"]
    return [heatmaps.ShownResponse(
        prompt="Write a sentence that uses the keywords apple, river and lantern " * 2, label=label,
        advantage=0.731 * (-1) ** i, gold=0.25, tokens=[f"tok{j}" for j in range(n_tokens)],
        weights={s: 1 + rng.normal(0, 0.4, n_tokens) for s in schemes},
        gold_contrib=rng.normal(0, 0.03, n_tokens) - 0.01) for i, label in enumerate(["highest A", "lowest A"][:n_responses])]


def _texts_of(ax) -> list:
    out = [t for t in (ax.title, ax._left_title, ax._right_title) if t.get_text()]
    out += [t for t in [*ax.get_xticklabels(), *ax.get_yticklabels()] if t.get_text() and t.get_visible()]
    return out


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 - 0.5 and b.x0 < a.x1 - 0.5 and a.y0 < b.y1 - 0.5 and b.y0 < a.y1 - 0.5


@pytest.mark.parametrize("n_tokens, n_responses", [(6, 1), (12, 2), (40, 2)])
def test_the_colourbars_overlap_no_title_tick_label_or_each_other(n_tokens, n_responses):
    shown = _responses(n_tokens, n_responses)
    fig = heatmaps.figure(shown, "Token credit on keywords-tiny_gpt2 (step 80)", heatmaps.scales_for(shown))
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    bars = [ax for ax in fig.axes if getattr(ax, "_colorbar", None) is not None]
    panels = [ax for ax in fig.axes if ax not in bars]
    assert len(bars) == 2 and len(panels) == n_responses
    panel_texts = [t.get_window_extent(r) for ax in panels for t in _texts_of(ax)]
    panel_texts += [ax.get_window_extent(r) for ax in panels] + [fig._suptitle.get_window_extent(r)]
    boxes = [bar.get_tightbbox(r) for bar in bars]
    for bar, box in zip(bars, boxes, strict=True):
        for other in panel_texts:
            assert not _overlap(box, other), (bar.get_xlabel() or bar.get_ylabel(), box, other)
        labels = [t.get_window_extent(r) for t in _texts_of(bar)]
        assert len(labels) >= 3  # its low end, centre and high end
        for a, b in itertools.combinations(labels, 2):
            assert not _overlap(a, b), (a, b)
        assert fig.bbox.x0 - 1 <= box.x0 and box.x1 <= fig.bbox.x1 + 1 and fig.bbox.y0 - 1 <= box.y0
    assert not _overlap(*boxes)
