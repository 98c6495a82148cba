"""Sampling in several calls (``trainer.generation_batch_size``, to cap the KV cache): the parts
are joined into one batch whose rows compute exactly what they did alone, and a training step
makes as many sampling calls as the setting asks."""

from __future__ import annotations

import pytest
import torch

from datc.batch import cat_rollouts
from datc.checks import validate
from datc.config import ConfigError
from datc.engines.generate import sample_groups
from datc.forward.passes import rollout_policy_pass
from datc.step import train_step
from datc.step.ops import StepOps
from datc.training.session import build_session
from tests.helpers.testbed import cfg_for


def test_joined_rollouts_compute_what_their_parts_did(policy, tok):
    torch.manual_seed(0)
    short = sample_groups(policy, tok, [{"prompt": "write about cats"}], 2, 6)
    long = sample_groups(policy, tok, [{"prompt": "write about the sun and the sea"}, {"prompt": "hi"}], 2, 6)
    assert short.prompt_ids.shape[1] < long.prompt_ids.shape[1]
    ro = cat_rollouts([short, long], tok.pad_token_id)
    assert ro.prompt_ids.shape == (6, long.prompt_ids.shape[1])
    assert ro.examples == short.examples + long.examples
    width = short.prompt_ids.shape[1]
    assert torch.equal(ro.prompt_ids[:2, -width:], short.prompt_ids)  # left-padded into the wider batch
    assert not ro.prompt_mask[:2, :-width].any()
    whole = rollout_policy_pass(policy, ro, 1.0, 6, False)[0]
    parts = torch.cat([rollout_policy_pass(policy, p, 1.0, 6, False)[0] for p in (short, long)])
    mask = ro.response_mask
    torch.testing.assert_close(whole[mask], parts[mask], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_step_samples_in_calls_of_generation_batch_size(cache_dir, tmp_path):
    c = validate(cfg_for(cache_dir, tmp_path / "unused", "trainer.batch_size=16",
                         "trainer.mini_batch_size=16", "trainer.micro_batch_size=16",
                         "trainer.generation_batch_size=8"))
    calls = []

    def counted(*args, **kwargs):
        calls.append(len(args[2]))  # prompts in this call
        return sample_groups(*args, **kwargs)

    s = build_session(c, ops=StepOps(sample=counted))
    metrics = train_step(s, 0).metrics
    assert calls == [2, 2]  # 16 responses = 4 prompts x 4, in calls of 8 responses (2 prompts)
    assert metrics["loss/grad_norm"] > 0


def test_generation_batch_must_hold_whole_groups(tmp_path):
    with pytest.raises(ConfigError, match="^trainer.generation_batch_size"):
        validate(cfg_for(tmp_path, tmp_path, "trainer.generation_batch_size=6"))  # groups of 4
