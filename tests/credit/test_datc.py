"""The ``datc`` scheme: DATC scores per valid token, through the shared weight step (METHOD §4).

Float64 batches; scores match the explicit reference to 1e-10, weights (float32) to 1e-6.
"""

import pytest
import torch

from datc.credit import CREDIT_SCHEMES, compute_credit
from datc.credit.base import CreditBatch
from datc.credit.schemes.datc import DATCParams
from tests.helpers.credit import make_batch as _make_batch
from tests.helpers.datc_reference import reference_scores

F64 = torch.float64


def make_batch(seed: int = 0, B: int = 4, T: int = 6, V: int = 11, d: int = 5) -> CreditBatch:
    return _make_batch(seed, B, T, V, d, lengths=(T, 3, 1, 5), advantages=(1.3, -0.7, 0.4, -2.0))


def test_scores_match_reference_on_valid_tokens():
    batch, scheme = make_batch(), CREDIT_SCHEMES.get("datc")
    params = DATCParams(alignment="cosine", logit_map="identity")
    s = scheme.fn(batch, params)
    mask = batch.response_mask
    sign = torch.sign(batch.advantages)[:, None].expand_as(mask)
    ref = reference_scores(
        batch.rm_grad[mask],
        batch.rm_embedding,
        batch.policy_logits[mask],
        batch.response_ids[mask],
        sign[mask],
        logit_map="identity",
        alignment="cosine",
    )
    assert s.shape == mask.shape and (s[~mask] == 0).all()
    assert torch.allclose(s[mask], ref, atol=1e-10, rtol=0)


def test_flipping_the_advantage_sign_flips_the_scores():
    batch, scheme = make_batch(1), CREDIT_SCHEMES.get("datc")
    s = scheme.fn(batch, DATCParams())
    batch.advantages = -batch.advantages
    assert torch.equal(scheme.fn(batch, DATCParams()), -s)


@pytest.mark.parametrize("c", [0.01, 30.0])
def test_weights_invariant_to_scaling_the_reward(c):
    """The reward gradient scales with the reward model's output (METHOD §4). The z-score's
    eps makes this exact only up to eps/(c·std): score stds here are >= 0.07, so <= 1.5e-5
    relative in z at c = 0.01; tolerance 1e-4 on weights of order 1."""
    batch, scheme = make_batch(2), CREDIT_SCHEMES.get("datc")
    w = compute_credit(scheme, batch, DATCParams()).weights
    batch.rm_grad = batch.rm_grad * c
    assert torch.allclose(compute_credit(scheme, batch, DATCParams()).weights, w, atol=1e-4)


def test_padding_does_not_change_weights():
    batch, scheme = make_batch(3), CREDIT_SCHEMES.get("datc")
    out = compute_credit(scheme, batch, DATCParams())
    pad = ~batch.response_mask
    batch.rm_grad[pad] = 1e6
    batch.policy_logits[pad] = float("nan")
    batch.response_ids[pad] = 0
    out2 = compute_credit(scheme, batch, DATCParams())
    assert torch.equal(out.weights, out2.weights) and (out.weights[pad] == 0).all()


def test_mean_one_and_fallbacks():
    batch, scheme = make_batch(4), CREDIT_SCHEMES.get("datc")
    batch.advantages[1] = 0.0  # A = 0: every score 0, so the response falls back to w = 1
    out = compute_credit(scheme, batch, DATCParams())
    mask = batch.response_mask
    assert torch.allclose((out.weights * mask).sum(-1) / mask.sum(-1), torch.ones(4), atol=1e-6)
    assert out.fallback.tolist() == [False, True, True, False]  # row 2 has one token


@pytest.mark.parametrize(
    "field, value",
    [("logit_map", "tanh"), ("direction", "both"), ("alignment", "dot"), ("top_k", 0)],
)
def test_invalid_switch_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        CREDIT_SCHEMES.get("datc").make_params({field: value})


