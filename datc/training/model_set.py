"""The run's models as one named set: the trained policy, the frozen reference and reward
models, the tokenizer and the prompt / reward-model input encoders, loaded and placed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from datc.batch import Rollout
from datc.config import ConfigError, TrainConfig
from datc.models.build import freeze, load_pretrained, resolve_dtype
from datc.models.chat import RewardInputs, prompt_encoder
from datc.models.lora import AdaptersOff, add_adapters, lora_on
from datc.models.tokenizer import load_tokenizer
from datc.prepare.assets import Assets


@dataclass
class Models:
    policy: Any  # the policy module (under DeepSpeed: the engine's module; forwards go through it)
    ref: Any | None
    rm: Any
    tok: Any
    vocab_size: int = 0  # rows of the policy's LM head (read before any partitioning)
    encoder: Any = None  # datc.models.chat.PromptEncoder: the policy's prompts (format, chat template)
    rm_inputs: Any = None  # datc.models.chat.RewardInputs: the reward model's inputs (its own chat template)
    adapter: Any = None  # the peft.PeftModel around ``policy`` when it trains LoRA adapters (datc.models.lora), else None

    def score_inputs(self, ro: Rollout):
        return self.rm_inputs(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, ro.examples)


def load_models(c: TrainConfig, assets: Assets, device: torch.device, backend=None) -> Models:
    """The run's models; ``backend`` (:class:`datc.backends.base.Backend`) places the frozen ones
    (None: as they load, replicas). The policy is placed with its optimizer, by the session."""
    dtype = resolve_dtype(c.policy.dtype, device)
    tok = load_tokenizer(assets.tokenizer_path)
    if lora_on(c):  # the base frozen at the compute dtype, fp32 adapters; the reference: adapters off
        adapter = add_adapters(load_pretrained("causal_lm", assets.policy_path, "policy.path", dtype).to(device),
                               c.policy.lora, c.seed)
        policy = adapter.base_model.model
        ref = AdaptersOff(policy) if c.trainer.beta > 0 else None
    else:
        adapter = None
        # fp32 master weights, whatever the checkpoint's dtype: transformers >= 5 loads a checkpoint in its
        # stored dtype when none is given (bf16 for the hub's 1-2B models: AdamW steps of lr 1e-6 vanish there)
        policy = load_pretrained("causal_lm", assets.policy_path, "policy.path", torch.float32).to(device)
        ref = freeze(load_pretrained("causal_lm", assets.policy_path, "policy.path", dtype).to(device)) if c.trainer.beta > 0 else None
    rm = freeze(load_pretrained("reward", assets.reward_path, "reward.path", dtype).to(device))
    rm_tok = load_tokenizer(assets.reward_path, "reward.path") if c.reward.path is not None else tok
    if rm_tok.get_vocab() != tok.get_vocab():
        raise ConfigError(
            f"reward.path: the reward model's tokenizer ({assets.reward_path}) and the policy's "
            f"({assets.tokenizer_path}) assign different token ids; the reward model must read the "
            "policy's sampled ids as they are (use a reward model of the policy's family)"
        )
    vocab = policy.get_output_embeddings().weight.shape[0]
    if backend is not None:
        ref = backend.place_frozen(ref) if ref is not None and adapter is None else ref
        rm = backend.place_frozen(rm)
    encoder = prompt_encoder(c, tok)
    return Models(policy, ref, rm, tok, vocab, encoder=encoder, rm_inputs=RewardInputs(rm_tok, encoder, c.reward.chat_template),
                  adapter=adapter)

