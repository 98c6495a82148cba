"""The static-cache decode step (datc.engines.static_decode) against the dynamic-cache loop of
datc.engines.generate.sample_tokens, on both testbed families: the same sampled ids for the same random
stream and the same logits to float rounding, with kept logits, min_new_tokens, top-p,
temperature, shared prompts and EOS early stop; the run loop's bookkeeping when the step is
replayed (a CPU stand-in for the CUDA graph: the same Python step, called again); and where it
falls back to the dynamic loop. A training step decoding statically gives the dynamic step's
metrics: tests/step/test_performance_switches.py."""

from __future__ import annotations

import logging

import pytest
import torch

from datc.batch import encode_prompts
from datc.engines import static_decode
from datc.engines.generate import prefill, sample_groups, sample_tokens
from datc.engines.sampling import sample_categorical
from datc.engines.static_decode import WARMUP_STEPS, decode_mode, static_decoder, static_reason

ROWS = [{"prompt": "write about music :"}, {"prompt": "write about the ocean and the city :"}, {"prompt": "hi"}]
G = 4  # responses per prompt
# The static step attends over the whole pre-allocated cache with the positions past the
# current one masked: the attention's sums run over other blocks than over the dynamic cache's
# keys, so a logit may differ in its last bits. Bound: 8 float32 ulps of the largest logit
# (observed at most 2 on both families).
ULPS = 8


def _prompts(tok):
    ids, mask = encode_prompts(tok, ROWS, "prompt", torch.device("cpu"))
    return ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)


def _both(policy, tok, T, seed=0, **kw):
    """(ids, logits, the next random number) of the dynamic loop and of the static step, from one seed."""
    ids, mask = _prompts(tok)
    out = {}
    for decode in ("dynamic", "static"):
        torch.manual_seed(seed)
        r = sample_tokens(policy, ids, mask, T, kw.get("temperature", 1.0), kw.get("top_p", 1.0), tok.eos_token_id,
                          tok.pad_token_id,
                          min_new_tokens=kw.get("min_new_tokens", 0), keep_logits=True,
                          prompt_repeats=kw.get("prompt_repeats", 1), decode=decode,
                          sync_every=kw.get("sync_every", 1))
        out[decode] = (*r, torch.rand(1))
    return out["dynamic"], out["static"]


def _close(la, lb):
    bound = ULPS * torch.finfo(torch.float32).eps * float(la.abs().max())
    assert la.shape == lb.shape and float((la - lb).abs().max()) <= bound


def _assert_same(dyn, sta):
    (a, la, ra), (b, lb, rb) = dyn, sta
    assert torch.equal(a, b)
    assert la.shape == (*a.shape, la.shape[-1])
    _close(la, lb)
    return ra, rb


CASES = {
    "plain": {},
    "min_new_tokens": {"min_new_tokens": 5},
    "top_p_temperature": {"top_p": 0.8, "temperature": 0.7},
    "shared_prompts": {"prompt_repeats": G},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_static_step_samples_the_dynamic_loops_ids_and_logits(policy, tok, case):
    dyn, sta = _both(policy, tok, 10, **CASES[case])
    ra, rb = _assert_same(dyn, sta)
    # checking every step, the static step draws exactly the dynamic loop's random numbers
    assert torch.equal(ra, rb)


@pytest.fixture
def eos_prone(policy, tok):
    """The policy with EOS's logit raised by 4.4 (p(EOS) about 0.3 a token): rows end at
    different steps, and all of them well before a 30-token budget."""
    bias = torch.zeros(len(tok))
    bias[tok.eos_token_id] = 4.4
    handle = policy.get_output_embeddings().register_forward_hook(lambda m, i, o: o + bias)
    yield policy
    handle.remove()


@pytest.mark.parametrize("sync_every", [1, 3, 100])
def test_eos_early_stop_gives_the_dynamic_loops_lengths(eos_prone, tok, sync_every):
    T = 30
    dyn, sta = _both(eos_prone, tok, T, seed=1, min_new_tokens=2, sync_every=sync_every)
    _assert_same(dyn, sta)
    ids = dyn[0]
    ended = (ids == tok.eos_token_id).any(1)
    assert ids.shape[1] < T and ended.all()  # every row stopped, so the call stopped early
    first = (ids == tok.eos_token_id).float().argmax(1)
    assert len(set(first.tolist())) > 1 and (first >= 2).all()  # at different steps, none before min_new_tokens
    assert (ids[:, -1] == tok.eos_token_id).any()  # the call ends at the last row's EOS


def test_sample_groups_gives_the_same_rollout_either_way(eos_prone, tok):
    out = {}
    for decode in ("dynamic", "static"):
        torch.manual_seed(3)
        out[decode] = sample_groups(eos_prone, tok, ROWS, G, 12, temperature=0.9, keep_logits=True, decode=decode,
                                    sync_every=4)
    a, b = out["dynamic"], out["static"]
    for f in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "truncated"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert a.logits.shape == (len(ROWS) * G, 12, len(tok))
    _close(a.logits, b.logits)


def _decoder(policy, tok, T, **kw):
    ids, mask = _prompts(tok)
    pf = prefill(policy, ids, mask)
    return static_decoder(policy, pf.cache, mask, pf.logits, pf.next_pos, T, temperature=1.0, top_p=1.0,
                          eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, min_new_tokens=kw.get("min_new_tokens", 0),
                          keep_logits=True, synced_gpus=False)


@pytest.mark.parametrize("sync_every", [1, 4])
def test_a_replayed_step_continues_where_the_warmup_left(eos_prone, tok, sync_every):
    """The run loop with a graph: the capture runs the first WARMUP_STEPS steps and hands back a
    replay, here the same Python step called again (what a CUDA graph replays), so the tokens,
    logits and lengths equal the eager run's, and the replay runs the remaining steps only."""
    calls = {"warmup": 0, "replays": 0}

    def capture(step, warmup):
        for _ in range(warmup):
            step()
            calls["warmup"] += 1

        def replay():
            calls["replays"] += 1
            step()
        return replay

    T = 30
    runs = []
    for graph in (False, True):
        torch.manual_seed(5)
        dec = _decoder(eos_prone, tok, T, min_new_tokens=2)
        runs.append(dec.run(sync_every, graph=graph, capture=capture))
        assert dec.captured == graph
    (a, la), (b, lb) = runs
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert calls["warmup"] == WARMUP_STEPS
    n = a.shape[1]  # steps with a forward: to the last EOS, rounded up to the next check
    assert n < T and calls["replays"] == -(-n // sync_every) * sync_every - WARMUP_STEPS


def test_a_failed_capture_leaves_the_eager_step(policy, tok):
    torch.manual_seed(0)
    want = _decoder(policy, tok, 8).run(8, graph=False)
    torch.manual_seed(0)
    dec = _decoder(policy, tok, 8)
    got = dec.run(8, graph=True, capture=lambda step, warmup: [step() for _ in range(warmup)] and None)
    assert not dec.captured and torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_the_sync_free_draw_is_the_checked_draw():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(64, 50) * 3, -1)
    p[::3, 40:] = 0.0  # trailing zeros (banned tokens, top-p) on some rows
    p[1::3, :5] = 0.0
    p = p / p.sum(-1, keepdim=True)
    torch.manual_seed(1)
    a = torch.stack([sample_categorical(p) for _ in range(50)])
    torch.manual_seed(1)
    b = torch.stack([sample_categorical(p, sync_free=True) for _ in range(50)])
    assert torch.equal(a, b)


def test_the_sync_free_draw_falls_back_to_the_last_positive_token(monkeypatch):
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(*a, dtype=k.get("dtype")))  # u = total
    assert sample_categorical(p, sync_free=True).tolist() == [1, 3]


