"""This project's GRPO trainer against TRL's ``GRPOTrainer`` on the same work, at two scales:
the testbed (``--scale testbed``, the default: results/bench/trl.{json,md}; ``make bench``) and
a real model (``--scale real``: results/bench/trl_real.{json,md}). Needs the ``bench`` extra,
which installs trl.

Same work on both sides: the same policy checkpoint (loaded by both through ``load_pretrained``)
and frozen reward model, the same prompts after the same prompt rendering (the chat template,
where the policy has one), group size, response budget, sampling (temperature, top-p, no
top-k), AdamW settings and schedule, clip range, KL coefficient (``beta``, so both run the
reference model), loss aggregation (``token-mean`` = TRL ``loss_type="dapo"``) and micro-batches
(``trainer.micro_batch_size`` = TRL ``per_device_train_batch_size``, the rest accumulated: TRL
``gradient_accumulation_steps`` = ``steps_per_generation``), one optimizer step per rollout
batch (on-policy: neither recomputes old log-probs), plain PyTorch on the CPU.

Scales:

- ``testbed``: the tiny GPT-2 (warm-started) and its reward model on the keywords task,
  8 prompts x 8 responses of up to 16 tokens.
- ``real``: the ``experiment=real_smollm2`` preset: SmolLM2-135M-Instruct with its ChatML
  template, the reward model made from it (``reward=smollm2_rm``), the reviews task; 8 prompts
  x 4 responses, micro-batches of 8, and responses forced to 48 tokens on both sides
  (``min_new_tokens``; ``--natural-length`` lets them end at EOS within the 48). The budget is
  set after the session is built, so the cached reward model (keyed by the preset's budget) is
  reused. Fewer, shorter blocks by default (a step takes minutes on a CPU), no length or group
  sweeps (``--scaling`` runs them).

1. Same loss: one rollout batch from the shared (slightly perturbed) policy goes through both
   trainers' own code (TRL's prompt rendering, padding, reference pass, reward call,
   advantages and ``compute_loss`` per micro-batch; this project's ``train_step``); the loss,
   the gradient norm, the rewards, the advantages and the prompt ids must agree (within
   ``--tol``) or the run stops.
2. Throughput: TRL, ``credit=grpo`` and ``credit=datc`` in blocks of ``--steps`` measured steps
   (after ``--warmup``), each block from the warm policy, the order rotated over ``--repeats``
   so that noise falls on all of them alike. Samples/s, response tokens/s, step time and its
   breakdown (rollout / reward / reference + advantages + credit / update).
3. Peak memory: each side alone in a fresh process (peak resident set, VmHWM).
4. Scaling: step time against the response length (responses forced to the full budget on both
   sides with ``min_new_tokens``) and against the group size (8 prompts per step); and, once
   both scales have results, the ratios of the testbed next to the real model's (a section of
   both markdown files; ``--combine`` re-renders them from the JSON files alone).
5. Profile: where this project's step spends its time (cProfile, torch ops).

    python scripts/bench.py [--scale testbed|real] [--steps N] [--warmup N] [--repeats N] [--threads 1] [hydra overrides ...]
    python scripts/bench.py --combine   # re-render trl.md and trl_real.md from their JSON files
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import dataclasses
import datetime
import functools
import io
import json
import math
import os
import platform
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from datc.utils import peak_rss_mb

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "bench"
PHASES = ("rollout", "reward", "prep", "update")  # prep: reference pass, advantages, credit
CONTESTANTS = ("trl", "grpo", "datc")
NOTES = [
    "- Same passes on both sides, per step: one sampling run with the KV cache, one reference-model "
    "forward (beta > 0), one reward-model forward, one policy forward and backward, one AdamW step; "
    "on-policy, neither recomputes old log-probs.",
    "- Set on TRL to match this project: `gradient_checkpointing=False` (TRL's GRPOConfig default is "
    "True: a second forward in the backward) and `use_bias_correction_kl=False` (TRL 1.16's default "
    "multiplies the k3 KL by the ratio: the same value on-policy, another gradient). The same-loss "
    "check compares gradient norms, so it would catch either.",
    "- TRL's reward function is a callable around the same reward model that scores the sampled ids "
    "(`RMReward` in scripts/bench.py): TRL's built-in path for a model object decodes and re-tokenizes "
    "text, which with the word-level testbed tokenizer drops BOS and EOS and glues the prompt's last word "
    "to the completion's first (one unknown token).",
    "- Shared prompts (`trainer.share_prompts`, on): this project forwards each group's prompt once in the "
    "rollout's prefill, the reference, reward-model and policy passes (the KV cache indexed out to the group's "
    "responses; the same results to float rounding, which the same-loss check bounds); TRL forwards every "
    "response with its prompt. TRL's reward callable scores through this project's `score`, shared prompts "
    "included, so both reward phases do the same reward-model work.",
    "- Work this project does that TRL does not: the testbed's gold reward and, for credit=datc, the "
    "credit diagnostics, every step. Work TRL does that this project does not: decoding completions "
    "to text for the reward functions and its logs, and the Trainer's per-step bookkeeping.",
    "- Peak RSS: each trainer alone in a fresh process, `--memory-steps` steps; growth = peak minus "
    "the resident set after loading models and building the trainer.",
    "- Freed memory kept in the heap (`trainer.keep_freed_memory`, on in `datc-train`; "
    "`datc.utils.keep_freed_memory`): set once for the whole process, so TRL's blocks and both memory runs "
    "get it too (`keep_freed_memory` in the JSON file says whether it applied).",
]


NOTES_REAL = [
    "- Same passes on both sides, per step: one sampling run with the KV cache over the whole batch, one "
    "reference-model forward (beta > 0) and one reward-model forward in chunks of `trainer.micro_batch_size` "
    "(this project's reward model runs its top blocks only, see the shared trunk below), "
    "the policy's forward and backward in micro-batches of that size accumulated into one AdamW step (TRL: "
    "`per_device_train_batch_size` = the micro-batch, `gradient_accumulation_steps` = `steps_per_generation` = "
    "batch / micro-batch, so one generation and one optimizer step per rollout); on-policy, neither recomputes "
    "old log-probs.",
    "- Prompts: TRL gets each prompt as one user message (a conversational dataset) and renders it with the "
    "tokenizer's chat template (`apply_chat_template(add_generation_prompt=True)`), as this project's "
    "`PromptEncoder` does; the same-loss check compares the prompt ids of both sides.",
    "- Response length: with `min_new_tokens` equal to the budget on both sides (EOS banned before it), every "
    "response has exactly the budget's tokens, so both sides sample, score and train on the same number of "
    "tokens whatever their random draws (`--natural-length`: responses end at their EOS).",
    "- Set on TRL to match this project: `gradient_checkpointing=False` (TRL's GRPOConfig default is "
    "True: a second forward in the backward) and `use_bias_correction_kl=False` (TRL 1.16's default "
    "multiplies the k3 KL by the ratio: the same value on-policy, another gradient). The same-loss "
    "check compares gradient norms, so it would catch either.",
    "- TRL's reward function is a callable around the same reward model that scores the sampled ids after the "
    "rendered prompt ids (`RMReward` in scripts/bench.py), as this project's reward phase does: TRL's built-in "
    "path for a model object decodes the completions and re-tokenizes text, which need not give back the "
    "sampled ids.",
    "- Shared prompts (`trainer.share_prompts`, on): this project forwards each group's prompt once in the "
    "rollout's prefill, the reference, reward-model and policy passes (the KV cache indexed out to the group's "
    "responses; the same results to float rounding, which the same-loss check bounds); TRL forwards every "
    "response with its prompt. TRL's reward callable scores through this project's `score`, shared prompts "
    "included.",
    "- Shared trunk (`trainer.share_trunk`, on; datc/trunk.py): the reward model is made from the policy and "
    "trained in its top 6 of 30 blocks, so its embeddings and lower 24 blocks are the reference's, block for "
    "block (found by comparing parameters); this project runs the reference pass once and the reward model's "
    "top 6 blocks from its hidden states (DATC's input gradient flows back through both), in the reward "
    "phase, where the reference pass is then timed. TRL runs its reference and the whole reward model "
    "(through this project's `score`), as it has no access to the reference's hidden states.",
    "- Work this project does that TRL does not: the reviews task's gold (the AFINN lexicon over the sampled "
    "tokens) and, for credit=datc, the credit diagnostics, every step. Work TRL does that this project does "
    "not: decoding completions to text for the reward functions and its logs, and the Trainer's per-step "
    "bookkeeping.",
    "- Peak RSS: each trainer alone in a fresh process, `--memory-steps` steps; growth = peak minus "
    "the resident set after loading models and building the trainer.",
    "- Freed memory kept in the heap (`trainer.keep_freed_memory`, on in `datc-train`; "
    "`datc.utils.keep_freed_memory`): set once for the whole process, so TRL's blocks and both memory runs "
    "get it too (`keep_freed_memory` in the JSON file says whether it applied).",
]


@dataclass(frozen=True)
class Scale:
    """One scale of the benchmark: its Hydra overrides, output files, work and targets."""

    name: str
    title: str  # for the side-by-side table
    overrides: tuple[str, ...]  # before the command line's
    stem: str  # results/bench/<stem>.json, <stem>.md, <stem>_profile.txt
    max_new_tokens: int | None  # set on both sides after the session is built (None: the config's)
    force_length: bool  # responses forced to the budget with min_new_tokens on both sides
    perturb: float  # noise scale of the same-loss check's perturbation (moves the policy off its reference)
    datc_target: float  # the target for credit=datc / credit=grpo step time
    defaults: dict[str, Any]  # command-line defaults
    notes: tuple[str, ...]  # the markdown's notes


GRPO_TARGET = 1.5  # the target for credit=grpo / TRL samples per second, at both scales
SCALES = {
    "testbed": Scale("testbed", "testbed (tiny GPT-2, keywords)", (), "trl", None, False, 0.02, 1.10,
                     {"steps": 10, "warmup": 2, "repeats": 5, "memory_steps": 4, "profile_steps": 5, "scaling": True,
                      "lengths": [8, 16, 32], "groups": [4, 8, 16]}, tuple(NOTES)),
    "real": Scale("real", "real model (SmolLM2-135M-Instruct, reviews)", ("experiment=real_smollm2",), "trl_real", 48,
                  True, 0.002, 1.05,
                  {"steps": 2, "warmup": 1, "repeats": 3, "memory_steps": 1, "profile_steps": 1, "scaling": False,
                   "lengths": [32, 48, 64], "groups": [4, 8]}, tuple(NOTES_REAL)),
}


# ---- small pure helpers (tested in tests/test_bench.py) ----------------------------------------


def spread(xs: list[float]) -> dict[str, float]:
    """Median, min, max and quartiles of a list of figures (quartiles need 2+ values)."""
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q1": q[0], "q3": q[2], "n": len(xs)}


def block_summary(rows: list[dict[str, float]], batch_size: int) -> dict[str, float]:
    """One block of measured steps -> throughput (totals over the block) and median phase times.
    Each row: ``step_s``, ``tokens`` and one ``<phase>_s`` per phase."""
    total = sum(r["step_s"] for r in rows)
    out = {"samples_per_s": batch_size * len(rows) / total, "tokens_per_s": sum(r["tokens"] for r in rows) / total,
           "step_s": statistics.median(r["step_s"] for r in rows),
           "response_len": sum(r["tokens"] for r in rows) / (batch_size * len(rows))}
    for p in PHASES:
        out[f"{p}_s"] = statistics.median(r[f"{p}_s"] for r in rows)
    out["other_s"] = out["step_s"] - sum(out[f"{p}_s"] for p in PHASES)
    return out


def rotated_order(names: tuple[str, ...], repeat: int) -> list[str]:
    """Order of the contestants in repeat ``repeat``: rotated by one each repeat and reversed
    every other repeat, so each runs first, middle and last alike."""
    k = repeat % len(names)
    order = list(names[k:] + names[:k])
    return order[::-1] if (repeat // len(names)) % 2 else order


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


def close(a: float, b: float, rtol: float, atol: float = 1e-7) -> bool:
    """``|a - b| <= rtol * max(|a|, |b|) + atol``."""
    return abs(a - b) <= rtol * max(abs(a), abs(b)) + atol


def perturb_(model, scale: float, seed: int) -> None:
    """Add the same seeded Gaussian noise to every parameter (by name, so two copies of one
    architecture get identical weights), moving the policy off its reference so the KL term
    and its gradient are not zero in the same-loss check."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g) * scale)


