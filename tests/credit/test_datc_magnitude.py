"""``datc_magnitude``: s_t = ‖f_t‖, the force's magnitude with no alignment (METHOD §3)."""

import pytest
import torch

from datc.credit import CREDIT_SCHEMES
from datc.credit.schemes.datc_magnitude import MagnitudeParams
from tests.helpers.credit import make_batch
from tests.helpers.datc_reference import reference_force

F64 = torch.float64


@pytest.mark.parametrize("logit_map", ["jacobian", "identity"])
def test_scores_are_the_force_norm(logit_map):
    batch = make_batch()
    mask = batch.response_mask
    s = CREDIT_SCHEMES.get("datc_magnitude").fn(batch, MagnitudeParams(logit_map=logit_map))
    f = reference_force(
        batch.rm_grad[mask], batch.rm_embedding, batch.policy_logits[mask], logit_map
    )
    assert torch.allclose(s[mask], f.norm(dim=-1), atol=1e-12, rtol=0) and (s[~mask] == 0).all()


def test_independent_of_advantage_and_sampled_token():
    batch, scheme = make_batch(1), CREDIT_SCHEMES.get("datc_magnitude")
    s = scheme.fn(batch, MagnitudeParams())
    batch.advantages = -batch.advantages
    batch.response_ids = (batch.response_ids + 1) % 9
    assert torch.equal(scheme.fn(batch, MagnitudeParams()), s)


def test_has_no_direction_or_alignment_switch():
    scheme = CREDIT_SCHEMES.get("datc_magnitude")
    for field in ("direction", "alignment"):
        with pytest.raises(ValueError, match=field):
            scheme.make_params({field: "work"})
