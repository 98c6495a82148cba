import math

import pytest
import torch

from datc.batch import with_prompts
from datc.credit import CreditBatch, compute_credit, resolve_scheme
from datc.engines.generate import sample_groups
from datc.forward.passes import logps_under_prompts, rollout_policy_pass


def _batch(old, neg, mask, adv, prompts=None):
    """A CreditBatch whose logps_under returns ``neg`` and records the prompts it was given."""
    seen = []

    def logps_under(p):
        seen.append(list(p))
        return neg

    B = old.shape[0]
    prompts = prompts or [f"write about food {i} :" for i in range(B)]
    batch = CreditBatch(torch.zeros(old.shape, dtype=torch.long), mask, adv, old_logps=old,
                        prompts=prompts, logps_under=logps_under)
    return batch, seen


def test_hand_values_rank_power_and_the_negative_prompt():
    # Δ = neg - old per token: [0, ln 2, -ln 2, ln 4]; s = e^Δ - Δ - 1:
    #   Δ = 0     -> 1 - 0 - 1           = 0
    #   Δ = ln 2  -> 2 - 0.6931 - 1      = 0.3069
    #   Δ = -ln 2 -> 0.5 + 0.6931 - 1    = 0.1931
    #   Δ = ln 4  -> 4 - 1.3863 - 1      = 1.6137
    # Ranks (ascending) 1, 3, 2, 4; with alpha = 2, (rank/4)^2 = (1, 9, 4, 16)/16, mean 30/64,
    # so w = (1, 9, 4, 16) / 7.5 = (0.1333, 1.2, 0.5333, 2.1333): mean 1.
    old = torch.full((1, 4), math.log(0.25))
    neg = old + torch.tensor([[0.0, math.log(2), -math.log(2), math.log(4)]])
    scheme, params = resolve_scheme({"name": "gcpo", "alpha": 2.0, "template": "{prompt} not"})
    batch, seen = _batch(old, neg, torch.ones(1, 4, dtype=torch.bool), torch.tensor([-0.7]), ["write about ocean :"])
    out = compute_credit(scheme, batch, params)
    assert seen == [["write about ocean : not"]]  # one extra pass, under x- built from the template
    s = [0.0, 2 - math.log(2) - 1, 0.5 + math.log(2) - 1, 4 - math.log(4) - 1]
    torch.testing.assert_close(out.scores, torch.tensor([s], dtype=torch.float64))
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 9.0, 4.0, 16.0]]) / 7.5)
    assert out.normalization == "per_response" and not out.fallback.any()


def test_default_alpha_is_the_public_codes_rank_40_80():
    # rank(x/y) puts mass y on the top fraction x: alpha = log(1 - y)/log(1 - x) - 1.
    _, params = resolve_scheme({"name": "gcpo"})
    assert params.normalizer == "rank_power"
    assert params.alpha == pytest.approx(math.log(0.2) / math.log(0.6) - 1, abs=1e-4)


def test_sign_and_mean_of_each_response_advantage_are_kept_and_padding_is_ignored():
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(4, 6, generator=gen) - 2
    neg = old + 3 * torch.randn(4, 6, generator=gen)
    mask = torch.arange(6) < torch.tensor([6, 3, 5, 2])[:, None]
    adv = torch.tensor([1.5, -0.5, -2.0, 0.3])
    scheme, params = resolve_scheme({"name": "gcpo"})
    out = compute_credit(scheme, _batch(old, neg, mask, adv)[0], params)
    token_adv = adv[:, None] * out.weights
    assert (out.weights >= 0).all() and (out.weights[~mask] == 0).all()
    assert (torch.sign(token_adv[mask]) == torch.sign(adv[:, None].expand(4, 6)[mask])).all()
    torch.testing.assert_close((token_adv * mask).sum(-1) / mask.sum(-1), adv)
    # Padding values (even NaN) change nothing.
    old2, neg2 = old.clone(), neg.clone()
    old2[~mask], neg2[~mask] = float("nan"), 50.0
    torch.testing.assert_close(compute_credit(scheme, _batch(old2, neg2, mask, adv)[0], params).weights, out.weights)


def test_clamps_and_equal_scores_fall_back():
    scheme, params = resolve_scheme({"name": "gcpo"})
    old = torch.zeros(2, 3)
    # Row 0: Δ = 30, 40, 50 all clamp to 20 and s to 10: equal scores -> w = 1 (fallback).
    # Row 1: Δ = 0 everywhere: s = 0 -> no spread -> w = 1.
    neg = torch.tensor([[30.0, 40.0, 50.0], [0.0, 0.0, 0.0]])
    out = compute_credit(scheme, _batch(old, neg, torch.ones(2, 3, dtype=torch.bool), torch.tensor([1.0, -1.0]))[0], params)
    assert torch.equal(out.scores[0], torch.full((3,), 10.0, dtype=torch.float64))
    assert out.fallback.all() and torch.equal(out.weights, torch.ones(2, 3))


def test_bad_templates_are_refused():
    for bad in ("no placeholder", "{prompt} {other}", "{prompt"):
        with pytest.raises(ValueError, match="template"):
            resolve_scheme({"name": "gcpo", "template": bad})
    with pytest.raises(ValueError, match="delta_clip"):
        resolve_scheme({"name": "gcpo", "delta_clip": 0})


# ---- the LOGPS_UNDER input, on a real tiny policy -------------------------------------------


def test_logps_under_the_original_prompts_are_the_old_logps(policy, tok):
    rows = [{"prompt": "write about food :"}, {"prompt": "compute 1 plus 12 ="}]
    torch.manual_seed(0)
    ro = sample_groups(policy, tok, rows, 2, 6, temperature=0.7)
    old = rollout_policy_pass(policy, ro, 0.7, 3, False)[0]
    logps_under = logps_under_prompts(policy, tok, ro, 0.7, 3)
    torch.testing.assert_close(logps_under([ex["prompt"] for ex in ro.examples]), old, atol=1e-6, rtol=0)

    # Other prompts: the response ids are spliced after the (left-padded) prompt as sampled,
    # and each row equals an unpadded single-row forward pass of prompt + response.
    others = ["not " + ex["prompt"] + " not not" for ex in ro.examples]
    other = with_prompts(ro, tok, others)
    assert torch.equal(other.input_ids[:, -ro.response_ids.shape[1]:], ro.response_ids)
    under = logps_under(others)
    assert not torch.allclose(under, old)
    for i in range(ro.response_ids.shape[0]):
        n = int(ro.response_mask[i].sum())
        ids = torch.tensor([tok(others[i])["input_ids"] + ro.response_ids[i, :n].tolist()])
        with torch.no_grad():
            z = policy(input_ids=ids).logits[0, -n - 1 : -1] / 0.7
        expected = torch.log_softmax(z, -1).gather(-1, ro.response_ids[i, :n, None]).squeeze(-1)
        torch.testing.assert_close(under[i, :n], expected, atol=1e-5, rtol=1e-5)


def test_logps_under_refuses_prompts_beyond_the_context(policy, tok):
    torch.manual_seed(0)
    ro = sample_groups(policy, tok, [{"prompt": "write about food :"}], 2, 4)
    with pytest.raises(ValueError, match="context"):
        logps_under_prompts(policy, tok, ro, 1.0, 2)(["the " * 70 + ":"] * 2)
    with pytest.raises(ValueError, match="prompts for"):
        logps_under_prompts(policy, tok, ro, 1.0, 2)(["write about food :"])
