"""The ``reviews`` task: AFINN gold and its exact per-token attribution on byte-level BPE token
strings (hand-made here; the real SmolLM2 tokenizer's splits are in tests/models/test_real_model.py),
held-out subjects, and the reward model's frozen-bottom training path."""

from __future__ import annotations

import random

import pytest
import torch
from afinn import Afinn
from transformers.convert_slow_tokenizer import bytes_to_unicode

from datc.prepare.testbed import _FrozenBottom, _rm_batch_scores, top_layers_view
from datc.tasks import TASKS, gold_contributions
from datc.tasks.reviews import (
    EVAL_SUBJECTS,
    NEGATIVE_WORDS,
    NEUTRAL_WORDS,
    POSITIVE_WORDS,
    TRAIN_SUBJECTS,
    text_and_owners,
    valence_contributions,
)

_B2U = bytes_to_unicode()


def bpe(*pieces: str) -> list[str]:
    """Token strings as a byte-level BPE tokenizer writes them (" x" -> "Ġx")."""
    return ["".join(_B2U[b] for b in p.encode()) for p in pieces]


def test_byte_level_strings_are_what_the_helper_writes():
    assert bpe(" wonderful", "\n", "é") == ["Ġwonderful", "Ċ", "Ã©"]


@pytest.mark.parametrize(("pieces", "expected"), [
    # one token per word, leading-space tokens: each word's valence lands on its token
    ((" The", " food", " was", " wonderful", ","), [0, 0, 0, 4, 0]),
    # a word split over three tokens shares its valence (wonderful = +4) three ways; case is ignored
    ((" WON", "DER", "ful", "!"), [4 / 3, 4 / 3, 4 / 3, 0]),
    # punctuation glued to a word is not part of it; "bad" = -3
    (("bad", "!!"), [-3, 0]),
    # a phrase entry ("not good" = -2) is matched before its words and shared by its tokens;
    # a token of spaces only inside it gets none
    ((" not", "  ", " good"), [-1, 0, -1]),
    # a hyphenated entry (self-deluded = -2) over four tokens, the hyphen's token included
    (("self", "-", "del", "uded"), [-0.5, -0.5, -0.5, -0.5]),
    # a word inside a longer word is not matched ("goodness" is its own entry = +3, "good" is not in it)
    ((" goodness",), [3]),
    # non-ASCII letters are letters: "happyé" is one word, not "happy" (AFINN reads decoded text)
    ((" happy", "é"), [0, 0]),
    ((" happy", " é"), [3, 0]),
])
def test_per_token_contributions_by_hand(pieces, expected):
    assert valence_contributions(bpe(*pieces)) == pytest.approx(expected)


def test_split_character_goes_to_the_completing_token():
    # "é" is 0xC3 0xA9; with its two bytes in two tokens it is one character of the second
    text, owners = text_and_owners(["Ġcaf", "Ã", "©", "Ġgood"])
    assert text == " café good" and owners == [0, 0, 0, 0, 2, 3, 3, 3, 3, 3]
    assert valence_contributions(["Ġcaf", "Ã", "©", "Ġgood"]) == pytest.approx([0, 0, 0, 3])


def test_special_tokens_are_not_text_and_separate_words():
    # "<|im_end|>" is never read as text; "good" on both sides of it are two words
    assert valence_contributions(["good", "<|im_end|>", "good"]) == pytest.approx([3, 0, 3])
    # a special token whose name holds a lexicon word ("empty" = -1) scores nothing
    assert valence_contributions(["<empty_output>"]) == [0.0]


def test_contributions_sum_to_afinn_on_random_splits():
    """Any split of ASCII text into tokens gives per-token shares that sum to AFINN's score."""
    rng = random.Random(0)
    words = "I love this great place but the service was not good and the food terrible , self-deluded staff !".split()
    afinn = Afinn()
    for _ in range(200):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 20)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert sum(valence_contributions(bpe(*pieces))) == pytest.approx(afinn.score(text)), text


def test_task_scales_and_stops_at_the_end_token():
    task = TASKS.get("reviews")(10)
    toks = bpe(" great", " day") + ["<|im_end|>"] + bpe(" awful")
    # great = +3, scale 10; nothing counts after the end of turn
    assert gold_contributions(task, {}, toks) == pytest.approx([0.3, 0, 0, 0])


def test_eval_prompts_ask_about_held_out_subjects():
    task = TASKS.get("reviews")(10)
    rng = random.Random(0)
    train = {task.make_split_example(rng, "train")["subject"] for _ in range(500)}
    evals = {task.make_split_example(rng, "eval")["subject"] for _ in range(500)}
    assert train <= set(TRAIN_SUBJECTS) and evals <= set(EVAL_SUBJECTS)
    assert not train & evals and len(evals) == len(EVAL_SUBJECTS)


