"""The testbed tokenizer: word level, built locally with ``tokenizers`` and saved as a
Hugging Face tokenizer directory, so tiny and real models load through the same
``AutoTokenizer.from_pretrained`` path."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from datc.tasks.base import BOS, EOS, PAD, UNK, vocabulary


def build_testbed_tokenizer(out_dir: str | Path) -> Path:
    """Write the word-level tokenizer to ``out_dir`` (one word = one token, ``<bos>`` prepended)."""
    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )
    out_dir = Path(out_dir)
    fast.save_pretrained(out_dir)
    return out_dir


def load_tokenizer(path: str | Path, field: str = "policy.tokenizer", gguf_file: str | None = None):
    """Load any Hugging Face tokenizer (hub id or directory; offline, an uncached hub id fails
    at once naming ``field``; ``gguf_file``: the one stored in that GGUF file, chat template
    included); prompts are left-padded for batched generation."""
    from datc.models.build import from_hub

    kwargs = {"gguf_file": gguf_file} if gguf_file is not None else {}
    tok = from_hub(AutoTokenizer.from_pretrained, str(path), field, "tokenizer", **kwargs)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok
