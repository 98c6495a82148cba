"""``rollout/entropy``: the rollout policy's mean entropy over the response tokens. On-policy the
update's forward is that policy, so a scheme that does not read entropies gets none computed in
the credit phase (at a real vocabulary, passes over a (B, T, V) tensor) and the figure comes
from the update; a scheme that reads them, or an update whose policy has moved, gets them."""

from __future__ import annotations

import pytest
import torch

from datc.checks import validate
from datc.math.logprobs import entropy_from_logits
from datc.step import train_step
from datc.step.ops import StepOps
from datc.training.session import build_session
from tests.helpers.testbed import cfg_for


@pytest.fixture
def cache(cache_dir):
    return cache_dir  # the session's (assets are keyed by their config)


def _step(cache, tmp_path, *overrides):
    """One step; returns its metrics, the kept rollout logits (temperature 1) and masks, and the
    entropies each credit chunk carried."""
    seen = {"ro": None, "chunk_entropy": []}

    def observe(phase, result):
        if phase == "rollout":
            seen["ro"], seen["logits"] = result, result.logits  # the step drops ro.logits once the credit is made
        elif phase == "credit_inputs":
            seen["chunk_entropy"].append(result.entropy)

    c = validate(cfg_for(cache, tmp_path / "unused", "trainer.warmup_steps=0", "trainer.batch_size=8",
                         "trainer.num_generations=4", "trainer.micro_batch_size=8", *overrides))
    s = build_session(c, ops=StepOps(observe=observe))
    torch.manual_seed(5)
    return train_step(s, 0).metrics, seen


def test_on_policy_datc_takes_the_rollout_entropy_from_the_update(cache, tmp_path):
    m, seen = _step(cache, tmp_path, "credit=datc", "trainer.mini_batch_size=8",
                    "trainer.reuse_rollout_logits=always", "trainer.skip_zero_advantage=false")
    assert seen["logits"] is not None and seen["chunk_entropy"] == [None]  # reused logits, no entropies made
    ro = seen["ro"]
    kept = (entropy_from_logits(seen["logits"]) * ro.response_mask).sum() / ro.response_mask.sum()
    assert m["rollout/entropy"] == pytest.approx(float(kept), rel=1e-5)  # the update's forward, same policy


@pytest.mark.parametrize("overrides", [
    ("credit=entropy_top", "trainer.mini_batch_size=8"),  # the scheme reads them
    ("credit=datc", "trainer.mini_batch_size=4", "trainer.micro_batch_size=4"),  # two updates: the second's policy has moved
])
def test_entropies_are_made_where_read_or_off_policy(cache, tmp_path, overrides):
    m, seen = _step(cache, tmp_path, *overrides, "trainer.skip_zero_advantage=false")
    ents = [e for e in seen["chunk_entropy"] if e is not None]
    assert ents and len(ents) == len(seen["chunk_entropy"])
    ro = seen["ro"]
    ent = torch.cat(ents)
    assert m["rollout/entropy"] == pytest.approx(float((ent * ro.response_mask).sum() / ro.response_mask.sum()), rel=1e-6)
