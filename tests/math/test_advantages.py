import pytest
import torch

from datc.math.advantages import SCALE_EPS, group_advantages


def test_group_scaling_hand_values():
    # Group 1: r = [1, 2, 3] -> mean 2, unbiased std 1 -> A = [-1, 0, 1] / (1 + 1e-4).
    # Group 2: r = [5, 5, 5] -> all equal -> A = 0.
    r = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    a = group_advantages(r, 3, "group")
    expected = torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]) / torch.tensor([1 + SCALE_EPS] * 3 + [SCALE_EPS] * 3)
    expected[3:] = 0.0
    torch.testing.assert_close(a, expected)


def test_none_is_dr_grpo_centering_only():
    r = torch.tensor([0.0, 4.0, 1.0, 3.0])
    # groups [0, 4] -> mean 2 -> [-2, 2]; [1, 3] -> mean 2 -> [-1, 1]
    torch.testing.assert_close(group_advantages(r, 2, "none"), torch.tensor([-2.0, 2.0, -1.0, 1.0]))


def test_batch_scaling_uses_batch_std():
    r = torch.tensor([0.0, 4.0, 1.0, 3.0])
    # batch unbiased std of [0,4,1,3]: mean 2, squares 4+4+1+1=10, /3 -> sqrt(10/3)
    std = (10.0 / 3.0) ** 0.5
    torch.testing.assert_close(group_advantages(r, 2, "batch"), torch.tensor([-2.0, 2.0, -1.0, 1.0]) / (std + SCALE_EPS))


def test_matches_trl_formula_on_random_rewards():
    # TRL GRPOTrainer: mean_grouped_rewards / std_grouped_rewards via view(-1, G), repeat_interleave.
    torch.manual_seed(0)
    r = torch.randn(24)
    G = 6
    mean = r.view(-1, G).mean(1).repeat_interleave(G)
    std = r.view(-1, G).std(1).repeat_interleave(G)
    torch.testing.assert_close(group_advantages(r, G, "group"), (r - mean) / (std + 1e-4))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_float32_rewards_give_exactly_zero(scale):
    # METHOD §1: all-equal groups give A = 0 exactly. In float32 the group mean of G equal
    # values can differ from them by a rounding step; over std + eps that step became
    # advantages up to ~0.02 for 643 of these 1500 groups before the equality test.
    gen = torch.Generator().manual_seed(0)
    G = 6
    values = torch.randn(1500, generator=gen) * torch.logspace(-3, 3, 1500)
    r = values.repeat_interleave(G).to(torch.float32)
    a = group_advantages(r, G, scale)
    assert a.dtype == torch.float32
    assert (a == 0).all()
    # a group with one different reward is untouched and exactly as before
    r2 = torch.tensor([1.0, 1.0, 1.0, 2.0, 0.3, 0.3, 0.3, 0.3])
    a2 = group_advantages(r2, 4, "group")
    assert (a2[4:] == 0).all()
    g = r2[:4]
    torch.testing.assert_close(a2[:4], (g - g.mean()) / (g.std() + SCALE_EPS), rtol=0, atol=0)
