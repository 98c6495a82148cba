"""``trainer.lm_head_chunk``: the update's log-probs through the LM head a few positions at a time
(each chunk checkpointed, no (rows, T, V) logits held) equal the whole-logits path: values,
entropies and gradients, in float64 on hand-made tensors and on both testbed families. A training
step with it equals the whole-logits step: tests/step/test_performance_switches.py."""

from __future__ import annotations

import pytest
import torch

from datc.engines.generate import sample_groups
from datc.forward.passes import Passes
from datc.math.logprobs import chunked_head_logps, entropy_from_logits, selective_log_softmax
from datc.step.plan import head_chunk_for

F64 = torch.float64


@pytest.mark.parametrize("chunk", [1, 2, 5, 7])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_equals_the_whole_logits_in_float64(chunk, temperature):
    g = torch.Generator().manual_seed(0)
    B, T, d, V = 3, 7, 4, 11
    head = torch.nn.Linear(d, V, bias=False).to(F64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, d, generator=g, dtype=F64))
    h = torch.randn(B, T, d, generator=g, dtype=F64, requires_grad=True)
    idx = torch.randint(V, (B, T), generator=g)
    w = torch.randn(B, T, generator=g, dtype=F64)

    z = head(h) / temperature
    full, full_ent = selective_log_softmax(z.to(F64), idx), entropy_from_logits(z.detach())
    gh_full, gw_full = torch.autograd.grad((full * w).sum(), (h, head.weight))

    lp, ent = chunked_head_logps(lambda x: head(x).to(F64), h, idx, temperature, chunk)
    gh, gw = torch.autograd.grad((lp * w).sum(), (h, head.weight))
    assert not ent.requires_grad and lp.requires_grad
    torch.testing.assert_close(lp, full.float(), rtol=1e-6, atol=1e-6)  # the chunk's log-softmax is float32
    torch.testing.assert_close(ent, full_ent, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, gh_full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, gw_full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("share", [False, True])
def test_token_logps_of_a_policy_equal_the_whole_logits_path(policy, tok, share):
    torch.manual_seed(0)
    ro = sample_groups(policy, tok, [{"prompt": "write about cats"}, {"prompt": "the sun and the sea"}], 3, 6)
    p = Passes(temperature=0.8, micro=6, share=share)
    rows = slice(0, 6)
    mask = ro.response_mask.float()
    whole, whole_ent = p.token_logps(policy, ro, rows, None)
    g_whole = torch.autograd.grad((whole * mask).sum(), list(policy.parameters()), allow_unused=True)
    chunked, ent = p.token_logps(policy, ro, rows, 4)
    g_chunked = torch.autograd.grad((chunked * mask).sum(), list(policy.parameters()), allow_unused=True)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, whole_ent, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_chunked, g_whole, strict=True):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_plan_turns_the_chunk_off_where_the_update_cannot_apply_the_head(policy):
    assert head_chunk_for(None, policy) == (None, None)
    assert head_chunk_for(16, policy) == (16, None)  # gpt2 and llama: logits = lm_head(hidden)
    policy.config.model_type = "gemma2"  # soft-capped logits
    chunk, why = head_chunk_for(16, policy)
    assert chunk is None and "gemma2" in why
