"""The loss and update phase: ``epochs`` passes over the rollout batch in mini-batches, one
optimizer step each, through the session's :class:`datc.backends.base.PolicyOptimizer`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from datc.batch import Rollout
from datc.forward.passes import checkpointed_layers
from datc.math.correction import is_weights, mismatch_sums, weight_stats
from datc.math.losses import AggNorm, aggregate
from datc.math.numerics import NonFiniteReport, loss_is_finite
from datc.step.plan import StepPlan

_SUMMED = ("total", "kl", "clip_frac", "ratio", "entropy")  # summed over ranks: each rank's share of the mini-batch


@dataclass
class LossInputs:
    """What the loss reads of the step's earlier phases (B responses on this rank, T positions)."""

    ro: Rollout  # the sampled batch (its logits already freed)
    mask: Tensor  # (B, T) bool, the loss mask (after the reward phase's guards)
    token_adv: Tensor  # (B, T) Â = A · w, the credit's per-token advantages
    old_logps: Tensor | None  # (B, T) the rollout policy's log-probs; None: on-policy (the current ones, ratio 1)
    ref_logps: Tensor | None  # (B, T) the reference's log-probs; None: no KL term
    nonfinite: NonFiniteReport  # where the update records a non-finite micro-batch loss


def update(s, x: LossInputs, plan: StepPlan) -> dict[str, float]:
    """Mini-batches accumulated over micro-batches; the aggregation normalizers are the
    mini-batch's, so the accumulated gradient equals the mini-batch's gradient. A non-finite
    micro-batch loss is not backpropagated (recorded in ``nf``); a mini-batch left without any
    gradient, or with a non-finite gradient norm, takes no optimizer step (``skipped_steps``).

    With W data-parallel ranks each holds 1/W of every mini-batch: the normalizers are the
    global mini-batch's (token counts summed over ranks) and the optimizer scales each rank's
    loss by W, so the reduced gradient is again exactly the mini-batch's. When the optimizer's
    reductions are collective every rank must run the same backward passes, so a non-finite
    micro-batch loss is zeroed token-wise rather than skipped. ``old_logps`` None: on-policy
    (the current log-probs, ratio 1); ``ref_logps`` None: no KL term."""
    ro, mask, token_adv, old_logps, ref_logps, nf = x.ro, x.mask, x.token_adv, x.old_logps, x.ref_logps, x.nonfinite
    t, dist, opt = s.c.trainer, s.dist, s.optim
    W = opt.world_size
    B, T = ro.response_ids.shape
    mini = t.mini_batch_size // W
    micro_size = min(t.micro_batch_size, mini)
    passes = plan.update_passes  # shared prompts as the plan says (not under activation checkpointing or FSDP2)
    sums = dict.fromkeys(("kl", "clip_frac", "ratio", "entropy", "total", "grad_norm", "skipped_steps"), 0.0)
    n_tok_total, n_updates = 0.0, 0
    lr = opt.lr  # the rate of this step's first update (read after the updates, it was the next step's)
    checkpointing = checkpointed_layers(opt.module) if plan.grad_checkpoint else contextlib.nullcontext()
    mismatch = Mismatch()
    with checkpointing:  # the decoder blocks' activations recomputed in the backward (trainer.gradient_checkpointing)
        for epoch in range(t.epochs):
            order = torch.randperm(B) if mini < B else torch.arange(B)
            for mb in order.split(mini):
                norm = AggNorm(num_seqs=len(mb) * W, num_tokens=dist.sum(mask[mb].sum()), norm_len=T)
                if norm.num_tokens == 0:  # every response masked (e.g. all truncated with mask_truncated):
                    sums["skipped_steps"] += 1  # no step, or Adam's momentum alone would move the policy
                    opt.skip()
                    n_updates += 1
                    continue
                opt.zero_grad()
                backpropagated = 0
                for micro in mb.split(micro_size):
                    logps, ent = passes.token_logps(opt.module, ro, micro, plan.head_chunk)
                    old = old_logps[micro] if old_logps is not None else logps.detach()
                    mk = mask[micro]
                    w = None
                    if plan.sync_engine:  # the engine sampled with its own copy: π_train / π_sampler
                        sampled = ro.sampler_logps[micro]
                        w = is_weights(old, sampled, mk, plan.correction, plan.correction_cap)
                        if epoch == 0:  # each token's gap once
                            mismatch.add(mismatch_sums(old, sampled, ro.response_mask[micro]),
                                         None if w is None else weight_stats(w, mk))
                    out = s.ops.loss(logps, old, token_adv[micro], t.epsilon_low, t.epsilon_high, t.beta,
                                     ref_logps[micro] if ref_logps is not None else None, is_weight=w)
                    loss = aggregate(out.loss, mk, t.loss_agg, norm)
                    if not loss_is_finite(loss):  # never backpropagate NaN/inf
                        nf.nonfinite_micro_batches += 1
                        nf.add("loss", torch.zeros(B, dtype=torch.bool).index_fill_(0, micro.cpu(), True))
                        if not opt.collective:
                            continue
                        loss = aggregate(torch.where(torch.isfinite(out.loss), out.loss, torch.zeros_like(out.loss)), mk,
                                         t.loss_agg, norm)
                    opt.backward(loss)
                    backpropagated += 1
                    mkf = mk.float()
                    with torch.no_grad():
                        sums["total"] += float(loss)
                        sums["clip_frac"] += float((out.clipped.float() * mkf).sum())
                        sums["ratio"] += float((out.ratio * mkf).sum())
                        sums["entropy"] += float((ent * ro.response_mask[micro]).sum())
                        if out.kl is not None:
                            sums["kl"] += float((out.kl * mkf).sum())
                    n_tok_total += float(mkf.sum())
                grad_norm, skipped = opt.step(backpropagated)
                sums["skipped_steps"] += skipped
                sums["grad_norm"] += grad_norm
                n_updates += 1
    # the global mini-batch's figures (each rank's loss is its share of it; one process: as they are)
    sums = {k: dist.sum(v) if k in _SUMMED else v for k, v in sums.items()}
    n_tok = max(dist.sum(n_tok_total), 1.0)
    n_resp_tok = dist.sum(ro.response_mask.sum())
    return {
        **(mismatch.metrics(dist) if plan.sync_engine else {}),
        "total": sums["total"] / n_updates,
        "kl": sums["kl"] / n_tok,
        "clip_frac": sums["clip_frac"] / n_tok,
        "ratio": sums["ratio"] / n_tok,
        "grad_norm": sums["grad_norm"] / n_updates,
        "skipped_steps": sums["skipped_steps"],
        "lr": lr,
        "entropy": sums["entropy"] / max(n_resp_tok * t.epochs, 1.0),
    }


