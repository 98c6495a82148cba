"""The weight step's ``end_token: neutral`` (datc.credit.weights, METHOD §6's length collapse):
against a brute-force reference that weights each response's other tokens alone and sets the end
token to 1; a truncated response is weighted as without the option; the option at its default
leaves a run's identity as it was before the option."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from datc.credit.base import end_of_text
from datc.credit.weights import WeightParams, scores_to_weights


def brute_force(scores, mask, end, params):
    out = torch.zeros_like(scores, dtype=torch.float32)
    for i in range(scores.shape[0]):
        idx = [t for t in range(scores.shape[1]) if mask[i, t] and not end[i, t]]
        if idx:  # the other tokens alone, as a one-row batch
            row_mask = torch.zeros(1, scores.shape[1], dtype=torch.bool)
            row_mask[0, idx] = True
            w, _ = scores_to_weights(scores[i:i + 1], row_mask, dataclasses.replace(params, end_token="score"))
            out[i] = w[0]
        for t in range(scores.shape[1]):
            if end[i, t]:
                out[i, t] = 1.0
    return out


@pytest.mark.parametrize("params", [WeightParams(end_token="neutral"), WeightParams(end_token="neutral", tau=0.5),
                                    WeightParams(end_token="neutral", normalizer="linear", w_max=3.0),
                                    WeightParams(end_token="neutral", normalizer="rank_power", lam=0.5)])
def test_neutral_end_token_matches_the_brute_force_reference(params):
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([9, 1, 2, 5, 9, 3])
    mask = torch.arange(9) < lengths[:, None]
    truncated = torch.tensor([True, False, False, False, False, True])
    end = end_of_text(mask, truncated)
    assert end.sum(-1).tolist() == [0, 1, 1, 1, 1, 0] and end[3, 4] and end[1, 0]
    scores = torch.randn(6, 9, generator=g) * 3
    w, fallback = scores_to_weights(scores, mask, params, end)
    torch.testing.assert_close(w, brute_force(scores, mask, end, params), rtol=0, atol=0)
    assert torch.allclose((w * mask).sum(-1) / lengths, torch.ones(6), atol=1e-6)  # mean 1 over each response
    assert (w[end] == 1).all() and (w[~mask] == 0).all()
    # rows 1 and 2 keep fewer than two other tokens: they fall back to 1 everywhere
    assert fallback.tolist()[:3] == [False, True, True] and (w[1:3][mask[1:3]] == 1).all()
    # a truncated response (rows 0 and 5) is weighted as without the option
    plain, _ = scores_to_weights(scores, mask, dataclasses.replace(params, end_token="score"))
    assert torch.equal(w[[0, 5]], plain[[0, 5]]) and not torch.equal(w[3], plain[3])


def test_bad_values_and_a_missing_end_are_refused():
    with pytest.raises(ValueError, match=r"end_token must be one of \('score', 'neutral'\), got 'drop'"):
        WeightParams(end_token="drop")
    with pytest.raises(ValueError, match="end_token: neutral needs each response's end-of-text token"):
        scores_to_weights(torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool), WeightParams(end_token="neutral"))


def test_the_default_keeps_the_identity_a_run_had_before_the_option():
    from datc.run.identity import identity

    before = {"trainer": {"lr": 1e-3}, "credit": {"name": "datc", "tau": 1.0}}
    assert identity({**before, "credit": {**before["credit"], "end_token": "score"}}) == identity(before)
    assert identity({**before, "credit": {**before["credit"], "end_token": "neutral"}}) != identity(before)
