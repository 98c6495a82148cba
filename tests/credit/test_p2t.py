"""``p2t``: first-order Taylor token rewards r_t = ⟨g_t, E[y_t] - e_base⟩, scored sign(A) · r_t."""

import pytest
import torch

from datc.credit import CREDIT_SCHEMES, CreditBatch, resolve_scheme
from datc.credit.base import RM_EMBEDDING, RM_GRAD

F64 = torch.float64


def test_hand_values_with_both_baselines():
    # E rows (V = 3, d = 2): (1, 0), (0, 2), (2, 1); mean row ē = (1, 1).
    # Response 0, A = +1, ids (0, 1), g = ((1, 1), (2, -1)):
    #   mean baseline: ⟨(1,1), (0,-1)⟩ = -1;  ⟨(2,-1), (-1,1)⟩ = -3
    #   zero baseline: ⟨(1,1), (1,0)⟩ = 1;    ⟨(2,-1), (0,2)⟩ = -2
    # Response 1, A = -2, ids (2, pad), g = ((1, 3), anything): mean: ⟨(1,3), (1,0)⟩ = 1 -> -1 signed;
    #   zero: ⟨(1,3), (2,1)⟩ = 5 -> -5 signed.
    E = torch.tensor([[1.0, 0.0], [0.0, 2.0], [2.0, 1.0]], dtype=F64)
    ids = torch.tensor([[0, 1], [2, 0]])
    g = torch.tensor([[[1.0, 1.0], [2.0, -1.0]], [[1.0, 3.0], [9.0, 9.0]]], dtype=F64)
    mask = torch.tensor([[True, True], [True, False]])
    batch = CreditBatch(ids, mask, torch.tensor([1.0, -2.0], dtype=F64), rm_grad=g, rm_embedding=E)
    scheme, params = resolve_scheme({"name": "p2t"})
    assert scheme.needs == {RM_GRAD, RM_EMBEDDING} and params.baseline == "mean"
    torch.testing.assert_close(scheme.fn(batch, params), torch.tensor([[-1.0, -3.0], [-1.0, 0.0]], dtype=F64))
    _, zero = resolve_scheme({"name": "p2t", "baseline": "zero"})
    torch.testing.assert_close(scheme.fn(batch, zero), torch.tensor([[1.0, -2.0], [-5.0, 0.0]], dtype=F64))


def test_the_split_sums_to_the_linearized_score_difference():
    # For a reward linear in the embeddings, R(e) = Σ_t ⟨a_t, e_t⟩, the first-order split is exact:
    # Σ_t r_t = R(y) - R(baseline everywhere).
    gen = torch.Generator().manual_seed(0)
    E = torch.randn(7, 3, generator=gen, dtype=F64)
    a = torch.randn(1, 4, 3, generator=gen, dtype=F64)  # the gradient of a linear reward is a
    ids = torch.randint(7, (1, 4), generator=gen)
    batch = CreditBatch(ids, torch.ones(1, 4, dtype=torch.bool), torch.tensor([1.0]), rm_grad=a, rm_embedding=E)
    scheme, params = resolve_scheme({"name": "p2t"})
    r = scheme.fn(batch, params)
    R_y = (a * E[ids]).sum()
    R_base = (a * E.mean(0)).sum()
    torch.testing.assert_close(r.sum(), R_y - R_base)


def test_bad_baseline_is_refused():
    with pytest.raises(ValueError, match="baseline must be one of"):
        resolve_scheme({"name": "p2t", "baseline": "pad"})
    assert CREDIT_SCHEMES.get("p2t").row_separable
