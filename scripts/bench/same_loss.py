"""1. Same loss: one rollout batch through both trainers' own code; the benchmark stops unless
the loss, the gradient norm, the rewards, the advantages and the prompt ids agree."""

from __future__ import annotations

import copy
from typing import Any

import torch

from scripts.bench.datc_side import datc_session, learn
from scripts.bench.scales import SAME_LOSS
from scripts.bench.stats import close
from scripts.bench.trl_side import build_trl, trl_prompt, unpadded


def perturb_(model, scale: float, seed: int) -> None:
    """Add the same seeded Gaussian noise to every parameter (by name, so two copies of one
    architecture get identical weights), moving the policy off its reference so the KL term
    and its gradient are not zero in the same-loss check."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g) * scale)


def same_loss_check(overrides: list[str], tol: float, perturb: float = 0.02, max_new_tokens: int | None = None,
                    force_length: bool = False) -> dict[str, Any]:
    """First step, on-policy, same weights: one rollout batch sampled once from the policy
    goes through TRL's pipeline (with generation replaced by that batch: its prompt rendering,
    padding, reference pass, reward call and advantages, then ``compute_loss`` and the backward
    per micro-batch as its ``training_step`` does them) and through this project's
    step after its rollout (``datc_side.learn``). Both policies get the same small
    perturbation (``perturb``) first, so the reference (the warm policy) differs and the KL term
    counts. Returns both sides' figures, and whether both rendered the prompts to the same ids."""
    from datc.engines.generate import sample_groups

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

    # This project: step 0 on the same batch (train_step after its rollout; the loss is read before the step).
    m = learn(s, 0, ro)
    ours = {"loss": m["loss/total"], "grad_norm": m["loss/grad_norm"], "reward_mean": m["reward/total"],
            "advantage_abs": m["reward/advantage_abs"], "kl": m["loss/kl"], "tokens": float(ro.response_mask.sum())}
    agree = {k: close(trl[k], ours[k], tol) for k in SAME_LOSS}
    return {"tolerance": tol, "trl": trl, "datc": ours, "agree": agree, "same_prompt_ids": same_prompts,
            "prompt_tokens": float(ro.prompt_mask.sum()) / len(ro.examples), "perturb": perturb,
            "ok": all(agree.values()) and same_prompts}
