"""Shared prompt forwards (``trainer.share_prompts``, :mod:`datc.models.shared_prompt`): each distinct
prompt goes through the model once and its KV cache serves its group's responses. The results
are the plain forward's, position for position, with and without gradients, for the policy's
log-probs, its hidden states, the reward model's scores and input gradients, and the rollout's
prefill; and the prompt work is done once per distinct prompt."""

from __future__ import annotations

import pytest
import torch

from datc.engines.generate import sample_tokens
from datc.forward.passes import policy_forward, rollout_policy_pass
from datc.models.rm_inputs import build_rm_inputs
from datc.models.shared_prompt import prompt_groups
from datc.rewards.model import score
from tests.helpers.shared_prompt import G, N, P, T, forward_rows, grouped_rollout


def test_prompt_groups_are_the_distinct_prompts_ids_and_mask_alike():
    ids = torch.tensor([[0, 7, 8], [0, 7, 8], [1, 2, 3], [0, 7, 8], [0, 7, 8]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]]).bool()  # the last: a real token 0
    first, inverse = prompt_groups(ids, mask)
    assert len(first) == 3
    assert torch.equal(ids[first][inverse], ids) and torch.equal(mask[first][inverse], mask)
    assert inverse[0] == inverse[1] == inverse[3] and len({int(inverse[i]) for i in (0, 2, 4)}) == 3


@pytest.mark.parametrize("hidden", [False, True])
def test_policy_logits_and_hidden_states_are_the_plain_forwards(policy, tok, hidden):
    ro = grouped_rollout(len(tok))
    with torch.no_grad():
        plain, h_plain = policy_forward(policy, ro, slice(None), hidden=hidden, share=False)
        calls = forward_rows(policy)
        shared, h_shared = policy_forward(policy, ro, slice(None), hidden=hidden, share=True)
    assert calls == [N, N * G]  # the prompts once (N rows), then every row's continuation
    m = ro.response_mask
    torch.testing.assert_close(shared[m], plain[m], rtol=1e-5, atol=1e-5)
    if hidden:
        torch.testing.assert_close(h_shared[m], h_plain[m], rtol=1e-5, atol=1e-5)
    # any order of rows, and rows whose prompts are all distinct
    for rows in (torch.randperm(N * G, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 4, 7, 10])):
        with torch.no_grad():
            part = policy_forward(policy, ro, rows, share=True)[0]
        torch.testing.assert_close(part[m[rows]], plain[rows][m[rows]], rtol=1e-5, atol=1e-5)


def test_policy_gradients_are_the_plain_forwards(policy, tok):
    ro = grouped_rollout(len(tok))
    w = torch.randn(N * G, T, len(tok), generator=torch.Generator().manual_seed(2)) * ro.response_mask[..., None]
    grads = []
    for share in (False, True):
        policy.zero_grad(set_to_none=True)
        logp = torch.log_softmax(policy_forward(policy, ro, slice(None), share=share)[0], -1)
        (logp * w).sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(policy.parameters()))
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-4, atol=1e-5, msg=n)


def test_rollout_policy_pass_is_the_same_with_shared_prompts(policy, tok):
    ro = grouped_rollout(len(tok))
    a = rollout_policy_pass(policy, ro, 0.7, 4, True)
    b = rollout_policy_pass(policy, ro, 0.7, 4, True, share=False)
    m = ro.response_mask
    assert a.hidden is None and b.hidden is None  # not asked for
    for x, y in zip(a[:3], b[:3], strict=True):  # log-probs, entropies, logits
        torch.testing.assert_close(x[m], y[m], rtol=1e-5, atol=1e-5)


def test_reward_scores_and_input_gradients_are_the_plain_forwards(reward_model, tok):
    for p in reward_model.parameters():
        p.requires_grad_(False)
    ro = grouped_rollout(len(tok))
    inp = build_rm_inputs(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, tok.pad_token_id)
    assert inp.prefix_len == P
    plain = score(reward_model, inp, ro.response_mask, with_grad=True, share=False)
    calls = forward_rows(reward_model)
    shared = score(reward_model, inp, ro.response_mask, with_grad=True, share=True)
    assert calls == [N, N * G]
    torch.testing.assert_close(shared.scores, plain.scores, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared.grad, plain.grad, rtol=1e-4, atol=1e-5)
    assert shared.grad[~ro.response_mask].eq(0).all() and shared.grad[ro.response_mask].abs().sum(-1).gt(0).all()
    for i in range(N * G):  # and each is the score of the row alone, unpadded
        ids = torch.cat([ro.prompt_ids[i][ro.prompt_mask[i]], ro.response_ids[i][ro.response_mask[i]]])[None]
        torch.testing.assert_close(shared.scores[i], reward_model(input_ids=ids).logits[0, 0], rtol=1e-5, atol=1e-5)
    # no-grad scoring in chunks that split groups
    torch.testing.assert_close(score(reward_model, inp, ro.response_mask, batch_size=5).scores, plain.scores,
                               rtol=1e-5, atol=1e-5)


def test_the_prefill_is_shared_and_gives_the_same_logits(policy, tok):
    ro = grouped_rollout(len(tok))
    ids, mask = ro.prompt_ids, ro.prompt_mask
    torch.manual_seed(0)
    _, plain = sample_tokens(policy, ids, mask, 4, 1.0, 1.0, tok.eos_token_id, tok.pad_token_id, min_new_tokens=4,
                             keep_logits=True)
    calls = forward_rows(policy)
    torch.manual_seed(0)
    _, shared = sample_tokens(policy, ids, mask, 4, 1.0, 1.0, tok.eos_token_id, tok.pad_token_id, min_new_tokens=4,
                              keep_logits=True, prompt_repeats=G)
    assert calls[0] == N  # the prefill: each prompt once
    torch.testing.assert_close(shared[:, 0], plain[:, 0], rtol=1e-5, atol=1e-5)  # the first position: same prompts
    with pytest.raises(ValueError, match="runs of 2 identical prompts"):
        sample_tokens(policy, ids, mask, 2, 1.0, 1.0, tok.eos_token_id, tok.pad_token_id, prompt_repeats=2)


def test_the_gpt2_reward_models_lean_read_out_gives_the_same_scores_and_gradients(tok, monkeypatch):
    # the testbed's reward model (GPT-2, eval, SDPA): its last block runs at the read-out position only
    import datc.rewards.model as rm_mod
    from datc.engines.fast_decode import lean_rm_continuation
    from datc.models.build import build_reward_model
    from tests.helpers.testbed import ARCHS

    rm = build_reward_model({**ARCHS["gpt2"], "n_layer": 3}, tok, 0).eval()
    for p in rm.parameters():
        p.requires_grad_(False)
    used = []
    monkeypatch.setattr(rm_mod, "lean_rm_continuation", lambda m: used.append(1) or lean_rm_continuation(m))
    assert lean_rm_continuation(rm) is not None and lean_rm_continuation(rm.train()) is None
    rm.eval()
    ro = grouped_rollout(len(tok))
    inp = build_rm_inputs(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, tok.pad_token_id)
    plain = score(rm, inp, ro.response_mask, with_grad=True, share=False)
    lean = score(rm, inp, ro.response_mask, with_grad=True, share=True, batch_size=7)  # chunks that split groups
    assert used
    torch.testing.assert_close(lean.scores, plain.scores, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lean.grad, plain.grad, rtol=1e-4, atol=1e-6)
    assert lean.grad[ro.response_mask].abs().sum(-1).gt(0).all()
