"""Non-finite numbers (NaN, ±inf) are caught where they arise and the run stays safe: the
helpers of :mod:`datc.math.numerics` on hand-made tensors, then faults injected into a tiny run."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

import datc.training.evaluation as evaluation_mod
from datc.checks import validate
from datc.config import ConfigError
from datc.credit import compute_credit
from datc.math.advantages import group_advantages
from datc.math.losses import clipped_policy_loss
from datc.math.numerics import (
    SOURCES,
    NonFiniteError,
    NonFiniteReport,
    drop_nonfinite_rewards,
    loss_is_finite,
    nonfinite_rows,
    uniform_nonfinite_weights,
    zero_nonfinite_advantages,
    zero_nonfinite_rm_grad,
)
from datc.rewards.model import RMScore, score
from datc.run.checkpoint import latest_checkpoint, load_checkpoint
from datc.step.ops import StepOps
from datc.training.evaluation import evaluate
from datc.training.session import build_session
from datc.training.trainer import train
from tests.helpers.testbed import cfg_for

NAN, INF = math.nan, math.inf

# ---------------------------------------------------------------------------------------------
# Helpers on hand-made tensors
# ---------------------------------------------------------------------------------------------


def test_nonfinite_rows_flags_nan_and_both_infinities():
    x = torch.tensor([[1.0, 2.0], [NAN, 0.0], [0.0, INF], [-INF, 1.0]])
    assert nonfinite_rows(x).tolist() == [False, True, True, True]
    assert nonfinite_rows(torch.zeros(3, 2, 4)).tolist() == [False] * 3


def test_nonfinite_rewards_are_dropped_and_leave_their_group_mean_unchanged():
    rewards = torch.tensor([1.0, NAN, 3.0, 5.0, INF, -INF, 2.0, 4.0])  # two groups of 4
    mask = torch.ones(8, 3, dtype=torch.bool)
    filled, new_mask, bad = drop_nonfinite_rewards(rewards, mask, 4)
    assert bad.tolist() == [False, True, False, False, True, True, False, False]
    assert filled.tolist() == [1.0, 3.0, 3.0, 5.0, 3.0, 3.0, 2.0, 4.0]  # the group's finite mean
    assert new_mask.tolist() == [[not b] * 3 for b in bad.tolist()]
    assert mask.all()  # the input is not modified
    adv, bad_adv = zero_nonfinite_advantages(group_advantages(filled, 4), dropped=bad)
    assert not bad_adv.any() and torch.isfinite(adv).all()
    assert (adv[bad] == 0).all()
    # The finite responses are ranked around the mean of the finite rewards only.
    assert adv[0] < 0 and adv[2] == 0 and adv[3] > 0 and adv[6] < 0 and adv[7] > 0


def test_a_group_with_no_finite_reward_gets_zero_advantages():
    rewards = torch.tensor([NAN, INF, -INF, NAN, 1.0, 2.0, 3.0, 4.0])
    filled, mask, bad = drop_nonfinite_rewards(rewards, torch.ones(8, 2, dtype=torch.bool), 4)
    assert torch.isfinite(filled).all() and bad[:4].all() and not bad[4:].any()
    adv, _ = zero_nonfinite_advantages(group_advantages(filled, 4), dropped=bad)
    assert (adv[:4] == 0).all() and not mask[:4].any() and mask[4:].all()


def test_finite_rewards_pass_through_untouched():
    rewards, mask = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.ones(4, 2, dtype=torch.bool)
    filled, new_mask, bad = drop_nonfinite_rewards(rewards, mask, 2)
    assert filled is rewards and new_mask is mask and not bad.any()


def test_nonfinite_advantages_are_zeroed_and_counted():
    adv, bad = zero_nonfinite_advantages(torch.tensor([0.5, NAN, INF, -INF, -1.0]))
    assert adv.tolist() == [0.5, 0.0, 0.0, 0.0, -1.0]
    assert bad.tolist() == [False, True, True, True, False]
    adv, bad = zero_nonfinite_advantages(torch.tensor([0.5, 1.0]), dropped=torch.tensor([True, False]))
    assert adv.tolist() == [0.0, 1.0] and not bad.any()  # dropped responses are counted as rewards


def test_nonfinite_rm_grad_rows_are_zeroed():
    g = torch.randn(4, 3, 2)
    g[1, 2, 0], g[2, 0, 1], g[3, 1, 1] = NAN, INF, -INF
    out, bad = zero_nonfinite_rm_grad(g)
    assert bad.tolist() == [False, True, True, True]
    assert torch.equal(out[0], g[0]) and (out[1:] == 0).all()
    assert zero_nonfinite_rm_grad(None) == (None, None)


def test_nonfinite_weights_fall_back_to_one_per_response():
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False], [True, True, False]])
    w = torch.tensor([[0.5, 1.5, NAN],  # NaN on a masked position only: not a fault, zeroed
                      [NAN, 1.0, 2.0], [INF, 0.0, 0.0], [-INF, 2.0, 0.0]])
    weights, fallback, bad = uniform_nonfinite_weights(w, torch.zeros(4, dtype=torch.bool), mask)
    assert bad.tolist() == [False, True, True, True]
    assert weights.tolist() == [[0.5, 1.5, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert fallback.tolist() == [False, True, True, True]


def test_forced_responses_get_uniform_weights_without_counting_as_weight_faults():
    mask = torch.tensor([[True, True], [True, False]])
    w, none = torch.tensor([[0.2, 1.8], [1.0, 0.0]]), torch.zeros(2, dtype=torch.bool)
    weights, fallback, bad = uniform_nonfinite_weights(w, none, mask, forced=torch.tensor([True, False]))
    assert not bad.any()
    assert weights.tolist() == [[1.0, 1.0], [1.0, 0.0]] and fallback.tolist() == [True, False]
    same, same_fallback, bad = uniform_nonfinite_weights(w, none, mask)
    assert same is w and same_fallback is none and not bad.any()


@pytest.mark.parametrize("value,ok", [(1.5, True), (NAN, False), (INF, False), (-INF, False)])
def test_loss_is_finite(value, ok):
    assert loss_is_finite(torch.tensor(value)) is ok


def test_report_counts_per_stage_and_names_where_it_started():
    nf = NonFiniteReport(4)
    nf.add("advantage", torch.tensor([False, True, False, False]))
    nf.add("rm_grad", None)  # the scheme did not use the reward-model gradient
    nf.add("loss", torch.tensor([True, True, False, False]))
    nf.nonfinite_micro_batches = 1
    assert nf.metrics() == {"reward/nonfinite_frac": 0.0, "reward/nonfinite_adv_frac": 0.25,
                            "credit/nonfinite_rm_grad_frac": 0.0, "credit/nonfinite_weight_frac": 0.0,
                            "loss/nonfinite_micro_batches": 1.0}
    assert nf.any_frac() == 0.5
    nf.check(0.5, step=7)  # not more than the limit
    with pytest.raises(NonFiniteError, match="advantage stage at training step 7") as e:
        nf.check(0.25, step=7)
    assert isinstance(e.value, RuntimeError) and "trainer.max_nonfinite_frac=0.25" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="unknown"):
        nf.add("gradient", torch.tensor([True] * 4))
    assert SOURCES == ("reward", "advantage", "rm_grad", "weight", "loss")


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_max_nonfinite_frac_is_range_checked(tmp_path, value):
    with pytest.raises(ConfigError, match=r"^trainer.max_nonfinite_frac: must be in \[0, 1\]"):
        validate(cfg_for(tmp_path / "c", tmp_path / "r", f"trainer.max_nonfinite_frac={value}"))


# ---------------------------------------------------------------------------------------------
# Faults injected into a tiny run (debug=fast: 3 steps of 8 responses, groups of 4)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def nf_cache(prepared_cache):
    """The session's cache, prepared once (warm-started policy and reward model), for every run below."""
    return prepared_cache


