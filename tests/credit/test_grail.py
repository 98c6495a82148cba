"""``grail``: GRAIL's log-z-scored grad × input saliency weights (declare-lab/grail)."""

import math

import pytest
import torch

from datc.credit import CreditBatch, compute_credit, resolve_scheme
from datc.engines.generate import sample_groups
from datc.forward.attribution import policy_grad_x_input


def _batch(gx, mask, adv):
    return CreditBatch(torch.zeros(mask.shape, dtype=torch.long), mask, adv, policy_grad_x_input=gx)


def test_hand_values_log_z_score_and_clamp():
    # Saliencies s = ‖gx‖ = (1, e, e^2) on response 0 (gx along one axis): log s = (0, 1, 2),
    # mean 1, population variance 2/3, z = (-1, 0, 1) / sqrt(2/3 + 1e-8) = (-1.2247, 0, 1.2247);
    # w = 1 + 0.5 z = (0.3876, 1, 1.6124), inside [0.1, 5]: not renormalized (mean 1 here by symmetry).
    # Response 1: s = (1, 1e-6, ...) padded after two: log s = (0, -13.8155), z = (1, -1),
    # w = (1.5, 0.5). With std 5 instead: 1 + 5 z = (6, -4) -> clamped to (5, 0.1).
    gx = torch.zeros(2, 3, 2, dtype=torch.float64)
    gx[0, :, 0] = torch.tensor([1.0, math.e, math.e**2])
    gx[1, :2, 1] = torch.tensor([1.0, 1e-6])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    scheme, params = resolve_scheme({"name": "grail"})
    assert (params.std, params.mean, params.w_min, params.w_max) == (0.5, 1.0, 0.1, 5.0)
    out = compute_credit(scheme, _batch(gx, mask, torch.tensor([1.0, -1.0])), params)
    z = 1 / math.sqrt(2 / 3 + 1e-8)
    torch.testing.assert_close(out.weights, torch.tensor([[1 - 0.5 * z, 1.0, 1 + 0.5 * z], [1.5, 0.5, 0.0]]))
    assert out.normalization == "none"
    _, wide = resolve_scheme({"name": "grail", "std": 5.0})
    torch.testing.assert_close(compute_credit(scheme, _batch(gx, mask, torch.tensor([1.0, -1.0])), wide).weights[1],
                               torch.tensor([5.0, 0.1, 0.0]))
    # rollout_symmetry: "wrong" reweights only A <= 0 responses, the others get w = 1.
    _, wrong = resolve_scheme({"name": "grail", "rollout_symmetry": "wrong"})
    w = compute_credit(scheme, _batch(gx, mask, torch.tensor([1.0, -1.0])), wrong).weights
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 1.0], [1.5, 0.5, 0.0]]))


def test_bad_fields_are_refused():
    with pytest.raises(ValueError, match="rollout_symmetry"):
        resolve_scheme({"name": "grail", "rollout_symmetry": "some"})
    with pytest.raises(ValueError, match="w_min <= mean <= w_max"):
        resolve_scheme({"name": "grail", "w_min": 2.0})


def test_grad_x_input_is_read_where_the_code_reads_it(policy, tok):
    # e ⊙ ∂NLL/∂e at the input that predicts y_t (column P - 1 + t), computed here by plain
    # autograd on each response alone (no padding) and compared with the batched pass.
    torch.manual_seed(0)
    ro = sample_groups(policy, tok, [{"prompt": "write about food :"}, {"prompt": "compute 1 plus 12 ="}], 2, 5,
                       temperature=0.7)
    gx = policy_grad_x_input(policy, ro, 0.7, micro=3)
    for i in range(ro.response_ids.shape[0]):
        n = int(ro.response_mask[i].sum())
        p = int(ro.prompt_mask[i].sum())
        ids = torch.cat([ro.prompt_ids[i][ro.prompt_mask[i]], ro.response_ids[i, :n]])[None]
        e = policy.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = policy(inputs_embeds=e).logits[0, p - 1 : p + n - 1] / 0.7
        nll = -torch.log_softmax(logits, -1).gather(-1, ids[0, p:, None]).sum()
        (g,) = torch.autograd.grad(nll, e)
        torch.testing.assert_close(gx[i, :n], (g * e)[0, p - 1 : p + n - 1].detach(), atol=1e-5, rtol=1e-4)
        assert (gx[i, n:] == 0).all()
    assert all(p.grad is None for p in policy.parameters())  # no parameter gradients
