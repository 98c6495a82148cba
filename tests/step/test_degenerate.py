"""Degenerate batches: the loss stays finite and the behaviour is the documented one."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from datc.checks import validate
from datc.engines.generate import sample_groups
from datc.math.losses import AggNorm, aggregate
from datc.rewards.model import score
from datc.run.checkpoint import latest_checkpoint, load_checkpoint
from datc.step import train_step
from datc.step.ops import StepOps
from datc.training.session import build_session
from datc.training.trainer import train
from tests.helpers.testbed import cfg_for


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_all_padding_rows_aggregate_to_a_finite_zero(mode):
    loss = torch.randn(3, 4)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    assert aggregate(loss, mask, mode, AggNorm(3, 0.0, 4)).item() == 0.0
    # One padding-only row among real ones contributes nothing (and no NaN).
    mask[0, :2] = True
    out = aggregate(loss, mask, mode, AggNorm(3, 2.0, 4))
    assert math.isfinite(out.item())


@pytest.fixture
def cache(cache_dir):
    return cache_dir  # the session's (assets are keyed by their config)


def _session(cache, tmp_path, *overrides, ops=None):
    s = build_session(validate(cfg_for(cache, tmp_path / "unused", "trainer.warmup_steps=0", *overrides)), ops=ops)
    torch.manual_seed(0)
    return s


@pytest.mark.slow
def test_all_truncated_with_mask_truncated_takes_no_step(cache, tmp_path):
    def all_truncated(*a, **k):
        return _truncate(sample_groups(*a, **k))

    def _truncate(ro):
        ro.truncated = torch.ones_like(ro.truncated)
        return ro

    s = _session(cache, tmp_path, "trainer.mask_truncated=true", ops=StepOps(sample=all_truncated))
    before = {n: p.detach().clone() for n, p in s.m.policy.named_parameters()}
    m = train_step(s, 0).metrics
    assert m["loss/skipped_steps"] == 1 and math.isfinite(m["loss/total"])
    assert all(torch.equal(p, before[n]) for n, p in s.m.policy.named_parameters())


@pytest.mark.slow
def test_single_token_responses_train_and_fall_back_to_uniform_credit(cache, tmp_path):
    s = _session(cache, tmp_path, "trainer.max_new_tokens=1", "credit=datc")
    m = train_step(s, 0).metrics
    assert math.isfinite(m["loss/total"]) and m["rollout/response_len"] == 1.0
    assert m["credit/fallback_frac"] == 1.0  # one token: nothing to share, w = 1 (METHOD §2.5)
    assert m["credit/weight_std"] == 0.0


@pytest.mark.slow
def test_all_equal_rewards_give_zero_advantages_and_a_kl_only_loss(cache, tmp_path):
    def constant(*a, **k):
        out = score(*a, **k)
        return dataclasses.replace(out, scores=torch.full_like(out.scores, 0.3))

    run = tmp_path / "run"
    train(cfg_for(cache, run, "trainer.warmup_steps=0"), ops=StepOps(score=constant))
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    steps = [r for r in rows if "loss/total" in r]
    assert all(r["reward/advantage_abs"] == 0.0 for r in steps)
    # With A = 0 the policy-gradient term vanishes: the loss is beta * KL (0 at the first step).
    assert steps[0]["loss/total"] == 0.0
    state = load_checkpoint(latest_checkpoint(run))["policy"]
    assert all(torch.isfinite(v).all() for v in state.values())
