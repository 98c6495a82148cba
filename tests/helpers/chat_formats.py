"""Two chat formats of the kind the paper presets' checkpoints use, written out for word-level
test vocabularies: ChatML (Qwen3's) and Llama 3's header format. The tests build tokenizers with
them (tests/models/test_chat.py) and so does the GPU check (scripts/gpu_check/cases.py), which therefore
exercise the same templates. Test data, not a test: pytest collects nothing here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFormat:
    """A chat template and the tokens it needs: ``specials`` (the template's own markers),
    ``eos`` (the end-of-turn token, which ends a response) and ``pad`` (the family's padding token,
    itself one of ``specials`` only where the family's checkpoints ship one)."""

    template: str
    specials: tuple[str, ...]
    eos: str
    pad: str


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

FORMATS = {
    "chatml": ChatFormat(CHATML, ("<|im_start|>", "<|im_end|>"), eos="<|im_end|>", pad="<|endoftext|>"),
    "llama3": ChatFormat(LLAMA3, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                         eos="<|eot_id|>", pad="<|finetune_right_pad_id|>"),
}
