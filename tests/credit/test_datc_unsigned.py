"""``datc_unsigned``: DATC without sign(A_i) in the displacement (METHOD §3, §4)."""

import torch

from datc.credit import CREDIT_SCHEMES
from datc.credit.base import CreditBatch
from datc.credit.schemes.datc import DATCParams
from datc.credit.schemes.datc_unsigned import DATCUnsignedParams

F64 = torch.float64


def make_batch(seed: int = 0, B: int = 3, T: int = 5, V: int = 9, d: int = 4) -> CreditBatch:
    gen = torch.Generator().manual_seed(seed)
    return CreditBatch(
        response_ids=torch.randint(V, (B, T), generator=gen),
        response_mask=torch.arange(T) < torch.tensor([5, 4, 2])[:, None],
        advantages=torch.tensor([0.8, -1.1, 0.0], dtype=F64),
        rm_grad=torch.randn(B, T, d, generator=gen, dtype=F64),
        rm_embedding=torch.randn(V, d, generator=gen, dtype=F64),
        policy_logits=torch.randn(B, T, V, generator=gen, dtype=F64),
    )


def test_default_is_unsigned():
    assert DATCUnsignedParams().direction == "unsigned"
    assert CREDIT_SCHEMES.get("datc_unsigned").make_params({}).direction == "unsigned"


def test_flipping_the_advantage_sign_does_not_change_the_scores():
    batch, scheme = make_batch(), CREDIT_SCHEMES.get("datc_unsigned")
    s = scheme.fn(batch, DATCUnsignedParams())
    batch.advantages = -batch.advantages
    assert torch.equal(scheme.fn(batch, DATCUnsignedParams()), s)
    assert (s[batch.response_mask] != 0).all()  # A = 0 still scores under unsigned


def test_equals_datc_with_the_advantage_sign_removed():
    """Unsigned scores are the signed ones times sign(A_i), wherever A_i != 0."""
    batch = make_batch(1)
    signed = CREDIT_SCHEMES.get("datc").fn(batch, DATCParams())
    unsigned = CREDIT_SCHEMES.get("datc_unsigned").fn(batch, DATCUnsignedParams())
    sign = torch.sign(batch.advantages)[:, None]
    assert torch.allclose(signed[:2], (sign * unsigned)[:2], atol=1e-12, rtol=0)
