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

    python -m scripts.bench [--scale testbed|real] [--steps N] [--warmup N] [--repeats N] [--threads 1] [hydra overrides ...]
    python -m scripts.bench --combine   # re-render trl.md and trl_real.md from their JSON files

Run from the repository root. Modules: ``scales`` (scales, targets, the notes of notes.md),
``stats`` (pure figures), ``datc_side`` (this project's session and step: the only module that
calls ``datc.training.trainer``), ``trl_side`` (TRL's trainer and reward callable), ``same_loss`` (1),
``measure`` (2 to 5), ``render`` (the markdown), ``cli`` (the command).

The package also holds this project's own benchmarks, each a command of its own that writes to
results/bench/: ``credit`` (``python -m scripts.bench.credit``: DATC's cost, credit.{json,md}),
``credit_precision`` (the exact credit's error at lower matmul precision), ``decode`` (the decode
loops on CPU, decode_cpu.{json,md}), ``edit_scores`` (``rm_counterfactual``'s edit scoring) and
``threads`` (step time against torch threads); and ``engines``, ``flops``, ``compile_probe`` and
``job_memory`` (see each module).
"""
