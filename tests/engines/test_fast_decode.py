"""The lean GPT-2 decode step (datc.engines.fast_decode) against the model's own forward, and where it declines."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from datc.batch import encode_prompts, position_ids
from datc.engines.fast_decode import lean_decoder
from datc.models.build import build_causal_lm
from tests.helpers.testbed import ARCHS

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