def test_decode_mode_resolves_auto_by_device_and_synced_ranks():
    assert decode_mode("auto", cuda=True, synced_gpus=False) == "static"
    assert decode_mode("auto", cuda=False, synced_gpus=False) == "dynamic"
    assert decode_mode("static", cuda=False, synced_gpus=False) == "static"
    assert decode_mode("dynamic", cuda=True, synced_gpus=False) == "dynamic"
    assert decode_mode("auto", cuda=True, synced_gpus=True) == "dynamic"
    with pytest.raises(ValueError, match="auto, dynamic, static"):
        decode_mode("graph", cuda=True, synced_gpus=False)


def test_models_it_cannot_take_decode_dynamically_after_one_log_line(policy, tok, caplog, monkeypatch):
    monkeypatch.setattr(static_decode, "_said", set())
    ids, mask = _prompts(tok)
    torch.manual_seed(0)
    want = sample_tokens(policy, ids, mask, 6, 1.0, 1.0, tok.eos_token_id, tok.pad_token_id, keep_logits=True)
    assert static_reason(policy) is None
    assert "synced_gpus" in static_reason(policy, synced_gpus=True)
    policy._can_compile_fullgraph = False  # a model class without static-cache support
    assert "declares no static-cache support" in static_reason(policy)
    with caplog.at_level(logging.INFO, logger="datc.engines.static_decode"):
        for _ in range(2):
            torch.manual_seed(0)
            got = sample_tokens(policy, ids, mask, 6, 1.0, 1.0, tok.eos_token_id, tok.pad_token_id, keep_logits=True,
                                decode="static")
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # the dynamic loop, bit for bit
    lines = [r.getMessage() for r in caplog.records if r.name == "datc.engines.static_decode"]
    assert len(lines) == 1 and "declares no static-cache support" in lines[0]
    del policy._can_compile_fullgraph
    next(policy.parameters()).ds_id = 0  # a ZeRO-3 partitioned parameter
    assert "partitioned" in static_reason(policy)


def test_a_sliding_window_model_decodes_dynamically_after_one_log_line(tok, caplog, monkeypatch):
    from datc.models.build import build_causal_lm

    monkeypatch.setattr(static_decode, "_said", set())
    arch = dict(model_type="qwen3", num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=32,
                intermediate_size=64, head_dim=16, max_position_embeddings=64, use_sliding_window=True, sliding_window=4,
                max_window_layers=1)
    policy = build_causal_lm(arch, tok, 0).eval()
    assert policy.config.layer_types == ["full_attention", "sliding_attention"] and static_reason(policy) is None
    ids, mask = _prompts(tok)
    out = []
    with caplog.at_level(logging.INFO, logger="datc.engines.static_decode"):
        for decode in ("dynamic", "static"):
            torch.manual_seed(0)
            out.append(sample_tokens(policy, ids, mask, 6, 1.0, 1.0, tok.eos_token_id, tok.pad_token_id, keep_logits=True,
                                     decode=decode))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    lines = [r.getMessage() for r in caplog.records if r.name == "datc.engines.static_decode"]
    assert len(lines) == 1 and "sliding window" in lines[0]