def _train_rows(run_dir):
    rows = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    return {r["step"]: r for r in rows if "loss/total" in r}


def _assert_finite_policy(run_dir):
    state = load_checkpoint(latest_checkpoint(run_dir))["policy"]
    bad = [n for n, p in state.items() if p.is_floating_point() and not torch.isfinite(p).all()]
    assert not bad, f"non-finite parameters: {bad}"
    assert (run_dir / "summary.json").exists()


def _calls(fn, inject):
    """Wrap ``fn`` so that its n-th call's result goes through ``inject(n, result)``."""
    n = {"calls": 0}

    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        i, n["calls"] = n["calls"], n["calls"] + 1
        return inject(i, out, kwargs)

    return wrapped


def _patch_scores(at: dict[int, list[tuple[int, float]]], grad: bool = False) -> StepOps:
    """The step's scorer, whose training reward calls (one per step, 0-based) in ``at`` get
    ``value`` in ``row``'s score (or, with ``grad``, in its reward-model gradient)."""
    train_calls = {"n": 0}
    real = score

    def fake(*args, **kwargs):
        out = real(*args, **kwargs)
        if "with_grad" not in kwargs:  # the eval's scoring
            return out
        i, train_calls["n"] = train_calls["n"], train_calls["n"] + 1
        scores, g = out.scores.clone(), None if out.grad is None else out.grad.clone()
        for row, value in at.get(i, []):
            if grad:
                g[row, 0, 0] = value
            else:
                scores[row] = value
        return RMScore(scores, g)

    return StepOps(score=fake)


