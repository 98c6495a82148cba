"""Prompts as the models see them: the policy's chat template for generation, the reward model's
own chat template for scoring, and each sampled token's exact position in the reward model's
input.

The reward model's input is never re-tokenized text. Its template is rendered once per prompt
around a placeholder answer, split there into a prefix and a suffix, and each is tokenized
alone; the policy's sampled ids are spliced between them::

    RM input = prefix(prompt) + response ids (without the policy's end-of-turn token) + suffix

so response token ``t`` sits at ``len(prefix) + t``. The policy's end-of-turn token (its EOS,
e.g. ``<|im_end|>`` or ``<|eot_id|>``) is the suffix's first token when the two templates end a
turn the same way (same family: they do), and is then mapped there; otherwise it has no position
(no reward-model gradient) and is not spliced in.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from datc.models.rm_inputs import RMInputs, build_rm_inputs

_PLACEHOLDER = "\u2063\u2063RESPONSE\u2063\u2063"  # invisible separators: never in a real template
_HH_TURN = re.compile(r"\n\n(Human|Assistant):[ ]?")


def hh_messages(text: str) -> list[dict[str, str]]:
    """An Anthropic HH-RLHF dialogue (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``) as chat messages,
    without its final assistant turn: the conversation the policy is asked to continue."""
    parts = _HH_TURN.split(text if text.startswith("\n\n") else "\n\n" + text)
    turns = [{"role": "user" if role == "Human" else "assistant", "content": content.strip()}
             for role, content in zip(parts[1::2], parts[2::2], strict=True)]
    while turns and turns[-1]["role"] == "assistant":
        turns.pop()
    if not turns:
        raise ValueError(f"not a Human/Assistant dialogue: {text[:80]!r}")
    return turns


def hh_prompt_text(text: str) -> str:
    """The raw-text HH prompt: the dialogue up to and including its last ``Assistant:``."""
    cut = text.rfind("\n\nAssistant:")
    if cut < 0:
        raise ValueError(f"not a Human/Assistant dialogue: {text[:80]!r}")
    return text[: cut + len("\n\nAssistant:")]


def _ids(out: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)`` returns ids or, in newer transformers, a mapping."""
    if isinstance(out, Mapping):
        out = out["input_ids"]
    return list(out)


@dataclass
class PromptEncoder:
    """Turns a dataset row into the policy's prompt ids (``data.prompt_format``,
    ``policy.chat_template``)."""

    tok: Any
    field: str = "prompt"
    prompt_format: str = "text"  # text | hh
    chat_template: bool = False
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def messages(self, example: Mapping[str, Any]) -> list[dict[str, str]]:
        value = example[self.field]
        if isinstance(value, list):  # already chat messages (conversational datasets)
            return [{"role": m["role"], "content": m["content"]} for m in value]
        if self.prompt_format == "hh":
            return hh_messages(value)
        return [{"role": "user", "content": value}]

    def text(self, example: Mapping[str, Any]) -> str:
        """The prompt as plain text (no chat template)."""
        value = example[self.field]
        if isinstance(value, list):
            return "\n\n".join(m["content"] for m in value)
        return hh_prompt_text(value) if self.prompt_format == "hh" else value

    def ids(self, example: Mapping[str, Any]) -> list[int]:
        if self.chat_template:
            return _ids(self.tok.apply_chat_template(self.messages(example), add_generation_prompt=True, tokenize=True,
                                                     **self.template_kwargs))
        return list(self.tok(self.text(example))["input_ids"])

    def lengths(self, examples) -> list[int]:
        if not self.chat_template:
            return [len(x) for x in self.tok([self.text(ex) for ex in examples])["input_ids"]]
        return [len(self.ids(ex)) for ex in examples]

    def encode(self, examples: list[Mapping[str, Any]], device) -> tuple[Tensor, Tensor]:
        """Left-padded prompt ids and mask, (B, P)."""
        if not self.chat_template:
            enc = self.tok([self.text(ex) for ex in examples], padding=True, return_tensors="pt")
            return enc["input_ids"].to(device), enc["attention_mask"].to(device).bool()
        return left_pad([self.ids(ex) for ex in examples], self.tok.pad_token_id, device)


