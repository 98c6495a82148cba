"""``datc_unsigned``: DATC without sign(A_i) in the displacement (METHOD §3, §4).

A config over DATC's (``configs/credit/datc_unsigned.yaml``: ``scheme: datc``,
``direction: unsigned``), so the scheme is built from the config, as a run builds it."""

from functools import partial

import torch

from datc.credit import CREDIT_SCHEMES, resolve_scheme
from datc.credit.configs import credit_config
from datc.credit.schemes.datc import DATCParams
from tests.helpers.credit import make_batch as _make_batch

F64 = torch.float64


make_batch = partial(_make_batch, advantages=(0.8, -1.1, 0.0), logit_scale=1.0)


def unsigned_scheme():
    """(scheme, params) of ``credit=datc_unsigned``."""
    return resolve_scheme(credit_config("datc_unsigned"))


def test_default_is_unsigned():
    scheme, params = unsigned_scheme()
    assert scheme is CREDIT_SCHEMES.get("datc") and "datc_unsigned" not in CREDIT_SCHEMES  # a label, not a scheme
    assert params.direction == "unsigned"
    assert params == DATCParams(direction="unsigned")  # only the default of direction differs


def test_flipping_the_advantage_sign_does_not_change_the_scores():
    batch, (scheme, params) = make_batch(), unsigned_scheme()
    s = scheme.fn(batch, params)
    batch.advantages = -batch.advantages
    assert torch.equal(scheme.fn(batch, params), s)
    assert (s[batch.response_mask] != 0).all()  # A = 0 still scores under unsigned


def test_equals_datc_with_the_advantage_sign_removed():
    """Unsigned scores are the signed ones times sign(A_i), wherever A_i != 0."""
    batch = make_batch(1)
    signed = CREDIT_SCHEMES.get("datc").fn(batch, DATCParams())
    scheme, params = unsigned_scheme()
    unsigned = scheme.fn(batch, params)
    sign = torch.sign(batch.advantages)[:, None]
    assert torch.allclose(signed[:2], (sign * unsigned)[:2], atol=1e-12, rtol=0)