@pytest.mark.slow
def test_nonfinite_rewards_are_dropped_and_counted_in_a_run(nf_cache, tmp_path, monkeypatch):
    train(cfg_for(nf_cache, tmp_path / "r"), ops=_patch_scores({0: [(1, NAN), (5, INF)], 2: [(6, -INF)]}))
    rows = _train_rows(tmp_path / "r")
    assert [rows[s]["reward/nonfinite_frac"] for s in (1, 2, 3)] == [0.25, 0.0, 0.125]
    assert all(math.isfinite(rows[s]["reward/total"]) and math.isfinite(rows[s]["loss/total"]) for s in rows)
    _assert_finite_policy(tmp_path / "r")


@pytest.mark.slow
def test_nonfinite_advantages_are_zeroed_and_counted_in_a_run(nf_cache, tmp_path, monkeypatch):
    def inject(i, adv, kwargs):
        adv = adv.clone()
        if i == 1:
            adv[3] = NAN
        return adv

    train(cfg_for(nf_cache, tmp_path / "r"), ops=StepOps(advantages=_calls(group_advantages, inject)))
    rows = _train_rows(tmp_path / "r")
    assert [rows[s]["reward/nonfinite_adv_frac"] for s in (1, 2, 3)] == [0.0, 0.125, 0.0]
    assert math.isfinite(rows[2]["reward/advantage_abs"])
    _assert_finite_policy(tmp_path / "r")


@pytest.mark.slow
def test_nonfinite_rm_grad_falls_back_to_uniform_credit_in_a_run(nf_cache, tmp_path, monkeypatch):
    train(cfg_for(nf_cache, tmp_path / "r", "credit=datc"), ops=_patch_scores({1: [(0, NAN), (6, INF)]}, grad=True))
    rows = _train_rows(tmp_path / "r")
    assert [rows[s]["credit/nonfinite_rm_grad_frac"] for s in (1, 2, 3)] == [0.0, 0.25, 0.0]
    assert all(math.isfinite(rows[2][k]) for k in ("credit/weight_mean", "credit/weight_max", "loss/total"))
    _assert_finite_policy(tmp_path / "r")


