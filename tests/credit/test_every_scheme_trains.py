"""Every credit config (each registered scheme, each ablation over one) takes a training step on the
testbed that logs the credit/ diagnostics, leaves a finite policy and evaluates to a finite gold
reward. One step through the session each: the loop around the step (evaluations, checkpoints,
the summary) does not depend on the scheme and is run end to end by tests/e2e/test_train_e2e.py."""

from __future__ import annotations

import math

import pytest
import torch

from datc.checks import validate
from datc.credit.configs import credit_config_names
from datc.step import train_step
from datc.training.evaluation import evaluate
from datc.training.session import build_session
from tests.helpers.testbed import cfg_for

pytestmark = pytest.mark.slow

DIAGNOSTICS = ("credit/weight_mean", "credit/weight_std", "credit/ess", "credit/fallback_frac", "credit/accuracy")


@pytest.mark.parametrize("name", credit_config_names())
def test_a_step_of_every_credit_config_logs_its_credit_diagnostics(cache_dir, name):
    """(Was ``test_short_run_finishes_with_credit_diagnostics``: a 3-step ``train()`` per config.)"""
    c = validate(cfg_for(cache_dir, "unused", f"credit={name}", "trainer.warmup_steps=0"))
    s = build_session(c)
    before = {n: p.detach().clone() for n, p in s.m.policy.named_parameters()}
    torch.manual_seed(0)
    metrics = train_step(s, 0).metrics
    for key in DIAGNOSTICS:
        assert key in metrics, key
    assert math.isfinite(metrics["loss/total"]) and metrics["loss/grad_norm"] > 0
    params = dict(s.m.policy.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    assert any(not torch.equal(params[n], p) for n, p in before.items())  # the step updated the policy
    with s.autocast():
        ev, _ = evaluate(c, s.m, list(s.assets.eval)[: c.trainer.eval_size], s.assets.task, s.device, s.plan)
    assert math.isfinite(ev["eval/gold"])