# ---- this project's side ----------------------------------------------------------------------


def datc_session(overrides: list[str], max_new_tokens: int | None = None):
    """This project's session; ``max_new_tokens`` (not None) replaces the response budget after
    the build, so the cache (keyed by the configured budget) is not prepared again."""
    from datc.analysis.inputs import session_for

    s = session_for(overrides)
    if max_new_tokens is not None:
        s.c.trainer.max_new_tokens = max_new_tokens
    return s


@contextlib.contextmanager
def forced_length(T: int | None):
    """Within the block, this project's rollout forbids EOS before ``T`` tokens."""
    import datc.trainer as tr

    if T is None:
        yield
        return
    orig = tr.sample_groups
    tr.sample_groups = functools.partial(orig, min_new_tokens=T)
    try:
        yield
    finally:
        tr.sample_groups = orig


def run_datc_block(overrides: list[str], steps: int, warmup: int, seed: int, max_new_tokens: int | None = None,
                   force_length: bool = False) -> list[dict[str, float]]:
    from datc.trainer import train_step

    s = datc_session(overrides, max_new_tokens)  # another budget without re-preparing the cache (keyed by it)
    torch.manual_seed(seed)
    rows = []
    with forced_length(s.c.trainer.max_new_tokens if force_length else None):
        for it in range(warmup + steps):
            t0 = time.perf_counter()
            m = train_step(s, it)
            dt = time.perf_counter() - t0
            if it >= warmup:
                rows.append({"step_s": dt, "tokens": m["perf/tokens_per_s"] * m["perf/step_s"],
                             "rollout_s": m["perf/rollout_s"], "reward_s": m["perf/reward_s"],
                             "prep_s": m["perf/credit_s"], "update_s": m["perf/update_s"]})
    return rows