def left_pad(rows: list[list[int]], pad_id: int, device=None) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = True
    return ids.to(device), mask.to(device)


def template_parts(rm_tok, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """The reward model's chat template around an answer: (prefix ids, suffix ids)."""
    text = rm_tok.apply_chat_template([*messages, {"role": "assistant", "content": _PLACEHOLDER}], tokenize=False)
    if text.count(_PLACEHOLDER) != 1:
        raise ValueError("the reward model's chat template does not render the assistant's answer verbatim once")
    prefix, suffix = text.split(_PLACEHOLDER)
    enc = rm_tok([prefix, suffix], add_special_tokens=False)["input_ids"]
    return list(enc[0]), list(enc[1])


def splice_rm_inputs(prefixes: list[list[int]], suffixes: list[list[int]], response_ids: Tensor, response_mask: Tensor,
                     eos_id: int, pad_id: int) -> RMInputs:
    """Reward-model inputs ``prefix + response + suffix`` per row, as :class:`RMInputs`' two
    blocks (the template's prefix; the response and the suffix), each left-padded, with each
    valid response token's position (``response_pos``) and whether it has one (``mapped``)."""
    B, T = response_ids.shape
    conts, n_content, eos_mapped = [], [], []
    resp_lists = response_ids.tolist()
    lengths = response_mask.sum(-1).tolist()
    for i in range(B):
        resp = resp_lists[i][: lengths[i]]
        ends = bool(resp) and resp[-1] == eos_id
        content = resp[:-1] if ends else resp
        conts.append(content + suffixes[i])
        n_content.append(len(content))
        eos_mapped.append(ends and bool(suffixes[i]) and suffixes[i][0] == eos_id)
    pre_ids, pre_mask = left_pad(prefixes, pad_id, response_ids.device)
    cont_ids, cont_mask = left_pad(conts, pad_id, response_ids.device)
    P, C = pre_ids.shape[1], cont_ids.shape[1]
    t = torch.arange(T, device=response_ids.device)[None, :]
    start = torch.tensor([P + C - len(c) for c in conts], device=response_ids.device)[:, None]  # the response's first column
    n = torch.tensor(n_content, device=response_ids.device)[:, None]
    mapped = (t < n) | ((t == n) & torch.tensor(eos_mapped, device=response_ids.device)[:, None])
    mapped &= response_mask
    pos = torch.where(mapped, start + t, torch.zeros_like(t))  # the EOS lands on the suffix's first token
    return RMInputs(torch.cat([pre_ids, cont_ids], 1), torch.cat([pre_mask, cont_mask], 1), pos, mapped, prefix_len=P)


@dataclass
class RewardInputs:
    """Builds the reward model's inputs for a rollout: the policy's prompt ids followed by the
    response (no template, same tokenizer), or the reward model's own chat template."""

    rm_tok: Any
    encoder: PromptEncoder
    chat_template: bool = False
    _cache: dict[str, tuple[list[int], list[int]]] = dataclasses.field(default_factory=dict)

    def __call__(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
                 examples: list[Mapping[str, Any]]) -> RMInputs:
        pad = self.rm_tok.pad_token_id
        if not self.chat_template:
            return build_rm_inputs(prompt_ids, prompt_mask, response_ids, response_mask, pad)
        parts = []
        for ex in examples:
            msgs = self.encoder.messages(ex)
            key = json.dumps(msgs)
            if key not in self._cache:
                if len(self._cache) > 65536:
                    self._cache.clear()
                self._cache[key] = template_parts(self.rm_tok, msgs)
            parts.append(self._cache[key])
        return splice_rm_inputs([p for p, _ in parts], [s for _, s in parts], response_ids, response_mask,
                                self.encoder.tok.eos_token_id, pad)


def prompt_encoder(c, tok) -> PromptEncoder:
    """The policy's prompt encoder for a :class:`datc.config.TrainConfig`."""
    return PromptEncoder(tok, c.data.prompt_field, c.data.prompt_format, c.policy.chat_template,
                         dict(c.policy.chat_template_kwargs))
