"""The credit breakdown of METHOD §6 (datc/analysis/breakdown.py) against a hand-computed case:
quintile edges, sign accuracy, per-response z-scores, the separation of tokens with c > 0 from
those with c < 0, gold mass shares and the end-of-text classes."""

from __future__ import annotations

import math

import pytest
import torch

from datc.analysis.breakdown import Tokens, breakdown, breakdown_markdown, standardize_rows


def hand_case():
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    contrib = torch.tensor([[1.0, 0.0, -1.0], [2.0, 0.0, 0.0]])
    prob = torch.tensor([[0.1, 0.5, 0.9], [0.2, 0.6, 0.3]])
    end = torch.tensor([[False, False, True], [False, True, False]])
    scores = torch.tensor([[3.0, 1.0, -1.0], [1.0, 2.0, 7.0]])  # judged = sign(A) s: [3, 1, -1], [-1, -2]
    weights = torch.tensor([[2.0, 1.0, 0.0], [0.5, 1.5, 9.0]])
    t = Tokens()
    m = t.add_batch(prob, contrib, adv, mask, end)
    t.add_scheme("x", scores, weights, adv, m)
    return t


def test_the_breakdown_matches_the_hand_computed_case():
    r = breakdown(hand_case())
    # recorded probabilities 0.1, 0.2, 0.5, 0.6, 0.9: linear quantiles at 0.2 .. 0.8
    assert r["edges"] == pytest.approx([0.18, 0.38, 0.54, 0.66]) and r["tokens"] == 5
    q = r["schemes"]["x"]["by_quintile"]
    z0 = 2 / math.sqrt(8 / 3)  # row 0's judged [3, 1, -1]: mean 1, population sd sqrt(8/3)
    assert [g["tokens"] for g in q] == [1, 1, 1, 1, 1]
    assert [g["gold_share"] for g in q] == pytest.approx([0.25, 0.5, 0.0, 0.0, 0.25])
    assert [g["sign_accuracy"] for g in q] == [1.0, 0.0, None, None, 1.0]  # p 0.2: c = 2, judged -1: wrong
    assert [g["mean_abs_z"] for g in q] == pytest.approx([z0, 1.0, 0.0, 1.0, z0])  # row 1: [-1, -2] -> z [1, -1]
    assert [g["mean_weight"] for g in q] == pytest.approx([2.0, 0.5, 1.0, 1.5, 0.0])  # the padded 9 never enters
    c = r["schemes"]["x"]["by_class"]
    assert (c["earned"]["tokens"], c["neutral"]["tokens"], c["against"]["tokens"]) == (1, 2, 2)
    assert c["against"]["sign_accuracy"] == 0.5 and c["against"]["mean_abs_z"] == pytest.approx((z0 + 1) / 2)
    assert c["end token, A > 0"]["mean_weight"] == 0.0 and c["end token, A < 0"]["mean_weight"] == 1.5
    one = breakdown(hand_case(), n_bins=1)["schemes"]["x"]["by_quintile"][0]
    assert one["separation"] == pytest.approx((z0 + 1.0) / 2 + z0)  # c > 0: z0 and +1; c < 0: -z0
    assert one["sign_accuracy"] == pytest.approx(2 / 3)
    assert any(ln.startswith("| x | 1.000 | 0.000 | n/a | n/a | 1.000 |") for ln in breakdown_markdown(r))


def test_a_response_with_constant_scores_or_one_token_gets_z_zero():
    x = torch.tensor([[2.0, 2.0, 2.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert torch.equal(standardize_rows(x, mask), torch.zeros(2, 3))