class Mismatch:
    """The sampler-vs-trainer gap over one step's tokens (:mod:`datc.math.correction`), summed over
    micro-batches and ranks: ``rollout/sampler_logp_diff_mean`` and ``_max`` (|log π_train −
    log π_sampler|, TRL's ``sampling/sampling_logp_difference``), ``rollout/sampler_kl`` (k3
    estimate of KL(π_sampler ‖ π_train)) and, with a correction, ``rollout/is_ratio_min``,
    ``_mean``, ``_max`` (TRL's ``sampling/importance_sampling_ratio``)."""

    def __init__(self) -> None:
        self.gap = {"abs": 0.0, "k3": 0.0, "max": 0.0, "tokens": 0.0}
        self.ratio: dict[str, float] | None = None

    def add(self, gap: dict[str, float], ratio: dict[str, float] | None) -> None:
        for k in ("abs", "k3", "tokens"):
            self.gap[k] += gap[k]
        self.gap["max"] = max(self.gap["max"], gap["max"])
        if ratio is not None:
            r = self.ratio or {"min": float("inf"), "sum": 0.0, "max": float("-inf"), "n": 0.0}
            self.ratio = {"min": min(r["min"], ratio["min"]), "sum": r["sum"] + ratio["sum"],
                          "max": max(r["max"], ratio["max"]), "n": r["n"] + ratio["n"]}

    def metrics(self, dist) -> dict[str, float]:
        tokens = max(dist.sum(self.gap["tokens"]), 1.0)
        out = {"rollout/sampler_logp_diff_mean": dist.sum(self.gap["abs"]) / tokens,
               "rollout/sampler_logp_diff_max": dist.max(self.gap["max"]),
               "rollout/sampler_kl": dist.sum(self.gap["k3"]) / tokens}
        if self.ratio is not None:
            out["rollout/is_ratio_min"] = -dist.max(-self.ratio["min"])
            out["rollout/is_ratio_mean"] = dist.sum(self.ratio["sum"]) / max(dist.sum(self.ratio["n"]), 1.0)
            out["rollout/is_ratio_max"] = dist.max(self.ratio["max"])
        return out
