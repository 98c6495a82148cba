"""The lean GPT-2 forwards (datc.lean_gpt2) against the models' own forward, and where they decline."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from datc.lean_gpt2 import gpt2_rm_score, lean_decoder, lean_rm
from datc.models import build_causal_lm, build_reward_model
from datc.rewards.model import build_rm_inputs, rm_forward
from datc.rollout import encode_prompts, position_ids
from tests.conftest import ARCHS

PROMPTS = {
    "padded": [{"prompt": "write about music :"}, {"prompt": "write about the ocean and the city :"}, {"prompt": "hi"}],
    "unpadded": [{"prompt": "write about music"}, {"prompt": "write about cats"}],
}


def gpt2(tok, **config):
    model = build_causal_lm(ARCHS["gpt2"], tok, 0).eval()
    for k, v in config.items():
        setattr(model.config, k, v)
    return model


def prefill(model, ids, mask):
    cache = DynamicCache()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask), use_cache=True,
                    cache=cache, logits_to_keep=1)
    return out, cache


@pytest.mark.parametrize("which", sorted(PROMPTS))
def test_lean_decode_steps_are_the_models_forward_bit_for_bit(tok, which):
    model = gpt2(tok)
    ids, mask = encode_prompts(tok, PROMPTS[which], "prompt", torch.device("cpu"))
    assert bool(mask.all()) == (which == "unpadded")
    _, cache = prefill(model, ids, mask)
    _, lean_cache = prefill(model, ids, mask)
    lean = lean_decoder(model, lean_cache, mask)
    assert lean is not None
    am, pos = mask.long(), position_ids(mask)[:, -1:] + 1
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(5):
            nxt = torch.randint(3, len(tok), (ids.shape[0],), generator=gen)
            am = torch.cat([am, am.new_ones(ids.shape[0], 1)], 1)
            want = model(input_ids=nxt[:, None], attention_mask=am, position_ids=pos, use_cache=True, cache=cache).logits
            got = lean(nxt, pos)
            assert got.shape == (ids.shape[0], len(tok))
            assert torch.equal(got, want[:, -1])
            pos = pos + 1


def test_lean_decoder_declines_what_it_does_not_mirror(tok):
    ids, mask = encode_prompts(tok, PROMPTS["padded"], "prompt", torch.device("cpu"))

    def decoder(model):
        return lean_decoder(model, prefill(model, ids, mask)[1], mask)

    assert decoder(gpt2(tok)) is not None
    assert decoder(build_causal_lm(ARCHS["llama"], tok, 0).eval()) is None  # another architecture
    assert decoder(gpt2(tok, _attn_implementation="eager")) is None  # eager attention
    hooked = gpt2(tok)
    handle = hooked.transformer.h[1].mlp.register_forward_hook(lambda m, i, o: o * 2)  # e.g. DeepSpeed, adapters
    assert decoder(hooked) is None
    handle.remove()
    model = gpt2(tok)
    cache = prefill(model, ids, mask)[1]
    assert lean_decoder(model.train(), cache, mask) is None  # dropout would be on
    assert lean_decoder(model.eval(), cache, mask[:, 1:]) is None  # the cache does not match the mask



def rm_batch(tok, which):
    """Left-padded reward-model inputs of the prompts ``which`` with right-padded responses of
    different lengths, as the trainer builds them."""
    ids, mask = encode_prompts(tok, PROMPTS[which], "prompt", torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    resp = torch.randint(3, len(tok), (ids.shape[0], 5), generator=gen)
    rmask = torch.ones_like(resp, dtype=torch.bool)
    if which == "padded":
        rmask[0, 3:] = False
        rmask[1, 1:] = False
    return build_rm_inputs(ids, mask, resp, rmask, tok.pad_token_id)


@pytest.mark.parametrize("which", sorted(PROMPTS))
def test_lean_rm_score_and_its_input_gradient_are_the_models(tok, which):
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # training mode computes the same
    rm = build_reward_model({**ARCHS["gpt2"], **no_dropout}, tok, 0).eval()
    assert lean_rm(rm)
    inp = rm_batch(tok, which)
    assert bool(inp.attention_mask.all()) == (which == "unpadded")
    pos = position_ids(inp.attention_mask)

    def score_and_grad(f):
        h = rm.get_input_embeddings()(inp.input_ids).detach().requires_grad_(True)
        s = f(h)
        return s.detach(), torch.autograd.grad(s.sum(), h)[0]

    want, want_g = score_and_grad(lambda h: rm(inputs_embeds=h, attention_mask=inp.attention_mask.long(),
                                               position_ids=pos).logits)
    got, got_g = score_and_grad(lambda h: gpt2_rm_score(rm, h, inp.attention_mask, pos))
    assert got.shape == want.shape == (inp.input_ids.shape[0], 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_g, want_g, rtol=1e-4, atol=1e-6)
    assert want_g.abs().sum() > 0
    h = rm.get_input_embeddings()(inp.input_ids)
    with torch.no_grad():  # rm_forward takes the lean path in eval mode, the model's forward in training mode
        assert torch.equal(rm_forward(rm, h, inp.attention_mask), got[:, 0])
        rm.train()
        assert not lean_rm(rm)
        torch.testing.assert_close(rm_forward(rm, h, inp.attention_mask), want[:, 0], rtol=0, atol=0)


def test_lean_rm_declines_what_it_does_not_mirror(tok):
    assert lean_rm(build_reward_model(ARCHS["gpt2"], tok, 0).eval())
    assert not lean_rm(build_reward_model(ARCHS["llama"], tok, 0).eval())
    eager = build_reward_model(ARCHS["gpt2"], tok, 0).eval()
    eager.config._attn_implementation = "eager"
    assert not lean_rm(eager)
    hooked = build_reward_model(ARCHS["gpt2"], tok, 0).eval()
    hooked.transformer.ln_f.register_forward_pre_hook(lambda m, i: None)
    assert not lean_rm(hooked)
