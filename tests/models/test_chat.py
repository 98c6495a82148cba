"""Chat templates and the paper presets on local stand-ins: the policy's template for
generation, the reward model's own for scoring, each response token's exact position in the
reward model's input, HH dialogues, long-prompt dropping, and a few DATC steps of each
family's preset on tiny random Qwen3 / Llama models saved locally and loaded through the
presets' code path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from datc.checks import validate
from datc.config import ConfigError
from datc.models.build import build_causal_lm, build_reward_model
from datc.models.chat import (
    PromptEncoder,
    RewardInputs,
    hh_messages,
    hh_prompt_text,
    splice_rm_inputs,
    template_parts,
)
from datc.paths import CONFIG_DIR
from tests.helpers.chat import chat_tokenizer
from tests.helpers.chat_formats import FORMATS

ROOT = Path(__file__).resolve().parents[2]



def test_hh_dialogue_becomes_messages_without_the_last_answer():
    text = "\n\nHuman: hi there\n\nAssistant: hello\n\nHuman: tell me more\n\nAssistant: no"
    assert hh_messages(text) == [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"},
                                 {"role": "user", "content": "tell me more"}]
    assert hh_prompt_text(text) == "\n\nHuman: hi there\n\nAssistant: hello\n\nHuman: tell me more\n\nAssistant:"
    with pytest.raises(ValueError):
        hh_messages("no dialogue here")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_policy_prompt_is_the_chat_template_with_generation_prompt(tmp_path, fmt):
    tok = chat_tokenizer(tmp_path, fmt)
    enc = PromptEncoder(tok, "prompt", "text", chat_template=True)
    ids = enc.ids({"prompt": "write about cats"})
    want = tok(tok.apply_chat_template([{"role": "user", "content": "write about cats"}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids == want
    batch, mask = enc.encode([{"prompt": "write about cats"}, {"prompt": "cats"}], None)
    assert batch[0].tolist() == ids and mask[0].all()  # the longest row fills the width
    assert batch[1, -len(enc.ids({"prompt": "cats"})):].tolist() == enc.ids({"prompt": "cats"})  # left padding
    assert not mask[1, : batch.shape[1] - len(enc.ids({"prompt": "cats"}))].any()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_response_positions_in_the_reward_models_template_are_exact(tmp_path, fmt):
    tok = chat_tokenizer(tmp_path, fmt)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    words = tok(["cats dogs fish", "the sun"], add_special_tokens=False)["input_ids"]
    T = 6
    # row 0: three words + EOS; row 1: truncated (no EOS, fills the budget); row 2: EOS only
    rows = [words[0] + [eos], (words[1] * 3)[:T], [eos]]
    resp = torch.full((3, T), pad)
    mask = torch.zeros((3, T), dtype=torch.bool)
    for i, r in enumerate(rows):
        resp[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    examples = [{"prompt": "write about cats"}, {"prompt": "the sun"}, {"prompt": "hi"}]
    enc = PromptEncoder(tok, "prompt", "text", chat_template=True)
    inp = RewardInputs(tok, enc, chat_template=True)(None, None, resp, mask, examples)

    for i, ex in enumerate(examples):
        msgs = [{"role": "user", "content": ex["prompt"]}]
        prefix, suffix = template_parts(tok, msgs)
        content = rows[i][:-1] if rows[i][-1] == eos else rows[i]
        valid = inp.input_ids[i][inp.attention_mask[i]].tolist()
        # the reward model reads its own template around the sampled ids, nothing re-tokenized ...
        assert valid == prefix + content + suffix
        # ... which, for this word-level vocabulary, is exactly its template of the decoded text
        text = tok.apply_chat_template([*msgs, {"role": "assistant", "content": tok.decode(content)}], tokenize=False)
        assert valid == tok(text, add_special_tokens=False)["input_ids"]
        # every content token sits at its position; the EOS sits on the suffix's end-of-turn token
        for t, y in enumerate(rows[i]):
            assert inp.mapped[i, t]
            assert inp.input_ids[i, inp.response_pos[i, t]] == y
        assert not inp.mapped[i, len(rows[i]):].any()
        first = int(inp.response_pos[i, 0])
        if content:  # the valid token before the answer ends the template's assistant header
            assert inp.input_ids[i, :first][inp.attention_mask[i, :first]][-1] == prefix[-1]
            # the prefix block holds the template's prefix and nothing else (shared by a group)
            P = inp.prefix_len
            assert inp.input_ids[i, :P][inp.attention_mask[i, :P]].tolist() == prefix
            assert inp.input_ids[i, inp.response_pos[i, len(content) - 1] + 1] == suffix[0]
    assert tok.convert_ids_to_tokens(suffix[0]) == tok.eos_token  # same-family templates end turns with EOS


def test_an_eos_the_template_does_not_end_with_gets_no_position():
    # suffix starts with another token: the policy's EOS is not spliced and gets no gradient
    resp = torch.tensor([[5, 6, 2]])
    mask = torch.ones_like(resp, dtype=torch.bool)
    inp = splice_rm_inputs([[1, 9]], [[7, 8]], resp, mask, eos_id=2, pad_id=0)
    assert inp.input_ids.tolist() == [[1, 9, 5, 6, 7, 8]]
    assert inp.mapped.tolist() == [[True, True, False]]
    assert inp.response_pos[0, :2].tolist() == [2, 3]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_rm_gradient_is_read_at_the_spliced_positions(tmp_path, fmt):
    from datc.rewards.model import score

    tok = chat_tokenizer(tmp_path, fmt)
    arch = dict(model_type="llama", num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                intermediate_size=32, max_position_embeddings=128)
    rm = build_reward_model(arch, tok, 0).eval()
    ids = tok(["cats dogs"], add_special_tokens=False)["input_ids"][0] + [tok.eos_token_id]
    resp, mask = torch.tensor([ids + [tok.pad_token_id]]), torch.tensor([[True] * len(ids) + [False]])
    enc = PromptEncoder(tok, "prompt", "text", chat_template=True)
    inp = RewardInputs(tok, enc, chat_template=True)(None, None, resp, mask, [{"prompt": "hi"}])
    out = score(rm, inp, mask, with_grad=True)
    # the same gradient, taken by hand over the whole input
    h = rm.get_input_embeddings()(inp.input_ids).detach().requires_grad_(True)
    s = rm(inputs_embeds=h, attention_mask=inp.attention_mask.long()).logits[:, 0]
    (g,) = torch.autograd.grad(s.sum(), h)
    for t in range(len(ids)):
        torch.testing.assert_close(out.grad[0, t], g[0, inp.response_pos[0, t]])
    assert torch.equal(out.grad[0, len(ids)], torch.zeros_like(out.grad[0, 0]))  # padding


def _cfg(*overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return validate(compose(config_name="train", overrides=list(overrides)))


FAMILIES = {"qwen3": ("chatml", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
            "llama32": ("llama3", "LlamaForCausalLM", "LlamaForSequenceClassification")}
DATASETS = {"ultrafeedback": ("prompt", lambda i: f"write about cats and dogs {i}"),
            "hh_rlhf": ("chosen", lambda i: f"\n\nHuman: hi {i}\n\nAssistant: hello\n\nHuman: the sun\n\nAssistant: cats")}


def stand_ins(tmp_path: Path, family: str, data: str) -> list[str]:
    """Tiny random models of the preset's architecture classes (its `arch`, shrunk), saved with a
    chat tokenizer, and a local prompt dataset: the overrides that point the preset at them."""
    fmt, lm_cls, rm_cls = FAMILIES[family]
    c = _cfg(f"experiment=paper/{family}_{data}")
    tok = chat_tokenizer(tmp_path, fmt)
    small = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=256)
    paths = {}
    for kind, arch, build, cls in (("policy", c.policy.arch, build_causal_lm, lm_cls),
                                   ("reward", c.reward.arch, build_reward_model, rm_cls)):
        a = {k: v for k, v in arch.items() if k != "vocab_size"} | small
        model = build(a, tok, 0)
        assert type(model).__name__ == cls
        paths[kind] = tmp_path / f"{kind}-{family}"
        model.save_pretrained(paths[kind])
        tok.save_pretrained(paths[kind])
    field, make = DATASETS[data]
    data_dir = tmp_path / f"data-{data}"
    data_dir.mkdir()
    for split, n in (("train", 24), ("test", 8)):
        (data_dir / f"{split}.jsonl").write_text("".join(json.dumps({field: make(i)}) + "\n" for i in range(n)))
    return [f"policy.path={paths['policy']}", f"reward.path={paths['reward']}", f"data.path={data_dir}",
            "data.train_split=train", "data.eval_split=test", "data.max_prompt_tokens=64"]


SMALL_RUN = ["trainer.steps=2", "trainer.batch_size=8", "trainer.num_generations=4", "trainer.mini_batch_size=8",
             "trainer.micro_batch_size=4", "trainer.max_new_tokens=8", "trainer.eval_size=4", "trainer.eval_batch_size=4",
             "trainer.eval_every=2", "trainer.checkpoint_every=2", "trainer.threads=1", "trainer.progress=false",
             "trainer.lr=1e-3", "trainer.mask_truncated=false"]  # random stand-ins rarely stop within 8 tokens


@pytest.mark.slow
@pytest.mark.parametrize(("family", "data"), [("qwen3", "ultrafeedback"), ("llama32", "hh_rlhf")])
def test_paper_preset_trains_with_datc_on_local_stand_ins(tmp_path, family, data):
    overrides = [f"experiment=paper/{family}_{data}", "credit=datc", *stand_ins(tmp_path, family, data), *SMALL_RUN,
                 f"run_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "datc.train", *overrides], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/total" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["credit/weight_std"] > 0 for r in steps)  # DATC's weights are not uniform
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["policy"] == _cfg(f"experiment=paper/{family}_{data}").policy.name


@pytest.mark.parametrize("family", ["qwen3", "llama32"])
def test_preset_offline_fails_fast_naming_the_checkpoint(tmp_path, family):
    c = _cfg(f"experiment=paper/{family}_ultrafeedback")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "datc.train", f"experiment=paper/{family}_ultrafeedback",
                           f"run_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert c.policy.path in line and "local" in line, line
    assert "Traceback" not in proc.stderr


def test_long_prompts_are_dropped_or_refused(tmp_path):
    from datc.prepare.assets import check_lengths

    tok = chat_tokenizer(tmp_path, "chatml")
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": "cats " * n} for n in (1, 2, 30)])
    # a testbed policy needs a task to warm-start on (keywords here): only the prompt lengths are checked
    base = ["data=ultrafeedback", "reward=skywork_v2_qwen3_1_7b", "data.max_prompt_tokens=20", "policy=tiny_gpt2",
            "data.task=keywords", "policy.chat_template=true"]
    train, evald = check_lengths(_cfg(*base), tok, ds, ds)
    assert len(train) == len(evald) == 2  # the 30-word prompt (plus its template) is dropped
    with pytest.raises(ConfigError, match="^data.max_prompt_tokens"):
        check_lengths(_cfg(*base, "data.long_prompts=error"), tok, ds, ds)
