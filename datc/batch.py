"""The batch of one step: :class:`Rollout` (prompts, sampled responses and what the sampler
kept), the helpers that build and combine it, and the positions every forward over it uses. The
type every phase of the step passes on, below every room that samples, scores or trains."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class Rollout:
    """One rollout batch. B = prompts * G responses, groups contiguous; P prompt width; T =
    ``max_new_tokens`` (responses are right-padded to exactly T)."""

    prompt_ids: Tensor  # (B, P) long, left-padded
    prompt_mask: Tensor  # (B, P) bool
    response_ids: Tensor  # (B, T) long, right-padded with the pad id
    response_mask: Tensor  # (B, T) bool, valid tokens: up to and including the first EOS
    truncated: Tensor  # (B,) bool, no EOS within the budget
    examples: list[dict[str, Any]]  # the prompt row of each response, length B
    logits: Tensor | None = None  # (B, T, V) generate's raw logits at each response position, if kept
    sampler_logps: Tensor | None = None  # (B, T) float32, an engine's own log-prob of each sampled token (0 past the mask)
    versions: Tensor | None = None  # (B,) long, the policy version (optimizer steps taken) that sampled each response; None: the current one

    def select(self, rows: slice | Tensor) -> Rollout:
        """The responses ``rows``, a slice (e.g. one rank's share of whole groups) or (k,) long indices."""
        examples = self.examples[rows] if isinstance(rows, slice) else [self.examples[i] for i in rows.tolist()]
        return Rollout(self.prompt_ids[rows], self.prompt_mask[rows], self.response_ids[rows], self.response_mask[rows],
                       self.truncated[rows], examples, None if self.logits is None else self.logits[rows],
                       None if self.sampler_logps is None else self.sampler_logps[rows],
                       None if self.versions is None else self.versions[rows])

    @property
    def input_ids(self) -> Tensor:  # (B, P + T)
        return torch.cat([self.prompt_ids, self.response_ids], 1)

    @property
    def attention_mask(self) -> Tensor:  # (B, P + T)
        return torch.cat([self.prompt_mask, self.response_mask], 1)


def cat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Rollouts sampled in several calls as one batch: prompts left-padded to the widest part
    (padding is masked and skipped by :func:`position_ids`, so every row computes the same)."""
    if len(parts) == 1:
        return parts[0]
    P = max(p.prompt_ids.shape[1] for p in parts)

    def widen(x: Tensor, fill) -> Tensor:
        return torch.cat([x.new_full((x.shape[0], P - x.shape[1]), fill), x], 1)

    logits = None if parts[0].logits is None else torch.cat([p.logits for p in parts])
    logps = None if parts[0].sampler_logps is None else torch.cat([p.sampler_logps for p in parts])
    versions = None if parts[0].versions is None else torch.cat([p.versions for p in parts])
    return Rollout(torch.cat([widen(p.prompt_ids, pad_id) for p in parts]),
                   torch.cat([widen(p.prompt_mask, False) for p in parts]),
                   torch.cat([p.response_ids for p in parts]), torch.cat([p.response_mask for p in parts]),
                   torch.cat([p.truncated for p in parts]), [ex for p in parts for ex in p.examples], logits, logps,
                   versions)


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip padding (left or interior), as HF ``generate`` computes them."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)


def encode_prompts(tokenizer, examples: list[dict[str, Any]], field: str, device) -> tuple[Tensor, Tensor]:
    enc = tokenizer([ex[field] for ex in examples], padding=True, return_tensors="pt")
    return enc["input_ids"].to(device), enc["attention_mask"].to(device).bool()


def with_prompts(ro: Rollout, tokenizer, prompts: list[str], encoder=None) -> Rollout:
    """The same sampled responses after other prompt texts (one per response, length B): the
    prompts are tokenized and left-padded as :func:`sample_groups` does (through ``encoder``,
    a :class:`datc.models.chat.PromptEncoder`, each text as one user message when it applies a chat
    template), and the response ids are spliced in as sampled, never re-tokenized. Generate's
    logits are not carried over."""
    if len(prompts) != ro.response_ids.shape[0]:
        raise ValueError(f"{len(prompts)} prompts for {ro.response_ids.shape[0]} responses")
    rows = [{"prompt": p} for p in prompts]
    if encoder is not None:
        ids, mask = dataclasses.replace(encoder, field="prompt", prompt_format="text").encode(rows, ro.response_ids.device)
    else:
        ids, mask = encode_prompts(tokenizer, rows, "prompt", ro.response_ids.device)
    return dataclasses.replace(ro, prompt_ids=ids, prompt_mask=mask, logits=None)


def response_mask_from_ids(response_ids: Tensor, eos_id: int) -> tuple[Tensor, Tensor]:
    """Valid-token mask up to and including the first EOS, and whether the response ran out of
    budget without an EOS. (B, T) -> (B, T) bool, (B,) bool."""
    is_eos = response_ids == eos_id
    has_eos = is_eos.any(-1)
    first = torch.where(has_eos, is_eos.float().argmax(-1), torch.full_like(has_eos, response_ids.shape[1], dtype=torch.long))
    idx = torch.arange(response_ids.shape[1], device=response_ids.device)
    return idx[None, :] <= first[:, None], ~has_eos
