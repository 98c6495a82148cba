"""TRL's side of the benchmark: its ``GRPOTrainer`` configured like this project's trainer, with
timers around its phases, and the reward callable that scores the sampled ids through this
project's reward model. Needs trl (the ``bench`` extra) only when a trainer is built."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch


def pad_completions(completion_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's completion id lists (each up to and including its EOS) -> right-padded ids (B, T)
    and their valid-token mask (B, T) bool, as this project's rollout lays them out."""
    T = max(1, max(len(c) for c in completion_ids))
    ids = torch.full((len(completion_ids), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(completion_ids), T, dtype=torch.bool)
    for i, c in enumerate(completion_ids):
        ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, : len(c)] = True
    return ids, mask


def unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's ids where its mask is set (padding, left or right, left out)."""
    return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]


class RMReward:
    """TRL reward function around the frozen reward model. It scores the sampled token ids as
    they are: the prompt rendered as this project renders it (``encoder``, a
    :class:`datc.models.chat.PromptEncoder`: the text with BOS on the testbed, the chat template on a
    real model; default: the text as it is) followed by the completion ids up to and including
    EOS, through this project's reward-model inputs (``datc.models.chat.RewardInputs``) and ``score``,
    so both trainers get the same rewards.

    TRL's built-in path for a model object would decode the completions, concatenate prompt and
    completion text (or render prompt and completion messages with the chat template) and
    re-tokenize without special tokens: with the word-level testbed tokenizer that drops BOS and
    EOS and glues the prompt's last word to the completion's first, so the reward model would see
    other inputs than the ones it was trained on; with a BPE tokenizer, re-tokenized text need not
    give back the sampled ids."""

    __name__ = "rm_score"

    def __init__(self, rm, tok, micro_batch_size: int, encoder=None, rm_tok=None, rm_chat_template: bool = False) -> None:
        from datc.models.chat import PromptEncoder, RewardInputs

        # TRL hands over the prompt column as it is: a text, or (conversational) a list of messages
        enc = PromptEncoder(tok) if encoder is None else dataclasses.replace(encoder, field="prompt", prompt_format="text")
        self.rm, self.tok, self.micro, self.encoder = rm, tok, micro_batch_size, enc
        self.inputs = RewardInputs(rm_tok if rm_tok is not None else tok, enc, rm_chat_template)

    def __call__(self, prompts, completions, completion_ids, **kwargs) -> list[float]:
        from datc.rewards.model import score

        rows = [{"prompt": p} for p in prompts]
        p_ids, p_mask = self.encoder.encode(rows, torch.device("cpu"))
        r_ids, r_mask = pad_completions(completion_ids, self.tok.pad_token_id)
        inp = self.inputs(p_ids, p_mask, r_ids, r_mask, rows)
        return score(self.rm, inp, r_mask, batch_size=self.micro).scores.tolist()


def trl_prompt(encoder, example: dict[str, Any]) -> str | list[dict[str, str]]:
    """A prompt row as TRL takes it: with a chat template, the conversation (TRL renders it with
    the tokenizer's template, generation prompt added, as :class:`datc.models.chat.PromptEncoder`
    does); otherwise the prompt text (TRL tokenizes it with the tokenizer's special tokens, as
    this project does)."""
    return encoder.messages(example) if encoder.chat_template else encoder.text(example)


def trl_dataset(session):
    """The session's training prompts as TRL's dataset (the prompt column as :func:`trl_prompt`
    gives it; the testbed's rows as they are)."""
    train, enc = session.assets.train, session.m.encoder
    if not enc.chat_template and enc.prompt_format == "text" and enc.field == "prompt":
        return train
    return train.map(lambda ex: {"prompt": trl_prompt(enc, ex)}, keep_in_memory=True)  # no cache file per block


