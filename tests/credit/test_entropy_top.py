import pytest
import torch

from datc.credit import CreditBatch, compute_credit, resolve_scheme


def _run(entropy, mask, **params):
    scheme, p = resolve_scheme({"name": "entropy_top", **params})
    return compute_credit(scheme, CreditBatch(torch.zeros(mask.shape, dtype=torch.long), mask, torch.ones(mask.shape[0]),
                                              entropy=entropy), p)


def test_top_fifth_of_the_batch_hand_values():
    # 10 valid tokens, entropies 1..10, rho 0.2 -> keep the two highest (9 and 10); each gets
    # N_valid / N_kept = 10 / 2 = 5 so the batch's mean weight is 1 (the paper's mean over kept).
    ent = torch.arange(1.0, 11.0).view(2, 5)
    out = _run(ent, torch.ones(2, 5, dtype=torch.bool))
    expected = torch.zeros(2, 5)
    expected[1, 3:] = 5.0
    torch.testing.assert_close(out.weights, expected)
    assert out.normalization == "global" and out.weights.sum() == 10.0


def test_padding_is_never_kept_and_does_not_move_the_threshold():
    ent = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    out = _run(ent, mask, rho=0.2)
    # Valid entropies [1, 2, 3, 4, 5]: the 0.8 quantile is 4.2 -> keep 5 alone, weight 5 / 1.
    assert out.weights[0, 2] == 0.0
    torch.testing.assert_close(out.weights, torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 5.0]]))


def test_rho_one_is_grpo_and_bad_rho_is_refused():
    out = _run(torch.rand(2, 4), torch.ones(2, 4, dtype=torch.bool), rho=1.0)
    assert torch.equal(out.weights, torch.ones(2, 4))
    with pytest.raises(ValueError, match="rho"):
        resolve_scheme({"name": "entropy_top", "rho": 0.0})