# ---- TRL's side -------------------------------------------------------------------------------


class RMReward:
    """TRL reward function around the frozen reward model. It scores the sampled token ids as
    they are: the prompt rendered as this project renders it (``encoder``, a
    :class:`datc.chat.PromptEncoder`: the text with BOS on the testbed, the chat template on a
    real model; default: the text as it is) followed by the completion ids up to and including
    EOS, through this project's reward-model inputs (``datc.chat.RewardInputs``) and ``score``,
    so both trainers get the same rewards.

    TRL's built-in path for a model object would decode the completions, concatenate prompt and
    completion text (or render prompt and completion messages with the chat template) and
    re-tokenize without special tokens: with the word-level testbed tokenizer that drops BOS and
    EOS and glues the prompt's last word to the completion's first, so the reward model would see
    other inputs than the ones it was trained on; with a BPE tokenizer, re-tokenized text need not
    give back the sampled ids."""

    __name__ = "rm_score"

    def __init__(self, rm, tok, micro_batch_size: int, encoder=None, rm_tok=None, rm_chat_template: bool = False) -> None:
        from datc.chat import PromptEncoder, RewardInputs

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
    the tokenizer's template, generation prompt added, as :class:`datc.chat.PromptEncoder`
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
              out_dir: str | None = None):
    """A TRL ``GRPOTrainer`` configured like ``session``'s trainer, on the same assets: the same
    policy checkpoint loaded the same way, the same reward model, the prompts as
    :func:`trl_dataset` gives them; ``trainer.micro_batch_size`` is TRL's
    ``per_device_train_batch_size``, accumulated over ``batch_size / micro_batch_size`` micro-batches
    (``gradient_accumulation_steps`` = ``steps_per_generation``: one generation of the whole batch
    and one optimizer step per rollout, as here)."""
    from trl import GRPOConfig

    from datc.chat import prompt_encoder
    from datc.models import freeze, load_pretrained
    from datc.tokenizer import load_tokenizer

    c, t, a = session.c, session.c.trainer, session.assets
    if t.loss_agg != "token-mean" or t.epochs != 1 or t.mini_batch_size != t.batch_size:
        raise SystemExit("scripts/bench.py compares the on-policy token-mean setting (TRL loss_type='dapo')")
    if t.batch_size % t.micro_batch_size or t.generation_batch_size not in (None, t.batch_size):
        raise SystemExit("scripts/bench.py needs micro-batches that divide the batch and one sampling call per batch")
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
        use_vllm=False, log_completions=False,
        # The plain k3 KL, as this project's loss. TRL 1.16's default (True) multiplies the KL by
        # the ratio: the same value on-policy, but a different gradient (the ratio is differentiated).
        use_bias_correction_kl=False,
        # TRL's GRPOConfig turns gradient checkpointing on by default (a second forward pass in the
        # backward); this project does not checkpoint, so neither does TRL here.
        gradient_checkpointing=False,
        generation_kwargs={"min_new_tokens": T} if force_length else None,
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
    from transformers.utils import logging as hf_logging

    threads = torch.get_num_threads()
    trainer, clock = build_trl(session, warmup + steps, seed, **kw)
    hf_logging.set_verbosity_error()
    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its final log line
        trainer.train()
    torch.set_num_threads(threads)
    if any(r["threads"] != threads for r in clock.rows):
        raise RuntimeError(f"TRL's run changed torch's thread count from {threads}")
    return clock.rows[warmup:]