def test_edits_swap_whole_words_and_keep_the_end_token():
    task = TASKS.get("reviews")(10)
    # Whole words at 0, 1, 2 and 5; " tid" + "y" is one word in two pieces (never edited), "." no
    # word. No word here is in the edit lists, so every swap shows as a changed token.
    toks = bpe(" The", " lobby", " seemed", " tid", "y", " okay", ".") + ["<|im_end|>"]
    kinds = {"Ġ" + w: k for k, ws in (("pos", POSITIVE_WORDS), ("neg", NEGATIVE_WORDS), ("neu", NEUTRAL_WORDS))
             for w in ws}
    assert not kinds.keys() & set(toks)
    counts, drawn = set(), set()
    for seed in range(40):
        out = task.edit({}, toks, random.Random(seed))
        assert len(out) == len(toks) and out[-1] == "<|im_end|>"
        changed = [i for i, (a, b) in enumerate(zip(out, toks, strict=True)) if a != b]
        assert set(changed) <= {0, 1, 2, 5} and out[3:5] == toks[3:5] and out[6] == "."
        assert all(out[i] in kinds for i in changed)
        counts.add(len(changed))
        drawn |= {kinds[out[i]] for i in changed}
    assert counts == {1, 2, 3} and drawn == {"pos", "neg", "neu"}  # one to three swaps, from every list
    # fewer whole words than the draw: each is swapped at most once; none: nothing changes
    out = task.edit({}, bpe(" lobby", ".") + ["<|im_end|>"], random.Random(0))
    assert out[0] in kinds and out[1:] == [".", "<|im_end|>"]
    assert task.edit({}, bpe("y", ".") + ["<|im_end|>"], random.Random(0)) == bpe("y", ".") + ["<|im_end|>"]


def test_top_layers_view_computes_the_whole_models_score(tok):
    from datc.models.build import build_reward_model

    arch = dict(model_type="llama", num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    rm = build_reward_model(arch, tok, 0).eval()
    top = top_layers_view(rm, 1)
    assert len(rm.model.layers) == 3 and len(top.model.layers) == 1  # the original is untouched
    examples = [{"prompt": "write about music :"}, {"prompt": "compute 1 plus 2 ="}]
    responses = [tok.convert_tokens_to_ids("song the ball <eos>".split()), tok.convert_tokens_to_ids(["3"])]
    pool = [(examples[0], [responses[0]], torch.zeros(1)), (examples[1], [responses[1]], torch.zeros(1))]
    frozen = _FrozenBottom(rm, 1, tok, 8)
    frozen.fill(pool)
    with torch.no_grad():
        full = _rm_batch_scores(rm, tok, examples, responses, 8)
        cached = frozen.scores([(0, 0), (1, 0)])
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
    trainable = {n for n, p in rm.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("model.layers.2.", "model.norm", "score")) for n in trainable)


def test_the_shared_prompt_training_step_equals_the_unshared_one(tok):
    """``reward.train.share_prompts``: the cached lower blocks' output (each prompt once) and the
    training step's scores, loss and gradients (each prompt through the top blocks once, its KV
    cache repeated for its responses) are the unshared path's up to float rounding."""
    from datc.models.build import build_reward_model

    arch = dict(model_type="llama", num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    examples = [{"prompt": "write about music :"}, {"prompt": "compute 1 plus 2 ="}, {"prompt": "write :"}]
    words = ["song the ball <eos>", "3", "the ball song song the <eos>", "ball", "music the"]
    resp = [tok.convert_tokens_to_ids(w.split()) for w in words]
    pool = [(ex, resp[g:] + resp[:g], torch.arange(5.0) * (g + 1)) for g, ex in enumerate(examples)]
    keys = [(2, j) for j in (0, 1, 1, 4)] + [(0, j) for j in (3, 2, 0, 1)]  # 2 prompts x 4, one response twice
    gold = torch.cat([pool[g][2][j : j + 1] for g, j in keys])
    out = {}
    for share in (False, True):
        rm = build_reward_model(arch, tok, 0).train()
        frozen = _FrozenBottom(rm, 2, tok, 8, share=share)
        frozen.fill(pool, batch=4)  # batches across groups
        pred = frozen.scores(keys)
        dev = pred.view(2, 4) - pred.view(2, 4).mean(1, keepdim=True)
        loss = torch.nn.functional.mse_loss(pred, gold) + 4.0 * dev.square().mean()
        loss.backward()
        cached = {k: torch.cat([frozen.prompts[k[0]], v]) if share else v for k, v in frozen.cache.items()}
        out[share] = (pred.detach(), loss.detach(), {n: p.grad for n, p in rm.named_parameters() if p.requires_grad}, cached)
        assert [blk.self_attn.layer_idx for blk in rm.model.layers] == [0, 1, 2, 3]  # restored after the step
    (p0, l0, g0, c0), (p1, l1, g1, c1) = out[False], out[True]
    assert c0.keys() == c1.keys() and len(c0) == 15
    for k in c0:
        torch.testing.assert_close(c1[k], c0[k], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p1, p0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and any(n.startswith("model.layers.2.") for n in g0)
    for n in g0:
        assert g0[n].abs().max() > 0
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6)
