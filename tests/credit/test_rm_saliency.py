"""``rm_saliency``: s_t = |g_t · E[y_t]|, ignoring the policy (METHOD §3)."""

from functools import partial

import torch

from datc.credit import CREDIT_SCHEMES, compute_credit
from datc.credit.base import POLICY_LOGITS
from datc.credit.weights import WeightParams
from tests.helpers.credit import make_batch as _make_batch

F64 = torch.float64


make_batch = partial(_make_batch, logit_scale=None)


def test_scores_match_the_definition_without_policy_logits():
    batch, scheme = make_batch(), CREDIT_SCHEMES.get("rm_saliency")
    assert POLICY_LOGITS not in scheme.needs and batch.policy_logits is None
    s = scheme.fn(batch, WeightParams())
    B, T = batch.response_mask.shape
    for i in range(B):
        for t in range(T):
            h = batch.rm_embedding[batch.response_ids[i, t]]
            expected = abs(float(batch.rm_grad[i, t] @ h)) if batch.response_mask[i, t] else 0.0
            assert abs(float(s[i, t]) - expected) < 1e-12


def test_weights_ignore_the_advantage_and_keep_mean_one():
    batch, scheme = make_batch(1), CREDIT_SCHEMES.get("rm_saliency")
    w = compute_credit(scheme, batch, WeightParams()).weights
    batch.advantages = -batch.advantages
    assert torch.equal(compute_credit(scheme, batch, WeightParams()).weights, w)
    mask = batch.response_mask
    assert torch.allclose((w * mask).sum(-1) / mask.sum(-1), torch.ones(3), atol=1e-6)