@pytest.mark.slow
def test_nonfinite_credit_weights_fall_back_to_one_in_a_run(nf_cache, tmp_path, monkeypatch):
    def inject(i, credit, kwargs):
        w = credit.weights.clone()
        w[2, 0] = NAN  # every step, one response
        if i == 2:
            w[4, 0] = -INF
        return replace(credit, weights=w)

    train(cfg_for(nf_cache, tmp_path / "r", "credit=datc"), ops=StepOps(credit=_calls(compute_credit, inject)))
    rows = _train_rows(tmp_path / "r")
    assert [rows[s]["credit/nonfinite_weight_frac"] for s in (1, 2, 3)] == [0.125, 0.125, 0.25]
    assert all(math.isfinite(rows[s]["credit/weight_max"]) for s in rows)
    _assert_finite_policy(tmp_path / "r")


def _nan_loss(calls: set[int]):
    def inject(i, out, kwargs):
        return replace(out, loss=out.loss * NAN) if i in calls else out

    return StepOps(loss=_calls(clipped_policy_loss, inject))


@pytest.mark.slow
def test_nonfinite_micro_batch_loss_is_not_backpropagated_in_a_run(nf_cache, tmp_path, monkeypatch):
    # Two micro-batches of 4 per step: the first of step 2 (call 2) is NaN; half the responses.
    train(cfg_for(nf_cache, tmp_path / "r", "trainer.micro_batch_size=4"), ops=_nan_loss({2}))
    rows = _train_rows(tmp_path / "r")
    assert [rows[s]["loss/nonfinite_micro_batches"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert rows[2]["loss/skipped_steps"] == 0.0  # the other micro-batch still gave a gradient
    assert all(math.isfinite(rows[s]["loss/total"]) and math.isfinite(rows[s]["loss/grad_norm"]) for s in rows)
    _assert_finite_policy(tmp_path / "r")


@pytest.mark.slow
def test_a_step_without_any_finite_loss_takes_no_optimizer_step(nf_cache, tmp_path, monkeypatch):
    train(cfg_for(nf_cache, tmp_path / "r", "trainer.max_nonfinite_frac=1.0"), ops=_nan_loss({1}))
    rows = _train_rows(tmp_path / "r")
    assert [rows[s]["loss/skipped_steps"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    _assert_finite_policy(tmp_path / "r")


@pytest.mark.slow
@pytest.mark.parametrize("source", ["reward", "loss"])
def test_a_step_mostly_nonfinite_stops_the_run_and_names_the_source(nf_cache, tmp_path, monkeypatch, source):
    ops = _patch_scores({1: [(i, NAN) for i in range(8)]}) if source == "reward" else _nan_loss({1})
    with pytest.raises(NonFiniteError, match=f"at the {source} stage at training step 2") as e:
        train(cfg_for(nf_cache, tmp_path / "r"), ops=ops)
    assert "trainer.max_nonfinite_frac=0.5" in str(e.value)
    rows = _train_rows(tmp_path / "r")
    assert sorted(rows) == [1, 2]  # the faulty step's metrics were logged, then the run stopped
    key = "reward/nonfinite_frac" if source == "reward" else "loss/nonfinite_micro_batches"
    assert rows[2][key] == 1.0
    assert not (tmp_path / "r" / "summary.json").exists()


@pytest.mark.slow
def test_nonfinite_scores_at_eval_are_counted_not_averaged(nf_cache, tmp_path, monkeypatch):
    real = evaluation_mod.score

    def half_nan(*args, **kwargs):
        out = real(*args, **kwargs)
        scores = out.scores.clone()
        scores[::2] = float("nan")
        return replace(out, scores=scores)

    monkeypatch.setattr(evaluation_mod, "score", half_nan)
    c = validate(cfg_for(nf_cache, tmp_path / "unused"))
    s = build_session(c)
    metrics, _ = evaluate(c, s.m, list(s.assets.eval)[:16], s.assets.task, s.device, s.plan)
    assert metrics["eval/rm_nonfinite_frac"] == 0.5
    assert math.isfinite(metrics["eval/rm_score"]) and math.isfinite(metrics["eval/rm_gold_corr"])
