"""METHOD §4: ``credit=datc`` with ``lam=0`` and ``credit=grpo`` give the same loss and the same
gradients, bit for bit on CPU, on the same batch (one full training step of each)."""

from __future__ import annotations

import pytest
import torch

from datc.checks import validate
from datc.step import train_step
from datc.training.session import build_session
from tests.helpers.testbed import cfg_for

pytestmark = pytest.mark.slow


def _one_step(cache_dir, tmp_path, *overrides):
    # warmup_steps=0: the first step must have a non-zero learning rate to compare updates.
    c = validate(cfg_for(cache_dir, tmp_path / "unused", "trainer.warmup_steps=0", *overrides))
    s = build_session(c)
    torch.manual_seed(123)
    metrics = train_step(s, 0).metrics
    params = {n: p.detach().clone() for n, p in s.m.policy.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in s.m.policy.named_parameters()}
    return metrics, params, grads


def test_lambda_zero_equals_grpo_bit_for_bit(cache_dir, tmp_path):
    cache = cache_dir  # the session's (assets are keyed by their config)
    m_grpo, p_grpo, g_grpo = _one_step(cache, tmp_path, "credit=grpo")
    m_datc, p_datc, g_datc = _one_step(cache, tmp_path, "credit=datc", "credit.lam=0")
    assert m_datc["credit/weight_std"] == 0.0 and m_datc["credit/weight_mean"] == 1.0
    assert m_datc["loss/total"] == m_grpo["loss/total"]
    for name in p_grpo:
        assert torch.equal(g_grpo[name], g_datc[name]), name
        assert torch.equal(p_grpo[name], p_datc[name]), name
    # A non-zero lambda does change the gradients and the update (so the test can fail).
    m_full, p_full, g_full = _one_step(cache, tmp_path, "credit=datc")
    assert m_full["credit/weight_std"] > 0
    assert any(not torch.equal(g, g_full[n]) for n, g in g_grpo.items())
    assert any(not torch.equal(p, p_full[n]) for n, p in p_grpo.items())
