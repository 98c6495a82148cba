"""``trainer.gradient_checkpointing``: the update's decoder blocks recompute their activations in
the backward: the same gradients, fewer bytes kept for the backward, the policy left as it was.
A training step with it equals the plain one: tests/step/test_performance_switches.py."""

from __future__ import annotations

import torch

from datc.engines.generate import sample_groups
from datc.forward.passes import Passes, checkpointed_layers, decoder_layers


def _saved_bytes_and_grads(policy, ro, p, checkpoint):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    policy.zero_grad(set_to_none=True)
    ctx = checkpointed_layers(policy) if checkpoint else torch.enable_grad()
    with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logps, _ = p.token_logps(policy, ro, slice(0, ro.response_ids.shape[0]), None)
        (logps * ro.response_mask).sum().backward()
    return sum(saved), {n: q.grad.clone() for n, q in policy.named_parameters() if q.grad is not None}


def test_the_same_gradients_with_fewer_saved_activations(policy, tok):
    torch.manual_seed(0)
    ro = sample_groups(policy, tok, [{"prompt": "write about cats"}, {"prompt": "the sun"}], 2, 6)
    p = Passes(temperature=1.0, micro=4, share=False)
    kept, g_plain = _saved_bytes_and_grads(policy, ro, p, False)
    kept_ckpt, g_ckpt = _saved_bytes_and_grads(policy, ro, p, True)
    assert g_plain.keys() == g_ckpt.keys() and g_plain
    for n, g in g_plain.items():
        torch.testing.assert_close(g_ckpt[n], g, rtol=0, atol=0, msg=n)  # recomputed exactly
    assert kept_ckpt < 0.7 * kept  # the blocks' inner activations are not kept


def test_the_blocks_are_restored_and_a_cached_block_is_not_checkpointed(policy, tok):
    blocks = decoder_layers(policy)
    assert blocks and all("forward" not in vars(b) for b in blocks)
    with checkpointed_layers(policy):
        assert all("forward" in vars(b) for b in blocks)
        torch.manual_seed(0)
        ro = sample_groups(policy, tok, [{"prompt": "write about cats"}], 2, 4)  # KV-cache sampling, no grad
    assert all("forward" not in vars(b) for b in blocks)
    # shared prompts: the continuation's blocks get the prompt's KV cache, so they run as they are
    p = Passes(temperature=1.0, micro=2, share=True)
    with checkpointed_layers(policy):
        lp, _ = p.token_logps(policy, ro, slice(0, 2), None)
    torch.testing.assert_close(lp, p.token_logps(policy, ro, slice(0, 2), None)[0])
