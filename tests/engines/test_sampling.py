"""The rollout's own sampling loop (datc.engines.generate.sample_tokens) against transformers' generate."""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import TopPLogitsWarper

from datc.batch import encode_prompts
from datc.engines.generate import sample_categorical, sample_tokens, top_p_filter


def test_sample_categorical_draws_from_probs_and_never_a_zero_probability_token():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(3, 6), -1)
    p[1, 2] = 0.0
    p[1] /= p[1].sum()
    p[2] = 0.0
    p[2, 5] = 1.0
    n = 100_000
    x = sample_categorical(p.repeat(n, 1)).view(n, 3)
    emp = torch.stack([torch.bincount(x[:, i], minlength=6).float() / n for i in range(3)])
    # binomial standard error <= 0.5 / sqrt(n) = 0.0016; allow 4 of them
    assert (emp - p).abs().max() < 0.0064
    assert emp[1, 2] == 0 and emp[2, 5] == 1


def test_sample_categorical_falls_back_to_the_last_positive_token_when_u_rounds_to_the_total(monkeypatch):
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(*a, dtype=k.get("dtype")))  # u = total
    assert sample_categorical(p).tolist() == [1, 3]
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full(a, 0.6, dtype=k.get("dtype")))
    assert sample_categorical(p).tolist() == [1, 2]


def test_top_p_filter_is_transformers_top_p():
    torch.manual_seed(1)
    s = torch.randn(5, 40) * 3
    for top_p in (0.3, 0.8, 0.95):
        torch.testing.assert_close(top_p_filter(s, top_p), TopPLogitsWarper(top_p)(None, s.clone()))


def test_sampling_logits_are_generates_bit_for_bit(policy, tok):
    """Forced to the same tokens, the loop computes exactly the logits generate computes."""
    rows = [{"prompt": "write about music :"}, {"prompt": "write about the ocean and the city :"}]
    ids, mask = encode_prompts(tok, rows, "prompt", torch.device("cpu"))
    torch.manual_seed(0)
    resp, logits = sample_tokens(policy, ids, mask, 6, 1.0, 1.0, tok.eos_token_id, tok.pad_token_id, min_new_tokens=6,
                                 keep_logits=True)
    assert resp.shape == (2, 6) and (resp != tok.eos_token_id).all()

    class Replay:  # a logits processor that makes generate pick the loop's tokens
        def __init__(self):
            self.t = 0

        def __call__(self, input_ids, scores):
            out = torch.full_like(scores, -float("inf"))
            out[torch.arange(len(out)), resp[:, self.t]] = 0.0
            self.t += 1
            return out

    g = GenerationConfig(do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    out = policy.generate(input_ids=ids, attention_mask=mask.long(), generation_config=g, logits_processor=[Replay()],
                          output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences[:, ids.shape[1]:], resp)
    assert torch.equal(torch.stack(out.logits, 1), logits)


def test_finished_rows_get_padding_and_the_loop_stops_when_all_ended(policy, tok):
    rows = [{"prompt": "write about music :"}] * 4
    ids, mask = encode_prompts(tok, rows, "prompt", torch.device("cpu"))
    with torch.no_grad():  # make EOS overwhelmingly likely: every row ends at its first token
        policy.get_output_embeddings().weight[tok.eos_token_id] *= 0
        bias = torch.zeros(policy.get_output_embeddings().weight.shape[0])
        bias[tok.eos_token_id] = 1e4
    hook = policy.get_output_embeddings().register_forward_hook(lambda m, i, o: o + bias)
    try:
        resp, _ = sample_tokens(policy, ids, mask, 5, 1.0, 1.0, tok.eos_token_id, tok.pad_token_id)
    finally:
        hook.remove()
    assert resp.shape == (4, 1) and (resp == tok.eos_token_id).all()
