import math

import pytest
import torch

from datc.credit import CreditBatch, compute_credit, resolve_scheme


def test_hand_values_and_no_renormalization():
    # pi_old = [0.5, 0.1 | 1.0, pad]; alpha = 0.2 -> w = 0.2 pi + 0.8 = [0.9, 0.82 | 1.0, 0].
    scheme, params = resolve_scheme({"name": "prob_reweight"})
    old = torch.log(torch.tensor([[0.5, 0.1], [1.0, 0.3]]))
    mask = torch.tensor([[True, True], [True, False]])
    out = compute_credit(scheme, CreditBatch(torch.zeros(2, 2, dtype=torch.long), mask, torch.tensor([1.0, -1.0]),
                                             old_logps=old), params)
    torch.testing.assert_close(out.weights, torch.tensor([[0.9, 0.82], [1.0, 0.0]]))
    assert out.normalization == "none"  # the response mean is 0.86, not 1: reported, not hidden
    assert out.weights.min() >= 0 and not out.fallback.any()


def test_alpha_zero_is_grpo_and_alpha_out_of_range_is_refused():
    scheme, params = resolve_scheme({"name": "prob_reweight", "alpha": 0.0})
    mask = torch.ones(1, 3, dtype=torch.bool)
    out = compute_credit(scheme, CreditBatch(torch.zeros(1, 3, dtype=torch.long), mask, torch.ones(1),
                                             old_logps=torch.log(torch.tensor([[0.2, 0.3, 0.5]]))), params)
    assert torch.equal(out.weights, torch.ones(1, 3))
    with pytest.raises(ValueError, match="alpha"):
        resolve_scheme({"name": "prob_reweight", "alpha": 1.5})
    assert math.isclose(resolve_scheme({"name": "prob_reweight"})[1].alpha, 0.2)
