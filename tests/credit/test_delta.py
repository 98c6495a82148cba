import math

import pytest
import torch

from datc.credit import CreditBatch, compute_credit, resolve_scheme
from datc.engines.generate import sample_groups
from datc.forward.passes import rollout_policy_pass

SIG2 = 1 / (1 + math.exp(-2))  # sigmoid(2) = 0.8808


def _hand_batch():
    # 3 responses of 2 tokens, d = 2, pi_old(y_t) = 0.5 everywhere so v_t = (1 - 0.5) h_t = h_t / 2.
    #   response 0, A = +1: v = (2, 0), (0, 0)
    #   response 1, A = -1: v = (-2, 0), (0, 0)
    #   response 2, A = 0:  v = (1, 1), (1, 1)
    v = torch.tensor([[[2.0, 0.0], [0.0, 0.0]], [[-2.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]])
    return CreditBatch(torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.bool),
                       torch.tensor([1.0, -1.0, 0.0]), old_logps=torch.full((3, 2), math.log(0.5)),
                       policy_hidden=2 * v)


def test_hand_values_without_refinement():
    # mu+ = mean of (2,0), (0,0) = (1, 0); mu- = (-1, 0).
    # Margin towards the own side: ||v - mu_other||^2 - ||v - mu_own||^2:
    #   response 0: (2,0): 9 - 1 = 8; (0,0): 1 - 1 = 0.  gamma+ = std{8, 0} = 4.
    #   response 1: (-2,0): 8 and (0,0): 0 likewise.    gamma- = 4.
    # w = 0.8 + 0.4 sigmoid(m / 4) = 0.8 + 0.4 sigmoid(2) = 1.1523 and 0.8 + 0.4 * 0.5 = 1.0;
    # response 2 (A = 0) gets lam_min = 0.8 on both tokens.
    # Global rescale c = 6 / (2 * (1.1523 + 1.0) + 1.6) = 1.0162 so the batch's mean is 1.
    scheme, params = resolve_scheme({"name": "delta", "K": 0})
    out = compute_credit(scheme, _hand_batch(), params)
    hi = 0.8 + 0.4 * SIG2
    raw = torch.tensor([[hi, 1.0], [hi, 1.0], [0.8, 0.8]])
    c = 6 / raw.sum()
    torch.testing.assert_close(out.weights, raw * c)
    assert out.normalization == "global" and out.scores is None
    torch.testing.assert_close(out.weights.mean(), torch.tensor(1.0))


def test_one_refinement_step_moves_the_centroids_to_the_characteristic_tokens():
    # Step: soft weights sigmoid(m / gamma) |A|: (2,0) gets sigmoid(2) = 0.8808, (0,0) gets 0.5,
    # so mu+ = 0.8808 * (2, 0) / (0.8808 + 0.5) = (1.2758, 0) and mu- = (-1.2758, 0).
    # New margin of (2,0): ||(2,0) - mu-||^2 - ||(2,0) - mu+||^2 = 4 * 2 * 1.2758 = 10.206; of
    # (0,0): 0. gamma stays 4 (the margins that gave the step's weights), so the top token gets
    # 0.8 + 0.4 sigmoid(10.206 / 4) = 0.8 + 0.4 * 0.9277 = 1.1711 > 1.1523 (K = 0).
    scheme, params = resolve_scheme({"name": "delta"})
    assert params.K == 1 and (params.lam_min, params.lam_max) == (0.8, 1.2)
    out = compute_credit(scheme, _hand_batch(), params)
    mu = 2 * SIG2 / (SIG2 + 0.5)
    hi = 0.8 + 0.4 / (1 + math.exp(-(8 * mu) / 4))
    raw = torch.tensor([[hi, 1.0], [hi, 1.0], [0.8, 0.8]])
    torch.testing.assert_close(out.weights, raw * (6 / raw.sum()))


def test_global_mean_one_sign_symmetry_and_padding():
    gen = torch.Generator().manual_seed(0)
    B, T, d = 6, 5, 4
    mask = torch.arange(T) < torch.tensor([5, 2, 4, 5, 1, 3])[:, None]
    hidden = torch.randn(B, T, d, generator=gen)
    old = torch.log(torch.rand(B, T, generator=gen).clamp(0.05, 0.95))
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.0, 0.4])
    scheme, params = resolve_scheme({"name": "delta", "K": 2})
    batch = CreditBatch(torch.zeros(B, T, dtype=torch.long), mask, adv, old_logps=old, policy_hidden=hidden)
    w = compute_credit(scheme, batch, params).weights
    torch.testing.assert_close(w[mask].mean(), torch.tensor(1.0))
    assert (w > 0)[mask].all() and (w[~mask] == 0).all()
    assert (w[4, :1] == w[mask].min()).all()  # the zero-advantage response sits at lam_min
    # Swapping the sides (A -> -A) swaps the centroids and leaves every margin, hence w, unchanged.
    flipped = CreditBatch(batch.response_ids, mask, -adv, old_logps=old, policy_hidden=hidden)
    torch.testing.assert_close(compute_credit(scheme, flipped, params).weights, w)
    # Padding values change nothing.
    hidden2, old2 = hidden.clone(), old.clone()
    hidden2[~mask], old2[~mask] = 1e6, float("nan")
    padded = CreditBatch(batch.response_ids, mask, adv, old_logps=old2, policy_hidden=hidden2)
    torch.testing.assert_close(compute_credit(scheme, padded, params).weights, w)


def test_equal_bounds_are_grpo_and_bad_params_are_refused():
    scheme, params = resolve_scheme({"name": "delta", "lam_min": 1.0, "lam_max": 1.0})
    batch = _hand_batch()
    assert torch.equal(compute_credit(scheme, batch, params).weights, torch.ones(3, 2))
    for bad in ({"K": -1}, {"K": 1.5}, {"lam_min": 1.3}, {"lam_min": -0.1}, {"tau": 0.0}):
        with pytest.raises(ValueError):
            resolve_scheme({"name": "delta", **bad})


def test_one_sided_batch_uses_a_zero_centroid_for_the_empty_side():
    # All advantages positive: mu- = 0 (the public code's clamp of an empty side's mass).
    scheme, params = resolve_scheme({"name": "delta"})
    b = _hand_batch()
    b.advantages = torch.tensor([1.0, 0.5, 2.0])
    w = compute_credit(scheme, b, params).weights
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w.mean(), torch.tensor(1.0))


# ---- the POLICY_HIDDEN input, on a real tiny policy -----------------------------------------


def test_policy_hidden_times_the_lm_head_gives_the_logits(policy, tok):
    rows = [{"prompt": "write about food :"}, {"prompt": "compute 1 plus 12 ="}]
    torch.manual_seed(0)
    ro = sample_groups(policy, tok, rows, 2, 6, temperature=0.7)
    logps, ent, logits, hidden = rollout_policy_pass(policy, ro, 0.7, 3, True, keep_hidden=True)
    assert hidden.shape == (4, 6, policy.config.hidden_size) and hidden.dtype == torch.float32
    with torch.no_grad():
        z = policy.get_output_embeddings()(hidden) / 0.7
    torch.testing.assert_close(z, logits, atol=1e-5, rtol=1e-5)
    # The other outputs are those of the pass without hidden states.
    plain = rollout_policy_pass(policy, ro, 0.7, 3, True)
    assert plain.hidden is None  # not asked for
    for a, b in zip(plain[:3], (logps, ent, logits), strict=True):
        torch.testing.assert_close(a, b)
