"""Pure helpers of scripts/bench.py (the comparison with TRL); none of them needs trl."""

from __future__ import annotations

import pytest
import torch

from datc.chat import PromptEncoder, RewardInputs
from datc.rewards.model import build_rm_inputs, score
from datc.rollout import encode_prompts, sample_groups
from scripts.bench import (
    PHASES,
    RMReward,
    block_summary,
    close,
    pad_completions,
    perturb_,
    rotated_order,
    spread,
    trl_prompt,
    unpadded,
)
from tests.test_chat import chat_tokenizer


def test_spread_of_a_few_figures():
    s = spread([3.0, 1.0, 2.0, 4.0, 5.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (3.0, 1.0, 5.0, 5)
    assert (s["q1"], s["q3"]) == (2.0, 4.0)  # inclusive quartiles of 1..5
    one = spread([2.5])
    assert one["median"] == one["q1"] == one["q3"] == 2.5


def test_block_summary_uses_totals_for_throughput_and_medians_for_phases():
    rows = [{"step_s": 0.1, "tokens": 100.0, **{f"{p}_s": 0.02 for p in PHASES}},
            {"step_s": 0.3, "tokens": 300.0, **{f"{p}_s": 0.04 for p in PHASES}}]
    b = block_summary(rows, batch_size=10)
    assert b["samples_per_s"] == pytest.approx(20 / 0.4)
    assert b["tokens_per_s"] == pytest.approx(400 / 0.4)
    assert b["step_s"] == pytest.approx(0.2)
    assert b["rollout_s"] == pytest.approx(0.03)
    assert b["other_s"] == pytest.approx(0.2 - 4 * 0.03)
    assert b["response_len"] == pytest.approx(20.0)


def test_rotated_order_puts_each_contestant_in_each_place():
    names = ("a", "b", "c")
    orders = [rotated_order(names, r) for r in range(6)]
    for pos in range(3):
        assert sorted(o[pos] for o in orders) == ["a", "a", "b", "b", "c", "c"]
    assert orders[0] == ["a", "b", "c"] and orders[3] == ["c", "b", "a"]


def test_pad_completions_right_pads_and_masks():
    ids, mask = pad_completions([[5, 6, 2], [7], [8, 2]], pad_id=0)
    assert ids.tolist() == [[5, 6, 2], [7, 0, 0], [8, 2, 0]]
    assert mask.tolist() == [[True, True, True], [True, False, False], [True, True, False]]


def test_close_is_relative_with_a_small_absolute_floor():
    assert close(1.0, 1.00005, 1e-4)
    assert not close(1.0, 1.001, 1e-4)
    assert close(0.0, 5e-8, 1e-4)
    assert not close(-0.0260, -0.0259, 1e-4)


def test_perturb_gives_two_copies_the_same_weights(policy):
    import copy

    other = copy.deepcopy(policy)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    perturb_(policy, 0.01, 3)
    perturb_(other, 0.01, 3)
    for (k, a), (_, b) in zip(policy.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())


def test_trl_reward_function_scores_what_the_trainer_scores(tok, policy, reward_model):
    """TRL hands the reward function prompt texts and completion id lists (up to and including
    EOS); the wrapper must give the scores this project's reward phase gives the same rollout."""
    torch.manual_seed(0)
    examples = [{"prompt": "write about music :"}, {"prompt": "write about the ocean and the city :"}]
    ro = sample_groups(policy, tok, examples, 3, 6)
    inp = build_rm_inputs(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, tok.pad_token_id)
    expected = score(reward_model, inp, ro.response_mask).scores
    lists = [ro.response_ids[i, : int(ro.response_mask[i].sum())].tolist() for i in range(len(ro.examples))]
    got = RMReward(reward_model, tok, 4)([ex["prompt"] for ex in ro.examples], None, lists)
    torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=1e-6)
    # the prompts are re-encoded exactly as the rollout encoded them (BOS, left padding)
    ids, _ = encode_prompts(tok, ro.examples, "prompt", torch.device("cpu"))
    assert torch.equal(ids, ro.prompt_ids)


def test_trl_reward_function_scores_chat_prompts_as_the_trainer_does(tmp_path):
    """With a chat template TRL hands the reward function each prompt as its messages; the
    wrapper renders them as the rollout did and splices the sampled ids after them."""
    from datc.models import build_causal_lm, build_reward_model
    from tests.conftest import ARCHS

    tok = chat_tokenizer(tmp_path, "chatml")
    policy = build_causal_lm(ARCHS["llama"], tok, 0).eval()
    rm = build_reward_model(ARCHS["llama"], tok, 1).eval()
    enc = PromptEncoder(tok, "prompt", "text", chat_template=True)
    torch.manual_seed(0)
    examples = [{"prompt": "write about music"}, {"prompt": "write about the ocean and the city"}]
    ro = sample_groups(policy, tok, examples, 2, 5, encoder=enc)
    expected = score(rm, RewardInputs(tok, enc)(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask,
                                                ro.examples), ro.response_mask).scores
    lists = [ro.response_ids[i, : int(ro.response_mask[i].sum())].tolist() for i in range(len(ro.examples))]
    prompts = [trl_prompt(enc, ex) for ex in ro.examples]
    assert prompts[0] == [{"role": "user", "content": "write about music"}]
    got = RMReward(rm, tok, 3, enc)(prompts, None, lists)
    torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=1e-6)
    # TRL renders the conversation with the same template and generation prompt
    trl_ids = tok.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert [list(x) for x in trl_ids] == unpadded(ro.prompt_ids, ro.prompt_mask)


def test_trl_prompt_is_the_text_without_a_chat_template(tok):
    enc = PromptEncoder(tok, "prompt", "text")
    assert trl_prompt(enc, {"prompt": "write about music :"}) == "write about music :"


def test_unpadded_drops_left_and_right_padding():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 0]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])
    assert unpadded(ids, mask) == [[5, 6], [7, 8, 9]]