def test_nonfinite_policy_logit_falls_back_to_uniform_weights():
    # A NaN or +inf logit on a valid token of one response: that response gets w = 1 and is
    # counted as a fallback; the other responses keep DATC's weights.
    import torch as _t

    from datc.credit import compute_credit, resolve_scheme
    from datc.credit.base import CreditBatch

    gen = _t.Generator().manual_seed(0)
    B, T, V, d = 3, 5, 11, 4
    mask = _t.ones(B, T, dtype=_t.bool)
    logits = _t.randn(B, T, V, generator=gen)
    batch_kw = dict(
        response_ids=_t.randint(0, V, (B, T), generator=gen), response_mask=mask,
        advantages=_t.tensor([1.0, -0.5, 0.7]), rm_grad=_t.randn(B, T, d, generator=gen),
        rm_embedding=_t.randn(V, d, generator=gen),
    )
    scheme, params = resolve_scheme({"name": "datc"})
    for bad in (float("nan"), float("inf")):
        z = logits.clone()
        z[1, 2, 7] = bad
        out = compute_credit(scheme, CreditBatch(policy_logits=z, **batch_kw), params)
        assert (out.weights[1] == 1).all()
        assert not (out.weights[0] == 1).all() and not (out.weights[2] == 1).all()
        assert bool(out.fallback[1]) and not bool(out.fallback[0])


def _scheme_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, T, V, d = 3, 5, 11, 4
    mask = torch.ones(B, T, dtype=torch.bool)
    ids = torch.randint(0, V, (B, T), generator=gen)
    return dict(
        response_ids=ids, response_mask=mask, advantages=torch.tensor([1.0, -0.5, 0.7]),
        rm_grad=torch.randn(B, T, d, generator=gen), rm_embedding=torch.randn(V, d, generator=gen),
        policy_logits=torch.randn(B, T, V, generator=gen),
    )


def test_a_banned_token_at_minus_inf_keeps_datc_weights():
    # A logit processor that writes -inf on tokens that were not sampled must not turn DATC
    # into GRPO (it gave w = 1 for the whole response before); the weights equal those of the
    # same logits with the banned entries at a logit so low that their probability is 0 too.
    from datc.credit import compute_credit, resolve_scheme
    from datc.credit.base import CreditBatch

    kw = _scheme_batch()
    scheme, params = resolve_scheme({"name": "datc"})
    z = kw.pop("policy_logits")
    banned = torch.zeros_like(z, dtype=torch.bool)
    banned[..., 0] = True
    banned &= kw["response_ids"][..., None] != 0  # never the sampled token
    inf = compute_credit(scheme, CreditBatch(policy_logits=z.masked_fill(banned, -torch.inf), **kw), params)
    low = compute_credit(scheme, CreditBatch(policy_logits=z.masked_fill(banned, -1e4), **kw), params)
    assert not inf.fallback.any()
    torch.testing.assert_close(inf.weights, low.weights)
    assert not (inf.weights == 1).all(-1).any()


def test_cosine_with_a_nan_reward_gradient_falls_back_through_the_scheme():
    from datc.credit import compute_credit, resolve_scheme
    from datc.credit.base import CreditBatch

    kw = _scheme_batch(1)
    kw["rm_grad"][1, 3, 2] = torch.nan
    scheme, params = resolve_scheme({"name": "datc", "alignment": "cosine"})
    out = compute_credit(scheme, CreditBatch(**kw), params)
    assert bool(out.fallback[1]) and (out.weights[1] == 1).all()
    assert not out.fallback[0] and not out.fallback[2]


def test_matmul_dtype_is_a_validated_credit_field(tmp_path):
    from datc.checks import validate
    from datc.config import ConfigError
    from tests.helpers.testbed import cfg_for

    c = validate(cfg_for(tmp_path, tmp_path, "credit=datc", "credit.matmul_dtype=bfloat16"))
    assert c.credit["matmul_dtype"] == "bfloat16"
    assert validate(cfg_for(tmp_path, tmp_path, "credit=datc")).credit["matmul_dtype"] == "float32"  # the default
    with pytest.raises(ConfigError, match=r"^credit: matmul_dtype must be one of \('float32', 'bfloat16', 'tf32'\)"):
        validate(cfg_for(tmp_path, tmp_path, "credit=datc", "credit.matmul_dtype=float16"))
    with pytest.raises(ConfigError, match="applies to the exact credit"):
        validate(cfg_for(tmp_path, tmp_path, "credit=datc", "credit.matmul_dtype=tf32", "credit.top_k=64"))