# ---- 1. the same loss on the same batch -------------------------------------------------------


SAME_LOSS = ("loss", "grad_norm", "reward_mean", "advantage_abs", "kl", "tokens")  # the check's figures, in table order


def same_loss_check(overrides: list[str], tol: float, perturb: float = 0.02, max_new_tokens: int | None = None,
                    force_length: bool = False) -> dict[str, Any]:
    """First step, on-policy, same weights: one rollout batch sampled once from the policy
    goes through TRL's pipeline (with generation replaced by that batch: its prompt rendering,
    padding, reference pass, reward call and advantages, then ``compute_loss`` and the backward
    per micro-batch as its ``training_step`` does them) and through this project's
    ``train_step`` (with sampling replaced by it). Both policies get the same small
    perturbation (``perturb``) first, so the reference (the warm policy) differs and the KL term
    counts. Returns both sides' figures, and whether both rendered the prompts to the same ids."""
    import datc.trainer as tr
    from datc.rollout import sample_groups

    s = datc_session([*overrides, "credit=grpo"], max_new_tokens)
    t = s.c.trainer
    trainer, _ = build_trl(s, 1, s.c.seed, max_new_tokens, force_length)
    perturb_(s.m.policy, perturb, 7)
    perturb_(trainer.model, perturb, 7)
    examples = [s.assets.train[i] for i in s.sampler.indices(0)]
    torch.manual_seed(1234)
    ro = sample_groups(s.m.policy, s.m.tok, examples, t.num_generations, t.max_new_tokens, t.temperature, t.top_p,
                       s.c.data.prompt_field, encoder=s.m.encoder, min_new_tokens=t.max_new_tokens if force_length else 0)
    lists = [ro.response_ids[i, : int(ro.response_mask[i].sum())].tolist() for i in range(len(ro.examples))]

    # TRL: its own prompt rendering, padding, reference pass, reward call, advantages and loss, on this batch.
    from trl.trainer.utils import split_tensor_dict

    trainer._generate_single_turn = lambda *a, **k: (copy.deepcopy(lists), None)
    trainer.model.train()
    accum = trainer.args.gradient_accumulation_steps
    trainer.current_gradient_accumulation_steps = accum
    inputs = trainer._generate_and_score_completions([{**ex, "prompt": trl_prompt(s.m.encoder, ex)} for ex in ro.examples])
    losses, kls = [], []
    for micro in split_tensor_dict(inputs, trainer.args.steps_per_generation):
        loss = trainer.compute_loss(trainer.model, micro)  # TRL's dapo loss of a micro-batch, already scaled for accumulation
        loss.backward()
        losses.append(float(loss.detach()))
        kls.append((trainer._metrics["train"]["kl"][-1], float(micro["completion_mask"].sum())))
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    trl = {"loss": sum(losses), "grad_norm": float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))),
           "reward_mean": trainer._metrics["train"]["reward"][-1], "advantage_abs": float(inputs["advantages"].abs().mean()),
           "kl": sum(k * n for k, n in kls) / max(sum(n for _, n in kls), 1.0), "tokens": float(inputs["completion_mask"].sum())}
    same_prompts = unpadded(inputs["prompt_ids"], inputs["prompt_mask"]) == unpadded(ro.prompt_ids, ro.prompt_mask)

    # This project: train_step on the same batch (sampling replaced; the loss is read before the step).
    orig = tr.sample_groups
    tr.sample_groups = lambda *a, **k: ro
    try:
        m = tr.train_step(s, 0)
    finally:
        tr.sample_groups = orig
    ours = {"loss": m["loss/total"], "grad_norm": m["loss/grad_norm"], "reward_mean": m["reward/total"],
            "advantage_abs": m["reward/advantage_abs"], "kl": m["loss/kl"], "tokens": float(ro.response_mask.sum())}
    agree = {k: close(trl[k], ours[k], tol) for k in SAME_LOSS}
    return {"tolerance": tol, "trl": trl, "datc": ours, "agree": agree, "same_prompt_ids": same_prompts,
            "prompt_tokens": float(ro.prompt_mask.sum()) / len(ro.examples), "perturb": perturb,
            "ok": all(agree.values()) and same_prompts}


def unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's ids where its mask is set (padding, left or right, left out)."""
    return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]


# ---- 3. peak memory, each side alone in a fresh process ---------------------------------------


def memory_child(who: str, overrides: list[str], steps: int, max_new_tokens: int | None = None,
                 force_length: bool = False) -> dict[str, float]:
    """Run ``steps`` steps of one side; peak resident memory of the whole process (models,
    libraries and all) and its growth over the set-up (the training steps' working memory)."""
    if who == "trl":
        s = datc_session(overrides, max_new_tokens)
        trainer, _ = build_trl(s, steps, s.c.seed, max_new_tokens, force_length)
        del s
        base = peak_rss_mb()
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
    else:
        from datc.trainer import train_step

        s = datc_session([*overrides, f"credit={who}"], max_new_tokens)
        base = peak_rss_mb()
        with forced_length(s.c.trainer.max_new_tokens if force_length else None):
            for it in range(steps):
                train_step(s, it)
    peak = peak_rss_mb()
    return {"peak_rss_mb": peak, "setup_rss_mb": base, "step_growth_mb": peak - base}


