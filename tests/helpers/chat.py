"""A testbed tokenizer with a chat format of :mod:`tests.helpers.chat_formats` (the chat tests'
and the TRL comparison's)."""

from __future__ import annotations

from datc.models.tokenizer import build_testbed_tokenizer, load_tokenizer
from tests.helpers.chat_formats import FORMATS


def chat_tokenizer(tmp_path, fmt: str):
    template, specials, eos = FORMATS[fmt].template, list(FORMATS[fmt].specials), FORMATS[fmt].eos
    tok = load_tokenizer(build_testbed_tokenizer(tmp_path / f"base-{fmt}"))
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.add_tokens(["user", "assistant", "system"])
    tok.eos_token = eos
    tok.chat_template = template
    out = tmp_path / f"tok-{fmt}"
    tok.save_pretrained(out)
    return load_tokenizer(out)
