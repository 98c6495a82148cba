"""A ``row_local`` scheme that reads the policy's logits is computed one micro-batch of rows at
a time (the (B, T, V) logits are never all held): the step's credit, loss, gradients and update
equal the whole-batch computation, for every credit config whose scheme is row-local."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from datc.checks import validate
from datc.credit import CREDIT_SCHEMES, compute_credit, scheme_key
from datc.credit.base import POLICY_LOGITS
from datc.credit.configs import credit_config, credit_config_names
from datc.step import train_step
from datc.step.ops import StepOps
from datc.training.session import build_session, session_plan
from tests.helpers.testbed import cfg_for

pytestmark = pytest.mark.slow

SCHEME_OF = {n: CREDIT_SCHEMES.get(scheme_key(credit_config(n))) for n in credit_config_names()}  # label -> scheme
CHUNKED = sorted(n for n, scheme in SCHEME_OF.items() if scheme.row_local and POLICY_LOGITS in scheme.needs)


def _one_step(cache_dir, tmp_path, name, row_local):
    # 8 responses, micro-batches of 2 (four chunks); logits recomputed, not generate's. Plain
    # forwards: a shared prompt forward rounds with the prompts computed together, which differ
    # here, and the Adam step turns rounding on a near-zero gradient into a step of ~lr
    # (tests/models/test_shared_prompt.py checks the shared forwards).
    c = validate(cfg_for(cache_dir, tmp_path / "unused", f"credit={name}", "trainer.warmup_steps=0",
                         "trainer.micro_batch_size=2", "trainer.reuse_rollout_logits=never",
                         "trainer.share_prompts=false"))
    calls = []
    s = build_session(c, ops=StepOps(credit=lambda scheme, batch, params: calls.append(batch.policy_logits.shape)
                                     or compute_credit(scheme, batch, params)))
    s.scheme = dataclasses.replace(s.scheme, row_local=row_local)
    s.plan = session_plan(s.c, s.scheme, s.m, s.dist)  # the plan follows the scheme's declaration
    torch.manual_seed(123)
    metrics = train_step(s, 0).metrics
    assert [shape[0] for shape in calls] == ([2, 2, 2, 2] if row_local else [8])  # rows of logits per call
    return metrics, {n: p.detach().clone() for n, p in s.m.policy.named_parameters()}


def test_the_datc_family_is_row_local():
    assert {"datc", "datc_unsigned", "datc_identity", "datc_magnitude", "datc_shuffled"} <= set(CHUNKED)
    assert not CREDIT_SCHEMES.get("entropy_top").row_local and not CREDIT_SCHEMES.get("delta").row_local


@pytest.mark.parametrize("name", [n for n in CHUNKED if n != "datc_shuffled"])  # shuffled: other draws per chunk
def test_chunked_credit_equals_the_whole_batch(cache_dir, tmp_path, name):
    cache = cache_dir  # the session's (assets are keyed by their config)
    m_whole, p_whole = _one_step(cache, tmp_path, name, False)
    m_chunk, p_chunk = _one_step(cache, tmp_path, name, True)
    assert m_whole["credit/weight_std"] > 0  # non-uniform credit: the comparison can fail
    for k, v in m_whole.items():
        if not k.startswith("perf/"):
            assert m_chunk[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    for n, p in p_whole.items():
        torch.testing.assert_close(p_chunk[n], p, rtol=1e-5, atol=1e-7, msg=n)
