"""The zero-advantage skip's batch (also LoRA's tests'): every step's batch forced to hold a group
tied by value, a response with a NaN reward and a group of identical responses
(:func:`forced_ops`, the ``forced`` fixture of tests/conftest.py), and one step with the skip on
and one with it off compared (:func:`same_update`)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from datc.checks import validate
from datc.engines.generate import sample_groups
from datc.rewards.model import score
from datc.step import train_step
from datc.step.ops import StepOps
from datc.training.session import build_session
from tests.helpers.testbed import cfg_for

B, G = 16, 4  # four groups: tied by value, one non-finite reward, identical responses, ordinary
TIED, NAN_ROW, SAME = slice(0, 4), 4, slice(8, 12)
ZERO_ADV = 4 + 1 + 4  # responses with A = 0 in that batch


def forced_ops() -> dict:
    """Every step's batch holds a group tied by value (its responses differ), a response with a
    NaN reward, and a group of identical responses; records each reward phase's result and the
    rows each reward-model call differentiates. ``forced["ops"]``: the seams that do it."""
    real_score, real_sample = score, sample_groups
    seen = {"rewarded": [], "grad_rows": [], "rm_grad": [], "split_same": False}

    def score_(rm, inputs, mask, with_grad=False, batch_size=64, grad_rows=None, share=True):
        out = real_score(rm, inputs, mask, with_grad, batch_size, grad_rows, share)
        if with_grad:
            seen["grad_rows"].append(torch.ones(len(mask), dtype=torch.bool) if grad_rows is None else grad_rows)
        if len(mask) != B:  # a call on some rows only (none here: the RM is batch-invariant on CPU)
            return out
        s = out.scores.clone()
        s[TIED], s[NAN_ROW] = 0.25, math.nan
        if seen["split_same"]:  # as a reward model that is not batch-invariant could
            s[SAME.start] += 0.5
        return dataclasses.replace(out, scores=s)

    def sample_(*a, **k):
        ro = real_sample(*a, **k)
        for x in (ro.response_ids, ro.response_mask, ro.truncated, ro.logits):
            if x is not None:
                x[SAME] = x[SAME.start]
        return ro

    def observe(phase, rw):
        if phase == "reward":
            seen["rewarded"].append(rw)
            seen["rm_grad"].append(rw.rm_grad)  # the step drops rw.rm_grad once the credit is made

    seen["ops"] = StepOps(score=score_, sample=sample_, observe=observe)
    return seen


def skip_step(cache, tmp_path, skip, *overrides, share=False, ops=None):
    c = validate(cfg_for(cache, tmp_path / "unused", "trainer.warmup_steps=0", f"trainer.batch_size={B}",
                         f"trainer.num_generations={G}", f"trainer.mini_batch_size={B}", f"trainer.micro_batch_size={B}",
                         f"trainer.skip_zero_advantage={str(skip).lower()}", f"trainer.share_prompts={str(share).lower()}",
                         *overrides))
    s = build_session(c, ops=ops)
    torch.manual_seed(123)
    metrics = train_step(s, 0).metrics
    return metrics, {n: p.detach().clone() for n, p in s.m.policy.named_parameters()}


def same_update(cache, tmp_path, *overrides, share=False, ops=None):
    """One step with the skip on and one with it off, from the same state and seed: the same
    parameters and loss, bit for bit, and the same logged figures (but the skipped fraction and
    the rollout entropy, which on-policy comes from the update's forward when rows were skipped).
    With ``share`` (shared prompt forwards) the same up to float rounding."""
    m_on, p_on = skip_step(cache, tmp_path, True, *overrides, share=share, ops=ops)
    m_off, p_off = skip_step(cache, tmp_path, False, *overrides, share=share, ops=ops)

    def same(a, b, rel=0.0):
        return a == (pytest.approx(b, rel=max(rel, 1e-5), abs=1e-8) if share or rel else b)

    assert same(m_on["loss/total"], m_off["loss/total"])
    for n, p in p_off.items():
        if share:  # the update moves parameters by ~lr = 5e-4: rounding moves them by ~1e-8
            torch.testing.assert_close(p_on[n], p, rtol=0, atol=1e-7, msg=n)
        else:
            assert torch.equal(p_on[n], p), n
    assert m_off["credit/skipped_frac"] == 0.0
    for k, v in m_off.items():
        if k.startswith("perf/") or k == "credit/skipped_frac" or (isinstance(v, float) and math.isnan(v)):
            continue
        assert same(m_on[k], v, 1e-6 if k == "rollout/entropy" else 0.0), k
    return m_on, m_off