def _timed_trainer_class():
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with wall-clock timers around its phases (no change to what it computes)."""

        def __init__(self, *args, **kwargs) -> None:
            self.acc: dict[str, float] = defaultdict(float)
            super().__init__(*args, **kwargs)

        def _generate_single_turn(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                self.acc["rollout_s"] += time.perf_counter() - t0

        def _calculate_rewards(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return super()._calculate_rewards(*args, **kwargs)
            finally:
                self.acc["reward_s"] += time.perf_counter() - t0

        def _generate_and_score_completions(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*args, **kwargs)
            self.acc["generate_and_score_s"] += time.perf_counter() - t0
            self.acc["tokens"] += float(out["completion_mask"].sum())
            return out

    class StepClock(TrainerCallback):
        """Step time = between consecutive ``on_step_end`` (the whole loop, data included)."""

        def __init__(self, trainer) -> None:
            self.trainer, self.rows, self.last = trainer, [], None

        def on_step_begin(self, args, state, control, **kw):
            if self.last is None:
                self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            a = dict(self.trainer.acc)
            self.trainer.acc.clear()
            step = now - self.last
            self.last = now
            pre = a.get("generate_and_score_s", 0.0)
            self.rows.append({"step_s": step, "tokens": a.get("tokens", 0.0), "rollout_s": a.get("rollout_s", 0.0),
                              "reward_s": a.get("reward_s", 0.0),
                              "prep_s": pre - a.get("rollout_s", 0.0) - a.get("reward_s", 0.0),
                              "update_s": step - pre, "threads": torch.get_num_threads()})

    return TimedGRPOTrainer, StepClock


def build_trl(session, steps: int, seed: int, max_new_tokens: int | None = None, force_length: bool = False,
              out_dir: str | None = None, use_vllm: bool = False):
    """A TRL ``GRPOTrainer`` configured like ``session``'s trainer, on the same assets: the same
    policy checkpoint loaded the same way, the same reward model, the prompts as
    :func:`trl_dataset` gives them; ``trainer.micro_batch_size`` is TRL's
    ``per_device_train_batch_size``, accumulated over ``batch_size / micro_batch_size`` micro-batches
    (``gradient_accumulation_steps`` = ``steps_per_generation``: one generation of the whole batch
    and one optimizer step per rollout, as here). ``use_vllm``: TRL samples with its own vLLM in
    colocate mode (``vllm_mode="colocate"``, in this process), the forced length through vLLM's
    ``min_tokens``."""
    from trl import GRPOConfig

    from datc.models.build import freeze, load_pretrained
    from datc.models.chat import prompt_encoder
    from datc.models.tokenizer import load_tokenizer

    c, t, a = session.c, session.c.trainer, session.assets
    if t.loss_agg != "token-mean" or t.epochs != 1 or t.mini_batch_size != t.batch_size:
        raise SystemExit("scripts.bench compares the on-policy token-mean setting (TRL loss_type='dapo')")
    if t.batch_size % t.micro_batch_size or t.generation_batch_size not in (None, t.batch_size):
        raise SystemExit("scripts.bench needs micro-batches that divide the batch and one sampling call per batch")
    T = max_new_tokens or t.max_new_tokens
    accum = t.batch_size // t.micro_batch_size
    TimedGRPOTrainer, StepClock = _timed_trainer_class()
    args = GRPOConfig(
        output_dir=out_dir or tempfile.mkdtemp(prefix="bench-trl-"),
        per_device_train_batch_size=t.micro_batch_size, gradient_accumulation_steps=accum, steps_per_generation=accum,
        num_generations=t.num_generations, num_iterations=1, max_completion_length=T,
        temperature=t.temperature, top_p=t.top_p, top_k=0, beta=t.beta, epsilon=t.epsilon_low,
        epsilon_high=t.epsilon_high, loss_type="dapo", scale_rewards=t.scale_rewards,
        mask_truncated_completions=t.mask_truncated, learning_rate=t.lr, adam_beta1=t.adam_betas[0],
        adam_beta2=t.adam_betas[1], weight_decay=t.weight_decay, optim="adamw_torch",
        lr_scheduler_type=t.lr_scheduler, warmup_steps=t.warmup_steps, max_grad_norm=t.max_grad_norm,
        max_steps=steps, logging_steps=max(steps, 1), save_strategy="no", report_to="none", use_cpu=True,
        bf16=False, fp16=False, seed=seed, data_seed=seed, disable_tqdm=True, dataloader_num_workers=0,
        use_vllm=use_vllm, **({"vllm_mode": "colocate"} if use_vllm else {}), log_completions=False,
        # The plain k3 KL, as this project's loss. TRL 1.16's default (True) multiplies the KL by
        # the ratio: the same value on-policy, but a different gradient (the ratio is differentiated).
        use_bias_correction_kl=False,
        # TRL's GRPOConfig turns gradient checkpointing on by default (a second forward pass in the
        # backward); this project does not checkpoint, so neither does TRL here.
        gradient_checkpointing=False,
        generation_kwargs=({"min_tokens" if use_vllm else "min_new_tokens": T} if force_length else None),
    )
    policy = load_pretrained("causal_lm", a.policy_path, "policy.path")
    rm = freeze(load_pretrained("reward", a.reward_path, "reward.path"))
    tok = load_tokenizer(a.tokenizer_path)
    rm_tok = load_tokenizer(a.reward_path, "reward.path") if c.reward.path is not None else tok
    reward = RMReward(rm, tok, t.micro_batch_size, prompt_encoder(c, tok), rm_tok, c.reward.chat_template)
    trainer = TimedGRPOTrainer(model=policy, reward_funcs=[reward], args=args, train_dataset=trl_dataset(session),
                               processing_class=tok)
    clock = StepClock(trainer)
    trainer.add_callback(clock)
    return trainer, clock


def run_trl_block(session, steps: int, warmup: int, seed: int, **kw) -> list[dict[str, float]]:
    """``warmup + steps`` steps of TRL's trainer; the timed rows of the last ``steps``. TRL must not
    change torch's thread count (refused), except with ``use_vllm``, whose engine sets it for the
    whole process as vLLM's CPU worker does for this project's engine too (each row says it)."""
    from transformers.utils import logging as hf_logging

    threads = torch.get_num_threads()
    trainer, clock = build_trl(session, warmup + steps, seed, **kw)
    hf_logging.set_verbosity_error()
    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its final log line
        trainer.train()
    torch.set_num_threads(threads)
    if not kw.get("use_vllm") and any(r["threads"] != threads for r in clock.rows):
        raise RuntimeError(f"TRL's run changed torch's thread count from {threads}")
    return clock.rows[warmup:]
