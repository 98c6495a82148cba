"""``datc_identity``: DATC with the force taken before the softmax (METHOD §3).

A config over DATC's (``configs/credit/datc_identity.yaml``: ``scheme: datc``,
``logit_map: identity``), so the scheme is built from the config, as a run builds it."""

import torch

from datc.credit import CREDIT_SCHEMES, resolve_scheme
from datc.credit.configs import credit_config
from datc.credit.schemes.datc import DATCParams
from tests.helpers.credit import make_batch

F64 = torch.float64


def identity_scheme(**overrides):
    """(scheme, params) of ``credit=datc_identity`` with ``credit.<field>=<value>`` overrides."""
    return resolve_scheme({**credit_config("datc_identity"), **overrides})


def test_default_is_identity_and_equals_datc_so_configured():
    batch = make_batch()
    scheme, params = identity_scheme()
    assert scheme is CREDIT_SCHEMES.get("datc") and "datc_identity" not in CREDIT_SCHEMES  # a label, not a scheme
    assert params == DATCParams(logit_map="identity")  # only the default of logit_map differs
    ident = scheme.fn(batch, params)
    datc = CREDIT_SCHEMES.get("datc").fn(batch, DATCParams(logit_map="identity"))
    jac = CREDIT_SCHEMES.get("datc").fn(batch, DATCParams())
    assert torch.equal(ident, datc) and not torch.allclose(ident, jac)


def test_work_is_reward_direction_along_the_displacement():
    # identity + work: s = sign(A) · g · (E[y] - πᵀE) (METHOD's cheap identity), by hand.
    batch = make_batch(1)
    mask = batch.response_mask
    scheme, params = identity_scheme(alignment="work")
    assert (params.logit_map, params.alignment) == ("identity", "work")
    s = scheme.fn(batch, params)
    pi = torch.softmax(batch.policy_logits, -1)
    E = batch.rm_embedding
    expected = (batch.rm_grad * (E[batch.response_ids] - pi @ E)).sum(-1)
    expected = torch.sign(batch.advantages)[:, None] * expected
    assert torch.allclose(s[mask], expected[mask], atol=1e-12, rtol=0)
