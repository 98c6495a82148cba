"""The reference and the reward model's shared trunk (:mod:`datc.forward.trunk`): found only where the
two models are equal block for block; one reference pass gives the reference's log-probs and,
through the reward model's own top blocks, its scores and input gradients, equal to the plain
passes' to rounding, without running the reward model's lower blocks; a training step with it
matches one without (tests/step/test_performance_switches.py, with and without LoRA)."""

from __future__ import annotations

import pytest
import torch

from datc.forward.passes import rollout_policy_pass
from datc.forward.trunk import _top_blocks, reference_and_score, shared_trunk_depth
from datc.models.build import build_causal_lm, build_reward_model
from datc.models.rm_inputs import build_rm_inputs
from datc.rewards.model import score
from tests.helpers.shared_prompt import G, N, forward_rows, grouped_rollout
from tests.helpers.testbed import ARCHS
from tests.helpers.trunk import FAMILIES, LAYERS, trunk_pair


def test_the_trunk_is_the_equal_leading_blocks(tok):
    ref, rm = trunk_pair(tok, differ_at=2)
    assert shared_trunk_depth(ref, rm) == 2
    ref, rm = trunk_pair(tok, differ_at=None)
    assert shared_trunk_depth(ref, rm) == LAYERS - 1  # the reward model's top block always runs
    with torch.no_grad():
        rm.base_model.embed_tokens.weight[5, 0] += 1e-6  # one entry of the embeddings
    assert shared_trunk_depth(ref, rm) == 0
    ref, rm = trunk_pair(tok)
    rm.config.rms_norm_eps = ref.config.rms_norm_eps * 2  # same weights, another function
    assert shared_trunk_depth(ref, rm) == 0
    ref, rm = trunk_pair(tok)
    assert shared_trunk_depth(ref, rm.to(torch.float64)) == 0
    assert shared_trunk_depth(None, rm) == 0
    gpt2 = build_causal_lm(ARCHS["gpt2"], tok, 0)
    assert shared_trunk_depth(gpt2, build_reward_model(ARCHS["gpt2"], tok, 0)) == 0  # not a supported family


def test_partitioned_parameters_share_nothing(tok):
    """Under ZeRO-3 a rank's parameters are empty shards (marked with ``ds_id``): equal empties
    must not count as a shared trunk."""
    ref, rm = trunk_pair(tok, differ_at=None)
    assert shared_trunk_depth(ref, rm) == LAYERS - 1
    rm.base_model.layers[-1].mlp.down_proj.weight.ds_id = 7  # one partitioned parameter, above the trunk
    assert shared_trunk_depth(ref, rm) == 0
    del rm.base_model.layers[-1].mlp.down_proj.weight.ds_id
    ref.lm_head.weight.ds_id = 0
    assert shared_trunk_depth(ref, rm) == 0


def test_the_top_blocks_are_restored_after_an_error(tok):
    ref, rm = trunk_pair(tok)
    layers = rm.base_model.layers
    idx = [blk.self_attn.layer_idx for blk in layers]
    with pytest.raises(RuntimeError, match="inside"), _top_blocks(rm, 2):
        assert len(rm.base_model.layers) == LAYERS - 2 and rm.base_model.layers[0].self_attn.layer_idx == 0
        raise RuntimeError("inside")
    assert rm.base_model.layers is layers and [blk.self_attn.layer_idx for blk in layers] == idx


def test_the_trunk_is_off_without_shared_prompts_or_a_reference(cache_dir):
    """The trunk runs in the reference's shared-prompt layout and needs the reference's pass:
    plain prompt forwards (``trainer.share_prompts: false``) or no KL term turn it off."""
    from datc.checks import validate
    from datc.training.session import build_session
    from tests.helpers.testbed import cfg_for

    base = ["policy=tiny_llama", "+reward.init=policy", "+reward.train.trainable_layers=1", "trainer.beta=0.04"]
    depth = {}
    for name, extra in (("on", []), ("no shared prompts", ["trainer.share_prompts=false"]),
                        ("no reference", ["trainer.beta=0.0"])):
        s = build_session(validate(cfg_for(cache_dir, "unused", *base, *extra)))
        depth[name] = s.plan.trunk
    assert depth == {"on": 1, "no shared prompts": 0, "no reference": 0}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_reference_pass_gives_the_plain_log_probs_scores_and_gradients(tok, family):
    ref, rm = trunk_pair(tok, family)
    depth = shared_trunk_depth(ref, rm)
    assert depth == 3
    ro = grouped_rollout(len(tok))
    ran = []
    rm.base_model.layers[0].register_forward_hook(lambda *a: ran.append(1))
    layers = rm.base_model.layers
    logps, out = reference_and_score(ref, rm, depth, ro, 0.7, 5, with_grad=True)
    assert not ran and rm.base_model.layers is layers  # the reward model's lower blocks never ran; restored after
    assert [blk.self_attn.layer_idx for blk in layers] == list(range(LAYERS))
    calls = forward_rows(rm)
    reference_and_score(ref, rm, depth, ro, 0.7, N * G)
    assert calls == [N, N * G]  # its top blocks: each distinct prompt once, then every row's continuation
    m = ro.response_mask
    plain_logps = rollout_policy_pass(ref, ro, 0.7, 5, False, with_entropy=False)[0]
    torch.testing.assert_close(logps[m], plain_logps[m], rtol=1e-5, atol=1e-5)
    inp = build_rm_inputs(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, tok.pad_token_id)
    plain = score(rm, inp, ro.response_mask, with_grad=True)
    assert ran  # the plain score does run them
    assert plain.scores.std() > 0.1 and plain.grad[m].abs().sum(-1).gt(0).all()
    torch.testing.assert_close(out.scores, plain.scores, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.grad, plain.grad, rtol=1e-4, atol=1e-5)
    assert out.grad[~m].eq(0).all()
    # without a gradient, and with it for some rows only (the others get zeros)
    nograd_logps, nograd = reference_and_score(ref, rm, depth, ro, 0.7, 4)
    assert nograd.grad is None
    torch.testing.assert_close(nograd.scores, plain.scores, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nograd_logps[m], plain_logps[m], rtol=1e-5, atol=1e-5)
    rows = torch.arange(len(m)) % 3 == 1
    _, part = reference_and_score(ref, rm, depth, ro, 0.7, 4, with_grad=True, grad_rows=rows)
    torch.testing.assert_close(part.grad[rows], plain.grad[rows], rtol=1e-4, atol=1e-5)
    assert part.grad[~rows].eq(0).all()
    torch.testing.assert_close(part.scores, plain.scores, rtol=1e-5, atol=1e-5)
