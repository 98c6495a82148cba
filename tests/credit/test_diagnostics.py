import math

import torch

from datc.credit.base import CreditOutput
from datc.credit.diagnostics import credit_accuracy, credit_accuracy_rows, credit_metrics


def test_credit_accuracy_hand_values():
    # Response 1: scores rank the tokens exactly as the gold does -> Spearman 1.
    # Response 2: reversed ranks -> -1. Response 3: constant gold -> skipped. Mean = 0.
    s = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [1.0, 2.0, 3.0]])
    g = torch.tensor([[0.0, 0.5, 1.0], [0.0, 0.5, 1.0], [0.2, 0.2, 0.2]])
    mask = torch.ones(3, 3, dtype=torch.bool)
    assert credit_accuracy(s, g, mask) == 0.0
    assert credit_accuracy(s[:1], g[:1], mask[:1]) == 1.0


def test_uniform_weights_have_undefined_accuracy_not_zero():
    w = torch.ones(2, 3)
    out = CreditOutput(w, None, torch.zeros(2, dtype=torch.bool), "per_response")
    m = credit_metrics(out, torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool),
                       torch.tensor([[0.0, 1.0, -1.0], [1.0, 0.0, 0.0]]))
    assert math.isnan(m["credit/accuracy"])
    assert m["credit/ess"] == 1.0 and m["credit/weight_std"] == 0.0


def test_weight_statistics_hand_values():
    # One response, weights [2, 1, 0] (mean 1): ESS = (3)^2 / (3 * (4 + 1 + 0)) = 0.6;
    # one of three tokens above 1; scores [3, 2, 1]: median 2.
    w = torch.tensor([[2.0, 1.0, 0.0]])
    out = CreditOutput(w, torch.tensor([[3.0, 2.0, 1.0]]), torch.zeros(1, dtype=torch.bool), "per_response")
    m = credit_metrics(out, torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool), None)
    assert math.isclose(m["credit/ess"], 0.6, rel_tol=1e-6)
    assert math.isclose(m["credit/frac_above_1"], 1 / 3, rel_tol=1e-6)
    assert m["credit/score_p50"] == 2.0 and m["credit/weight_max"] == 2.0


def test_credit_accuracy_equals_scipy_spearman_with_ties_masks_and_constant_rows():
    import math

    import numpy as np
    import torch
    from scipy.stats import spearmanr

    g = torch.Generator().manual_seed(0)
    B, T = 40, 12
    s = torch.randint(0, 4, (B, T), generator=g).float()  # many ties
    gold = torch.randint(-1, 2, (B, T), generator=g).float()
    mask = torch.rand(B, T, generator=g) > 0.3
    s[0] = 1.0  # a constant row: skipped
    mask[1, 1:] = False  # one valid token: skipped
    s[2, 0] = float("nan")  # non-finite: skipped
    want = []
    for i in range(B):
        a, b = s[i][mask[i]].numpy(), gold[i][mask[i]].numpy()
        if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0 or not np.isfinite(a).all():
            continue
        want.append(spearmanr(a, b).statistic)
    got = credit_accuracy(s, gold, mask)
    assert math.isclose(got, float(np.mean(want)), rel_tol=1e-12, abs_tol=1e-12)
    rows = credit_accuracy_rows(s, gold, mask)  # the same, response by response, NaN where skipped
    assert rows.shape == (B,) and rows[:3].isnan().all()
    assert np.allclose(rows[~rows.isnan()].numpy(), want, rtol=1e-12, atol=1e-12)
