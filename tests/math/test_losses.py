import math

import pytest
import torch

from datc.math.losses import AggNorm, aggregate, clipped_policy_loss, kl_k3


def test_kl_k3_hand_values():
    # d = ref - logp; k3 = e^d - d - 1. d = 0 -> 0; d = ln 2 -> 2 - ln2 - 1 = 1 - ln 2.
    logp = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-1.0, -1.0 + math.log(2.0)]])
    torch.testing.assert_close(kl_k3(logp, ref), torch.tensor([[0.0, 1 - math.log(2.0)]]))


def test_clipped_loss_hand_values():
    # ratio = e^{logp - old}. Token 1: ratio 1.5, A = +1, eps_high 0.2 -> min(1.5, 1.2) = 1.2 -> loss -1.2 (clipped).
    # Token 2: ratio 0.5, A = +1 -> min(0.5, 0.8) = 0.5 -> loss -0.5 (not clipped).
    # Token 3: ratio 0.5, A = -1 -> min(-0.5, -0.8) = -0.8 -> loss 0.8 (clipped).
    # Token 4: ratio 1.5, A = -1 -> min(-1.5, -1.2) = -1.5 -> loss 1.5 (not clipped).
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 0.5, 1.5]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    out = clipped_policy_loss(logp, old, adv, 0.2, 0.2)
    torch.testing.assert_close(out.loss, torch.tensor([[-1.2, -0.5, 0.8, 1.5]]))
    assert out.clipped.tolist() == [[True, False, True, False]]
    assert out.kl is None


def test_asymmetric_clip_and_kl_term():
    # eps_high 0.28 (DAPO clip-higher): ratio 1.5, A=1 -> 1.28; beta 0.1 adds 0.1 * k3.
    old = torch.zeros(1, 1)
    logp = torch.log(torch.tensor([[1.5]]))
    ref = torch.log(torch.tensor([[0.75]]))
    out = clipped_policy_loss(logp, old, torch.ones(1, 1), 0.2, 0.28, beta=0.1, ref_logps=ref)
    d = math.log(0.75) - math.log(1.5)
    torch.testing.assert_close(out.loss, torch.tensor([[-1.28 + 0.1 * (math.exp(d) - d - 1)]]))


def test_on_policy_gradient_is_minus_advantage_times_grad_logp():
    # At ratio 1 the clipped objective's gradient is -A * dlogp (the REINFORCE term).
    logp = torch.tensor([[-0.7, -1.2]], requires_grad=True)
    adv = torch.tensor([[2.0, -0.5]])
    out = clipped_policy_loss(logp, logp.detach(), adv, 0.2, 0.2)
    out.loss.sum().backward()
    torch.testing.assert_close(logp.grad, -adv)


LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]).bool()


def test_aggregation_hand_values():
    norm = AggNorm(num_seqs=2, num_tokens=6, norm_len=4)
    # token-mean: (1+2+3+4+10+20) / 6 = 40/6
    assert aggregate(LOSS, MASK, "token-mean", norm).item() == pytest.approx(40 / 6)
    # seq-mean-token-mean: mean(10/4, 30/2) = (2.5 + 15) / 2 = 8.75
    assert aggregate(LOSS, MASK, "seq-mean-token-mean", norm).item() == pytest.approx(8.75)
    # seq-mean-token-sum-norm: (10 + 30) / (4 * 2) = 5
    assert aggregate(LOSS, MASK, "seq-mean-token-sum-norm", norm).item() == pytest.approx(5.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_sum_to_the_batch(mode):
    torch.manual_seed(0)
    loss = torch.randn(6, 5)
    mask = torch.rand(6, 5) > 0.3
    mask[:, 0] = True
    norm = AggNorm(num_seqs=6, num_tokens=float(mask.sum()), norm_len=5)
    whole = aggregate(loss, mask, mode, norm)
    parts = sum(aggregate(loss[i : i + 2], mask[i : i + 2], mode, norm) for i in range(0, 6, 2))
    torch.testing.assert_close(parts, whole)


def test_aggregation_matches_trl_and_verl_formulas():
    torch.manual_seed(1)
    loss = torch.randn(4, 7)
    mask = (torch.rand(4, 7) > 0.4).float()
    mask[:, 0] = 1
    norm = AggNorm(num_seqs=4, num_tokens=float(mask.sum()), norm_len=7)
    # TRL loss_type="grpo": ((l*m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    trl_grpo = ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    # TRL loss_type="dapo"/"bnpo": (l*m).sum() / m.sum()
    trl_dapo = (loss * mask).sum() / mask.sum()
    # TRL loss_type="dr_grpo": (l*m).sum() / (B * max_completion_length)
    trl_dr = (loss * mask).sum() / (4 * 7)
    torch.testing.assert_close(aggregate(loss, mask.bool(), "seq-mean-token-mean", norm), trl_grpo)
    torch.testing.assert_close(aggregate(loss, mask.bool(), "token-mean", norm), trl_dapo)
    torch.testing.assert_close(aggregate(loss, mask.bool(), "seq-mean-token-sum-norm", norm), trl_dr)


def test_the_k3_formula_has_one_copy_in_the_package():
    import re
    from pathlib import Path

    from datc.math.losses import k3

    d = torch.tensor([-1.0, 0.0, 2.0])
    assert torch.equal(k3(d), torch.exp(d) - d - 1) and k3(d)[1] == 0
    pattern = re.compile(r"exp\((\w*)\)\s*-\s*\1\s*-\s*1|(\w+)\.exp\(\)\s*-\s*\2\s*-\s*1")
    pkg = Path(__file__).resolve().parents[2] / "datc"
    copies = [f"{p.relative_to(pkg)}:{i}" for p in pkg.rglob("*.py") for i, ln in enumerate(p.read_text().splitlines(), 1)
              if pattern.search(ln) and p.name != "losses.py"]
    assert not copies, f"inline k3 copies (call datc.math.losses.k3): {copies}"
