"""``datc_shuffled``: DATC's weights permuted within each response (METHOD §3)."""

from functools import partial

import torch

from datc.credit import CREDIT_SCHEMES, compute_credit
from datc.credit.schemes.datc import DATCParams
from datc.credit.schemes.datc_shuffled import permute_valid
from tests.helpers.credit import make_batch as _make_batch

F64 = torch.float64


make_batch = partial(_make_batch, T=8, lengths=(8, 5, 3), generator=True)


def test_weights_are_a_permutation_of_datc_weights_within_each_response():
    batch = make_batch()
    mask = batch.response_mask
    datc = compute_credit(CREDIT_SCHEMES.get("datc"), batch, DATCParams())
    shuf = compute_credit(CREDIT_SCHEMES.get("datc_shuffled"), batch, DATCParams())
    assert (shuf.weights[~mask] == 0).all() and torch.equal(shuf.fallback, datc.fallback)
    for i in range(mask.shape[0]):
        a, b = datc.weights[i, mask[i]], shuf.weights[i, mask[i]]
        assert torch.allclose(a.sort().values, b.sort().values, atol=1e-6, rtol=0)
        assert torch.equal(
            datc.scores[i, mask[i]].sort().values, shuf.scores[i, mask[i]].sort().values
        )
    assert not torch.equal(datc.weights[0], shuf.weights[0])  # 8 tokens: a non-identity draw


def test_reproducible_from_the_generator_and_without_one():
    scheme = CREDIT_SCHEMES.get("datc_shuffled")
    batch = make_batch(1)
    a = scheme.fn(batch, DATCParams())
    batch.generator = torch.Generator().manual_seed(1)
    assert torch.equal(scheme.fn(batch, DATCParams()), a)
    batch.generator = None  # falls back to a fixed seed
    assert torch.equal(scheme.fn(batch, DATCParams()), scheme.fn(batch, DATCParams()))


def test_permutation_covers_every_arrangement_and_keeps_padding():
    """Over 600 draws of a 3-token response, each of the 3! orders appears (p of missing one
    by chance < 6·(5/6)^600); padding entries never move."""
    x = torch.tensor([[1.0, 2.0, 3.0, -7.0]])
    mask = torch.tensor([[True, True, True, False]])
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(600):
        p = permute_valid(x, mask, gen)
        assert p[0, 3] == -7.0
        seen.add(tuple(p[0, :3].tolist()))
    assert len(seen) == 6