def peak_memory(overrides: list[str], steps: int, threads: int, child_args: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """Each side alone in a fresh process; ``child_args``: the scale's options (budget, lengths)."""
    out = {}
    for who in CONTESTANTS:
        cmd = [sys.executable, str(Path(__file__)), "--memory-child", who, "--memory-steps", str(steps),
               "--threads", str(threads), *child_args, *overrides]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if res.returncode != 0:
            raise RuntimeError(f"memory run of {who} failed:\n{res.stderr[-3000:]}")
        out[who] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


# ---- 4. scaling -------------------------------------------------------------------------------


def scaling(overrides: list[str], lengths: list[int], groups: list[int], steps: int, warmup: int, seed: int,
            max_new_tokens: int | None = None, force_length: bool = False) -> dict:
    """Median step time (s) of this project (credit=grpo) and TRL, one block each per point,
    interleaved. Lengths: responses forced to the budget. Groups: 8 prompts per step, the
    scale's budget and lengths (micro-batches: the whole batch where the scale has no smaller
    ones)."""
    base = datc_session(overrides)
    t = base.c.trainer
    out: dict[str, list[dict]] = {"length": [], "group": []}
    for i, T in enumerate(lengths):
        row = {"max_new_tokens": T}
        for who in (("grpo", "trl") if i % 2 == 0 else ("trl", "grpo")):
            if who == "trl":
                rows = run_trl_block(base, steps, warmup, seed, max_new_tokens=T, force_length=True)
            else:
                rows = run_datc_block([*overrides, "credit=grpo"], steps, warmup, seed, max_new_tokens=T, force_length=True)
            row[who] = block_summary(rows, t.batch_size)
        out["length"].append(row)
    work = {"max_new_tokens": max_new_tokens, "force_length": force_length}
    for i, G in enumerate(groups):
        micro = 8 * G if t.micro_batch_size == t.batch_size else math.gcd(t.micro_batch_size, 8 * G)
        ov = [*overrides, f"trainer.num_generations={G}", f"trainer.batch_size={8 * G}",
              f"trainer.mini_batch_size={8 * G}", f"trainer.micro_batch_size={micro}"]
        s = datc_session(ov)
        row = {"num_generations": G, "batch_size": 8 * G}
        for who in (("grpo", "trl") if i % 2 == 0 else ("trl", "grpo")):
            rows = (run_trl_block(s, steps, warmup, seed, **work) if who == "trl"
                    else run_datc_block([*ov, "credit=grpo"], steps, warmup, seed, **work))
            row[who] = block_summary(rows, 8 * G)
        out["group"].append(row)
    return out


# ---- 5. profile of this project's step --------------------------------------------------------


def profile_datc(overrides: list[str], steps: int, credit: str = "grpo", warm: int = 2, max_new_tokens: int | None = None,
                 force_length: bool = False) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from datc.trainer import train_step

    s = datc_session([*overrides, f"credit={credit}"], max_new_tokens)
    with forced_length(s.c.trainer.max_new_tokens if force_length else None):
        for it in range(warm):
            train_step(s, it)
        pr = cProfile.Profile()
        pr.enable()
        for it in range(warm, warm + steps):
            train_step(s, it)
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(30)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for it in range(warm + steps, warm + 2 * steps):
                train_step(s, it)
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    return {"steps": steps, "credit": credit, "cprofile_cumulative": _strip_paths(buf.getvalue()), "torch_ops": ops}


def _strip_paths(text: str) -> str:
    """Profile lines name files relative to their package, not where they are installed."""
    text = text.replace(str(ROOT) + "/", "")
    text = re.sub(r"\S*/site-packages/", "", text)
    return re.sub(r"\S*/lib/python3\.\d+/", "", text)


# ---- main -------------------------------------------------------------------------------------


def measure(overrides: list[str], steps: int, warmup: int, repeats: int, seed: int, max_new_tokens: int | None = None,
            force_length: bool = False) -> dict[str, Any]:
    s = datc_session(overrides, max_new_tokens)
    B = s.c.trainer.batch_size
    work = {"max_new_tokens": max_new_tokens, "force_length": force_length}
    blocks: dict[str, list[dict]] = {k: [] for k in CONTESTANTS}
    for r in range(repeats):
        for who in rotated_order(CONTESTANTS, r):
            if who == "trl":
                rows = run_trl_block(s, steps, warmup, seed + r, **work)
            else:
                rows = run_datc_block([*overrides, f"credit={who}"], steps, warmup, seed + r, **work)
            blocks[who].append(block_summary(rows, B))
            print(f"repeat {r} {who}: {blocks[who][-1]['samples_per_s']:.1f} samples/s, "
                  f"step {blocks[who][-1]['step_s'] * 1000:.1f} ms", file=sys.stderr)
    keys = list(blocks["trl"][0])
    summary = {who: {k: statistics.median(b[k] for b in bs) for k in keys} for who, bs in blocks.items()}
    ratio_trl = [g["samples_per_s"] / t["samples_per_s"] for g, t in zip(blocks["grpo"], blocks["trl"], strict=True)]
    ratio_trl_datc = [d["samples_per_s"] / t["samples_per_s"] for d, t in zip(blocks["datc"], blocks["trl"], strict=True)]
    ratio_credit = [d["step_s"] / g["step_s"] for d, g in zip(blocks["datc"], blocks["grpo"], strict=True)]
    return {"batch_size": B, "blocks": blocks, "median_over_repeats": summary,
            "grpo_over_trl_samples_per_s": spread(ratio_trl), "datc_over_trl_samples_per_s": spread(ratio_trl_datc),
            "datc_over_grpo_step_s": spread(ratio_credit)}


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


TESTBED_TARGETS = {"grpo_over_trl_samples_per_s": GRPO_TARGET, "datc_over_grpo_step_s": SCALES["testbed"].datc_target}


def render(res: dict[str, Any], other: dict[str, Any] | None = None) -> str:
    """One scale's results as markdown; with ``other`` (the other scale's results) a section puts
    both scales' ratios side by side."""
    th = res["throughput"]
    med = th["median_over_repeats"]
    r, rc, rd = th["grpo_over_trl_samples_per_s"], th["datc_over_grpo_step_s"], th["datc_over_trl_samples_per_s"]
    mem = res.get("memory", {})
    sl = res["same_loss"]
    real = res.get("scale", "testbed") != "testbed"
    targets = res.get("targets", TESTBED_TARGETS)
    gt, dt = targets["grpo_over_trl_samples_per_s"], targets["datc_over_grpo_step_s"]
    names = {"trl": f"TRL GRPOTrainer {res['machine']['trl']}", "grpo": "datc credit=grpo", "datc": "datc credit=datc"}

    def sp(x):
        return f"{x['median']:.2f} (min {x['min']:.2f}, max {x['max']:.2f}; quartiles {x['q1']:.2f} to {x['q3']:.2f})"

    lines = [
        "# This project's GRPO against TRL's GRPOTrainer" + (f": {SCALES[res['scale']].title}" if real else ""), "",
        f"Command: `{res['command']}`  ",
        f"Commit {res['commit']}, {res['date']}; torch {res['machine']['torch']}, transformers "
        f"{res['machine']['transformers']}, trl {res['machine']['trl']}; {res['threads']} torch thread(s), "
        f"{res['machine']['cpus']} CPU cores (shared with other jobs; load average "
        f"{res['load_average_1_5_15min']['start'][0]:.1f} at the start, {res['load_average_1_5_15min']['end'][0]:.1f} at the end).", "",
        f"Work per step: {res['work']}.", "",
        f"## Throughput: medians over {th['repeats']} interleaved repeats of {th['steps']} steps "
        f"(after {th['warmup']} warm-up steps, each block from the warm policy)", "",
        "| trainer | samples/s | response tokens/s | step (ms) | rollout | reward | ref + adv + credit | update | other | "
        "response len | peak RSS (MB) | RSS growth in steps (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for who in CONTESTANTS:
        m = med[who]
        mm = mem.get(who, {})
        lines.append(
            f"| {names[who]} | {m['samples_per_s']:.1f} | {m['tokens_per_s']:.0f} | {m['step_s'] * 1000:.1f} | "
            + " | ".join(f"{m[f'{p}_s'] * 1000:.1f}" for p in (*PHASES, "other"))
            + f" | {m['response_len']:.2f} | {mm.get('peak_rss_mb', math.nan):.0f} | {mm.get('step_growth_mb', math.nan):.0f} |")
    lines += [
        "", "Phase columns are medians in ms; TRL's are timed around its own methods (`_generate_single_turn`, "
        "`_calculate_rewards`, the rest of `_generate_and_score_completions`, and the remainder of the step).", "",
        f"**datc (credit=grpo) / TRL samples per second: {sp(r)}**  ",
        f"datc (credit=datc) / TRL samples per second: {sp(rd)}  ",
        f"**credit=datc / credit=grpo step time: {sp(rc)}**", "",
        f"## Same loss on the same batch (first step, on-policy, tolerance {sl['tolerance']:g} relative)", "",
        "| quantity | TRL | datc | agree |", "|---|---|---|---|",
        *[f"| {k} | {sl['trl'][k]:.7g} | {sl['datc'][k]:.7g} | {'yes' if sl['agree'][k] else 'NO'} |" for k in SAME_LOSS],
        "",
    ]
    if real:
        lines += [f"Prompt ids after the chat template: {'the same' if sl['same_prompt_ids'] else 'NOT the same'} on both "
                  f"sides ({sl['prompt_tokens']:.1f} tokens per prompt). Both policies were moved off their reference by "
                  f"the same Gaussian noise (scale {sl['perturb']:g}) so that the KL term and its gradient count.", ""]
    sc = res.get("scaling")
    if sc:
        lengths = ("responses forced to the budget with `min_new_tokens` on both sides" if res.get("force_length")
                   else "natural lengths")
        lines += ["## Scaling: median step time (ms)", "",
                  "Response length (responses forced to the budget with `min_new_tokens` on both sides; "
                  f"{res['work_batch']} responses per step):", "",
                  "| max_new_tokens | datc credit=grpo | TRL | TRL / datc |", "|---|---|---|---|",
                  *[f"| {x['max_new_tokens']} | {x['grpo']['step_s'] * 1000:.1f} | {x['trl']['step_s'] * 1000:.1f} | "
                    f"{x['trl']['step_s'] / x['grpo']['step_s']:.2f} |" for x in sc["length"]],
                  "", f"Group size (8 prompts per step, {lengths}):", "",
                  "| num_generations | responses | datc credit=grpo | TRL | TRL / datc |", "|---|---|---|---|---|",
                  *[f"| {x['num_generations']} | {x['batch_size']} | {x['grpo']['step_s'] * 1000:.1f} | "
                    f"{x['trl']['step_s'] * 1000:.1f} | {x['trl']['step_s'] / x['grpo']['step_s']:.2f} |" for x in sc["group"]],
                  ""]
    if other is not None:
        tb, rl = (other, res) if real else (res, other)
        lines += side_by_side(tb, rl)
    g, d, t = med["grpo"], med["datc"], med["trl"]
    extra = {p: (d[f"{p}_s"] - g[f"{p}_s"]) * 1000 for p in (*PHASES, "other")}
    # by how much a target is missed (the testbed's lines as they were: the figure alone)
    short = f"; {gt - r['median']:.2f} short" if real and r["median"] < gt else ""
    over = f"; {rc['median'] - dt:.2f} over" if real and rc["median"] > dt else ""
    lines += [
        "## Targets", "",
        f"- credit=grpo at least {gt:g}x TRL's samples/s: **{'met' if r['median'] >= gt else 'not met'}** "
        f"({r['median']:.2f}x{short}). Per phase, TRL minus datc (ms): "
        + ", ".join(f"{p} {(t[f'{p}_s'] - g[f'{p}_s']) * 1000:+.1f}" for p in (*PHASES, "other")) + ".",
        f"- credit=datc at most {dt:.2f}x the step time of credit=grpo: **{'met' if rc['median'] <= dt else 'not met'}** "
        f"({rc['median']:.2f}x{over}). What credit=datc adds (ms): reward {extra['reward']:+.1f} (the reward model's backward "
        f"to its inputs), ref + adv + credit {extra['prep']:+.1f} (the credit scores), other {extra['other']:+.1f} "
        f"(after the update: credit diagnostics and metrics), rollout {extra['rollout']:+.1f}, update {extra['update']:+.1f}.",
        f"- Profile of this project's credit=grpo step: `{res.get('profile_file', 'trl_profile.txt')}`.", "",
    ]
    if res.get("notes"):
        lines += ["## Notes", "", *res["notes"], ""]
    return "\n".join(lines)


def _short_work(res: dict[str, Any]) -> str:
    """The work per step without the settings both scales share: prompts, responses, tokens."""
    return res["work"].split(", temperature")[0]


def _verdict(x: float, target: float, at_least: bool) -> str:
    """Whether a ratio meets its target, and by how much it misses."""
    if (x >= target) if at_least else (x <= target):
        return f"met ({x:.2f} against {target:.2f})"
    return f"**not met** ({x:.2f} against {target:.2f}: {abs(x - target):.2f} {'short' if at_least else 'over'})"


def side_by_side(tb: dict[str, Any], rl: dict[str, Any]) -> list[str]:
    """The testbed's and the real model's figures and ratios next to each other: how each
    ratio moves from the testbed's scale to the real one."""
    cols = (tb, rl)

    def med(res, who, key):
        return res["throughput"]["median_over_repeats"][who][key]

    def ratio(res, key):
        x = res["throughput"][key]
        return f"{x['median']:.2f} ({x['q1']:.2f} to {x['q3']:.2f})"

    def row(label, f):
        return f"| {label} | " + " | ".join(f(res) for res in cols) + " |"

    def params(res):
        n = res.get("policy_params")
        return f"{n / 1e6:.1f}M" if n else "n/a"

    def phase_ratio(res, ps):
        trl, ours = (sum(med(res, who, f"{p}_s") for p in ps) for who in ("trl", "grpo"))
        # under 0.1% of TRL's: the work moved to another phase (the shared trunk's reference pass)
        return "n/a (moved)" if ours < 1e-3 * trl else f"{trl / ours:.2f}"

    def share(res, p):
        return f"{100 * med(res, 'grpo', f'{p}_s') / med(res, 'grpo', 'step_s'):.0f}%"

    def added(res, p):
        return f"{100 * (med(res, 'datc', f'{p}_s') - med(res, 'grpo', f'{p}_s')) / med(res, 'grpo', 'step_s'):+.1f}%"

    def targets(res):
        return res.get("targets", TESTBED_TARGETS)

    labels = {"rollout": "rollout", "reward": "reward", "prep": "ref + adv + credit", "update": "update", "other": "other"}
    lines = [
        "## Scaling: the testbed to a real model", "",
        f"Each column from its own run (testbed: `{SCALES['testbed'].stem}.json`, commit {tb['commit']}, {tb['date']}; real "
        f"model: `{SCALES['real'].stem}.json`, commit {rl['commit']}, {rl['date']}). Times are medians over repeats, "
        "ratios the median over repeats (quartiles); shares and additions are percentages of the credit=grpo step.", "",
        f"| | {SCALES['testbed'].title} | {SCALES['real'].title} |", "|---|---|---|",
        row("policy parameters", params),
        row("work per step", _short_work),
        row("response tokens per step", lambda res: f"{med(res, 'grpo', 'response_len') * res['throughput']['batch_size']:.0f}"),
        row("step, datc credit=grpo (ms)", lambda res: f"{med(res, 'grpo', 'step_s') * 1000:.1f}"),
        row("step, TRL (ms)", lambda res: f"{med(res, 'trl', 'step_s') * 1000:.1f}"),
        row("step, datc credit=datc (ms)", lambda res: f"{med(res, 'datc', 'step_s') * 1000:.1f}"),
        row("**datc (credit=grpo) / TRL samples/s**", lambda res: ratio(res, "grpo_over_trl_samples_per_s")),
        *[row(f"TRL / datc time: {labels[p]}", lambda res, p=p: phase_ratio(res, (p,))) for p in PHASES],
        row("TRL / datc time: reward + ref + adv + credit", lambda res: phase_ratio(res, ("reward", "prep"))),
        *[row(f"credit=grpo step share: {labels[p]}", lambda res, p=p: share(res, p)) for p in (*PHASES, "other")],
        row("**credit=datc / credit=grpo step time**", lambda res: ratio(res, "datc_over_grpo_step_s")),
        *[row(f"credit=datc adds: {labels[p]}", lambda res, p=p: added(res, p)) for p in ("reward", "prep", "other")],
        row("target: credit=grpo / TRL samples/s", lambda res: _verdict(
            res["throughput"]["grpo_over_trl_samples_per_s"]["median"], targets(res)["grpo_over_trl_samples_per_s"], True)),
        row("target: credit=datc / credit=grpo step", lambda res: _verdict(
            res["throughput"]["datc_over_grpo_step_s"]["median"], targets(res)["datc_over_grpo_step_s"], False)),
        "",
    ]
    return lines


def load_results(out: Path, scale: str) -> dict[str, Any] | None:
    """A scale's results file in ``out``, or None where it has not been run."""
    path = out / f"{SCALES[scale].stem}.json"
    return json.loads(path.read_text()) if path.exists() else None


def write_markdown(out: Path) -> list[Path]:
    """Render each scale's markdown from its results file in ``out``, with the side-by-side
    section where both scales have results. Returns the files written."""
    from datc.utils import atomic_write_text

    res = {k: load_results(out, k) for k in SCALES}
    written = []
    for k, other in (("testbed", "real"), ("real", "testbed")):
        if res[k] is not None:
            path = out / f"{SCALES[k].stem}.md"
            atomic_write_text(path, render(res[k], res[other]))
            written.append(path)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=list(SCALES), default="testbed",
                    help="testbed (tiny GPT-2) or real (experiment=real_smollm2); sets the defaults marked below")
    ap.add_argument("--steps", type=int, help="measured steps per block (testbed 10, real 2)")
    ap.add_argument("--warmup", type=int, help="unmeasured steps at the start of each block (testbed 2, real 1)")
    ap.add_argument("--repeats", type=int, help="interleaved blocks per trainer (testbed 5, real 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the testbed machine is shared)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4, help="relative tolerance of the same-loss check")
    ap.add_argument("--max-new-tokens", type=int, help="response budget on both sides (testbed: the config's 16, real 48)")
    ap.add_argument("--natural-length", action="store_true",
                    help="responses end at their EOS (real: forced to the budget with min_new_tokens by default)")
    ap.add_argument("--lengths", type=int, nargs="*", help="scaling: response budgets (testbed 8 16 32)")
    ap.add_argument("--groups", type=int, nargs="*", help="scaling: group sizes (testbed 4 8 16)")
    ap.add_argument("--scaling-steps", type=int, default=4)
    ap.add_argument("--memory-steps", type=int, help="steps of each memory run (testbed 4, real 1)")
    ap.add_argument("--profile-steps", type=int, help="steps of each profile (testbed 5, real 1)")
    ap.add_argument("--scaling", action=argparse.BooleanOptionalAction,
                    help="the length and group sweeps (testbed on, real off: hours at that scale)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=str(OUT), help="directory for the results (testbed: trl.json, trl.md, trl_profile.txt; "
                    "real: trl_real.*)")
    ap.add_argument("--combine", action="store_true",
                    help="measure nothing: re-render both scales' markdown from their JSON files in --out")
    ap.add_argument("--memory-child", choices=CONTESTANTS, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="hydra overrides, e.g. policy=tiny_llama")
    a = ap.parse_args()
    sc = SCALES[a.scale]
    for k, v in sc.defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    overrides = [*sc.overrides, *a.overrides]
    T = a.max_new_tokens or sc.max_new_tokens
    force = sc.force_length and not a.natural_length
    work = {"max_new_tokens": T, "force_length": force}
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    torch.set_num_threads(a.threads)
    from datc.utils import atomic_write_json, atomic_write_text, keep_freed_memory, quiet_libraries

    kept = keep_freed_memory()  # as datc-train does (trainer.keep_freed_memory); process-wide: TRL's blocks get it too
    quiet_libraries()
    out = Path(a.out)
    if a.combine:
        for path in write_markdown(out):
            print(f"wrote {path}")
        return
    if a.memory_child:
        print(json.dumps(memory_child(a.memory_child, overrides, a.memory_steps, **work)))
        return
    import transformers
    import trl

    t_start = time.time()
    load_start = os.getloadavg()
    sl = same_loss_check(overrides, a.tol, sc.perturb, **work)
    print("same loss:", json.dumps(sl), file=sys.stderr)
    if not sl["ok"]:
        raise SystemExit(f"scripts/bench.py: the two trainers do not compute the same loss on the same batch: {sl}")
    th = measure(overrides, a.steps, a.warmup, a.repeats, a.seed, **work)
    th.update(steps=a.steps, warmup=a.warmup, repeats=a.repeats)
    s = datc_session(overrides, T)
    t = s.c.trainer
    micro = (f" in micro-batches of {t.micro_batch_size} (TRL per_device_train_batch_size {t.micro_batch_size}, "
             f"gradient_accumulation_steps {t.batch_size // t.micro_batch_size})" if t.micro_batch_size < t.batch_size else "")
    tokens = (f"{t.max_new_tokens} tokens each (forced with min_new_tokens on both sides)" if force
              else f"up to {t.max_new_tokens} tokens")
    res: dict[str, Any] = {
        "command": " ".join(["python scripts/bench.py", *sys.argv[1:]]),
        "commit": _git("rev-parse", "--short", "HEAD") + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else ""),
        "date": datetime.date.today().isoformat(), "threads": a.threads,
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
                    "trl": trl.__version__, "cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine()},
        "work": (f"{t.batch_size // t.num_generations} prompts x {t.num_generations} responses, {tokens}, "
                 f"temperature {t.temperature}, top-p {t.top_p}, beta {t.beta}, clip {t.epsilon_low}/{t.epsilon_high}, "
                 f"{t.loss_agg} (TRL dapo), AdamW lr {t.lr}, one optimizer step per rollout{micro}; policy {s.c.policy.name}, "
                 f"data {s.c.data.name}"),
        "work_batch": t.batch_size, "scale": a.scale, "max_new_tokens": t.max_new_tokens, "force_length": force,
        "policy_params": sum(p.numel() for p in s.m.policy.parameters()),
        "targets": {"grpo_over_trl_samples_per_s": GRPO_TARGET, "datc_over_grpo_step_s": sc.datc_target},
        "keep_freed_memory": kept, "same_loss": sl, "throughput": th, "notes": list(sc.notes),
    }
    del s
    if not a.no_memory:
        child = ("--scale", a.scale, *(("--max-new-tokens", str(T)) if T else ()), *(("--natural-length",) if a.natural_length else ()))
        res["memory"] = peak_memory(a.overrides, a.memory_steps, a.threads, child)
    if a.scaling:
        res["scaling"] = scaling(overrides, a.lengths, a.groups, a.scaling_steps, a.warmup, a.seed, **work)
    out.mkdir(parents=True, exist_ok=True)
    if not a.no_profile:
        prof = profile_datc(overrides, a.profile_steps, warm=a.warmup, **work)
        res["profile_file"] = f"{sc.stem}_profile.txt"
        atomic_write_text(out / res["profile_file"], f"# Profile of datc credit={prof['credit']}, {prof['steps']} steps "
                          f"(`{res['command']}`)\n\n## cProfile, cumulative\n\n{prof['cprofile_cumulative']}\n\n"
                          f"## torch ops, self CPU time\n\n{prof['torch_ops']}\n")
    res["wall_s"] = round(time.time() - t_start, 1)
    res["load_average_1_5_15min"] = {"start": load_start, "end": os.getloadavg()}
    atomic_write_json(out / f"{sc.stem}.json", res)
    write_markdown(out)  # this scale's markdown, and the other's where it has results (the side-by-side section)
    print((out / f"{sc.stem}.md").read_text())


if __name__ == "__main__":
    main()
