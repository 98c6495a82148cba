"""A performance switch leaves the training step unchanged: the same step (same state, same seed)
with the switch off and on gives the same metrics, timings aside, and the same update; exactly
where the switch only reorders what is kept (gradient checkpointing recomputes the same
activations; static decoding draws the dynamic loop's random numbers, so GRPO, which reads nothing
else of the sampler, is equal bit for bit), to float rounding where it changes the arithmetic's
order (the chunked LM head, the shared trunk, DATC's credit from the static sampler's kept
logits). Each case also checks that the step plan did switch. The switches' own unit tests are
in tests/forward/ (test_gradient_checkpointing.py, test_head_chunk.py, test_trunk.py),
tests/engines/test_static_decode.py and tests/models/test_lora.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from datc.checks import validate
from datc.step import train_step
from datc.training.session import build_session
from tests.helpers.testbed import cfg_for

TRUNK = ["policy=tiny_llama", "+reward.init=policy", "+reward.train.trainable_layers=1", "credit=datc"]
TRUNK_KEYS = ("reward/rm_score", "reward/advantage_abs", "loss/kl", "loss/total", "loss/grad_norm")


@dataclass
class Switch:
    """One switch: ``off`` and ``on`` its two settings over the shared ``overrides``; ``plan``
    reads from the session what the plan decided (``decided`` for off and on). ``rel``/``abs``:
    None compares the metrics exactly, else to that tolerance (over ``keys``, or every metric but
    ``perf/*``). ``slow``: marked slow (the cases that were). ``update``: "params" compares the updated parameters (exactly when the metrics are
    exact, else within ``update_tol``), "grads" the step's gradients (Adam turns rounding on a
    near-zero gradient entry into a step of about lr, so an inexact switch compares those)."""

    overrides: list[str]
    off: str
    on: str
    plan: object
    decided: tuple
    seed: int = 0
    steps: int = 1
    rel: float | None = None
    abs: float = 0.0
    keys: tuple[str, ...] | None = None
    update: str | None = "params"
    update_tol: tuple[float, float] = (0.0, 0.0)
    nan_ok: bool = False  # an inexact comparison lets NaN (an empty diagnostic) equal NaN
    slow: bool = True


SWITCHES = {
    # (was tests/forward/test_gradient_checkpointing.py::test_a_training_step_with_checkpointing_equals_the_plain_one)
    "gradient_checkpointing": Switch(
        ["credit=datc", "trainer.share_prompts=false"], "trainer.gradient_checkpointing=false",
        "trainer.gradient_checkpointing=true", lambda s: (s.plan.grad_checkpoint, s.plan.update_passes.share),
        ((False, False), (True, False)), seed=7),
    # (was tests/forward/test_head_chunk.py::test_a_training_step_with_the_chunked_head_equals_the_whole_one)
    "lm_head_chunk": Switch(
        ["credit=datc", "trainer.micro_batch_size=4"], "trainer.lm_head_chunk=null", "trainer.lm_head_chunk=3",
        lambda s: s.plan.head_chunk, (None, 3), seed=7, rel=1e-5, abs=1e-6, update="grads", update_tol=(1e-4, 1e-7)),
    # (was tests/engines/test_static_decode.py::test_a_training_step_decoding_statically_gives_the_dynamic_steps_metrics:
    # checking every step, decode_sync_every=1; two steps: the static cache is reused by the second)
    "decode-grpo": Switch(
        ["credit=grpo", "trainer.decode_sync_every=1"], "trainer.decode=dynamic", "trainer.decode=static",
        lambda s: s.plan.describe()["decode"], ("dynamic", "static"), steps=2, update=None),
    "decode-datc": Switch(
        ["credit=datc", "trainer.decode_sync_every=1"], "trainer.decode=dynamic", "trainer.decode=static",
        lambda s: s.plan.describe()["decode"], ("dynamic", "static"), steps=2, rel=1e-4, abs=1e-6, update=None,
        nan_ok=True),
    # (was tests/forward/test_trunk.py::test_a_training_step_with_the_shared_trunk_matches_one_without;
    # tiny_llama: 2 blocks, the reward model's top one trained, so a trunk of 1)
    "share_trunk": Switch(
        [*TRUNK, "trainer.beta=0.04"], "trainer.share_trunk=false", "trainer.share_trunk=true",
        lambda s: s.plan.trunk, (0, 1), rel=1e-4, abs=1e-6, keys=TRUNK_KEYS, update=None, slow=False),
    # (was tests/models/test_lora.py::test_a_training_step_with_the_shared_trunk_matches_one_without_under_lora:
    # the reference is the policy with its adapters off)
    "share_trunk-lora": Switch(
        [*TRUNK, "policy.lora.r=4"], "trainer.share_trunk=false", "trainer.share_trunk=true",
        lambda s: s.plan.trunk, (0, 1), rel=1e-4, abs=1e-6, keys=TRUNK_KEYS, update=None, slow=False),
}


def _run(cache_dir, sw: Switch, setting: str):
    c = validate(cfg_for(cache_dir, "unused", "trainer.warmup_steps=0", *sw.overrides, setting))
    s = build_session(c)
    torch.manual_seed(sw.seed)
    metrics = [train_step(s, it).metrics for it in range(sw.steps)]
    params = {n: p.detach().clone() for n, p in s.m.policy.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in s.m.policy.named_parameters() if p.grad is not None}
    return sw.plan(s), metrics, params, grads


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if sw.slow else []) for n, sw in SWITCHES.items()])
def test_a_performance_switch_leaves_the_step_unchanged(cache_dir, name):
    """Replaces test_gradient_checkpointing.py::test_a_training_step_with_checkpointing_equals_the_plain_one,
    test_head_chunk.py::test_a_training_step_with_the_chunked_head_equals_the_whole_one,
    test_static_decode.py::test_a_training_step_decoding_statically_gives_the_dynamic_steps_metrics,
    test_trunk.py::test_a_training_step_with_the_shared_trunk_matches_one_without and
    test_lora.py::test_a_training_step_with_the_shared_trunk_matches_one_without_under_lora, with
    their assertions (and, for all, the same metric keys, a non-zero gradient and the same
    response lengths on both sides)."""
    sw = SWITCHES[name]
    plan_off, m_off, p_off, g_off = _run(cache_dir, sw, sw.off)
    plan_on, m_on, p_on, g_on = _run(cache_dir, sw, sw.on)
    assert (plan_off, plan_on) == sw.decided
    for a, b in zip(m_off, m_on, strict=True):
        keys = sorted(k for k in a if not k.startswith("perf/"))
        assert keys == sorted(k for k in b if not k.startswith("perf/")) and "rollout/response_len" in keys
        assert a["loss/grad_norm"] > 0  # the step computed a gradient: the comparison can fail
        for k in sw.keys or keys:
            if sw.rel is None:  # bit for bit; a NaN (an empty diagnostic: grpo's credit/accuracy) on both sides
                assert b[k] == a[k] or (math.isnan(a[k]) and math.isnan(b[k])), k
            else:
                assert b[k] == pytest.approx(a[k], rel=sw.rel, abs=sw.abs, nan_ok=sw.nan_ok), k
        assert a["rollout/response_len"] == b["rollout/response_len"]  # the same responses
    if sw.update == "params":
        assert p_off.keys() == p_on.keys()
        for n, p in p_off.items():
            if sw.rel is None:
                assert torch.equal(p_on[n], p), n
            else:
                torch.testing.assert_close(p_on[n], p, rtol=sw.update_tol[0], atol=sw.update_tol[1], msg=n)
    elif sw.update == "grads":
        assert g_off.keys() == g_on.keys() and g_off
        for n, g in g_off.items():
            torch.testing.assert_close(g_on[n], g, rtol=sw.update_tol[0], atol=sw.update_tol[1], msg=n)
