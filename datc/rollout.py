"""Group sampling: each prompt is tokenized once, left-padded once, and repeated for its group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import GenerationConfig


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

    @property
    def input_ids(self) -> Tensor:  # (B, P + T)
        return torch.cat([self.prompt_ids, self.response_ids], 1)

    @property
    def attention_mask(self) -> Tensor:  # (B, P + T)
        return torch.cat([self.prompt_mask, self.response_mask], 1)


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip padding (left or interior), as HF ``generate`` computes them."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)


def encode_prompts(tokenizer, examples: list[dict[str, Any]], field: str, device) -> tuple[Tensor, Tensor]:
    enc = tokenizer([ex[field] for ex in examples], padding=True, return_tensors="pt")
    return enc["input_ids"].to(device), enc["attention_mask"].to(device).bool()


def response_mask_from_ids(response_ids: Tensor, eos_id: int) -> tuple[Tensor, Tensor]:
    """Valid-token mask up to and including the first EOS, and whether the response ran out of
    budget without an EOS. (B, T) -> (B, T) bool, (B,) bool."""
    is_eos = response_ids == eos_id
    has_eos = is_eos.any(-1)
    first = torch.where(has_eos, is_eos.float().argmax(-1), torch.full_like(has_eos, response_ids.shape[1], dtype=torch.long))
    idx = torch.arange(response_ids.shape[1], device=response_ids.device)
    return idx[None, :] <= first[:, None], ~has_eos


@torch.no_grad()
def sample_groups(
    policy,
    tokenizer,
    examples: list[dict[str, Any]],
    num_generations: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    prompt_field: str = "prompt",
    keep_logits: bool = False,
    min_new_tokens: int = 0,
) -> Rollout:
    """Sample ``num_generations`` responses per prompt with HF ``generate`` (pure sampling:
    ``top_k`` off, so the sampling distribution is ``softmax(z / temperature)`` up to top-p).
    ``keep_logits`` also returns the raw logits generate computed for each sampled position
    (the rollout policy's distribution, without a second forward pass). ``min_new_tokens``
    forbids EOS before that many tokens (the benchmark uses it to fix the response length)."""
    device = next(policy.parameters()).device
    ids, mask = encode_prompts(tokenizer, examples, prompt_field, device)
    ids = ids.repeat_interleave(num_generations, 0)
    mask = mask.repeat_interleave(num_generations, 0)
    gen_cfg = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        top_k=0,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    was_training = policy.training
    policy.eval()
    out = policy.generate(input_ids=ids, attention_mask=mask.long(), generation_config=gen_cfg,
                          output_logits=keep_logits, return_dict_in_generate=True)
    policy.train(was_training)
    resp = out.sequences[:, ids.shape[1] :]
    logits = None
    if keep_logits:
        logits = torch.stack(out.logits, 1).float()  # (B, T_generated, V)
        if logits.shape[1] < max_new_tokens:
            logits = torch.cat([logits, logits.new_zeros(logits.shape[0], max_new_tokens - logits.shape[1], logits.shape[2])], 1)
    if resp.shape[1] < max_new_tokens:  # every response ended early: pad to the full budget
        pad = resp.new_full((resp.shape[0], max_new_tokens - resp.shape[1]), tokenizer.pad_token_id)
        resp = torch.cat([resp, pad], 1)
    rmask, truncated = response_mask_from_ids(resp, tokenizer.eos_token_id)
    resp = torch.where(rmask, resp, torch.full_like(resp, tokenizer.pad_token_id))
    expanded = [ex for ex in examples for _ in range(num_generations)]
    return Rollout(ids, mask, resp, rmask, truncated, expanded, logits)
