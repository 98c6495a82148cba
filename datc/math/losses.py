"""The clipped GRPO surrogate, the k3 KL penalty and loss aggregation (METHOD §1).

Pure tensor functions. The per-token loss is kept apart from its aggregation, as verl does
(``compute_policy_loss`` / ``agg_loss``), so every aggregation mode composes with every loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def k3(d: Tensor) -> Tensor:
    """``exp(d) - d - 1`` elementwise: Schulman's k3 estimate of a KL divergence from a log-ratio
    ``d`` (>= 0, 0 iff ``d = 0``). The one copy: the KL penalty, the evaluation's KL, the
    sampler/trainer gap and GCPO's guidance score all call it."""
    return torch.exp(d) - d - 1


def kl_k3(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Schulman's k3 estimator of ``KL(π_θ || π_ref)`` per token:
    ``exp(ref - logp) - (ref - logp) - 1`` (TRL ``GRPOTrainer``; verl ``kl_penalty="low_var_kl"``
    without its clamp). Non-negative, unbiased for the sampled token. (B, T) -> (B, T)."""
    return k3(ref_logps - logps)


@dataclass
class PolicyLossOut:
    loss: Tensor  # (B, T) per-token loss, before masking and aggregation
    ratio: Tensor  # (B, T) importance ratio exp(logp - old_logp)
    clipped: Tensor  # (B, T) bool, True where the clipped term was the active (smaller) one
    kl: Tensor | None  # (B, T) k3 KL, when beta > 0


def clipped_policy_loss(
    logps: Tensor,
    old_logps: Tensor,
    token_advantages: Tensor,
    epsilon_low: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logps: Tensor | None = None,
    is_weight: Tensor | None = None,
) -> PolicyLossOut:
    """``-w · min(ρ Â, clip(ρ, 1-ε_low, 1+ε_high) Â) + β KL_k3``, per token.

    Identical to TRL ``GRPOTrainer._compute_loss`` (``coef_1``/``coef_2``, ``per_token_kl``) and
    verl ``compute_policy_loss_vanilla`` without dual clip. All inputs (B, T); ``Â`` already
    carries the credit weights and gets no gradient. ``is_weight`` ``w``: the sampler/trainer
    importance-sampling correction (:func:`datc.math.correction.is_weights`, (B, T) or (B, 1), no
    gradient), multiplied into the surrogate before the KL term is added, as TRL applies its
    ``importance_sampling_ratio``; None: ``w = 1``.
    """
    ratio = torch.exp(logps - old_logps)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    unclipped_obj = ratio * token_advantages
    clipped_obj = clipped_ratio * token_advantages
    loss = -torch.min(unclipped_obj, clipped_obj)
    if is_weight is not None:
        loss = loss * is_weight.detach()
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        kl = kl_k3(logps, ref_logps)
        loss = loss + beta * kl
    return PolicyLossOut(loss, ratio.detach(), (clipped_obj < unclipped_obj).detach(), kl)


@dataclass(frozen=True)
class AggNorm:
    """Normalizers of a whole (mini-)batch, so that micro-batches sum to the batch's loss."""

    num_seqs: int  # responses in the mini-batch
    num_tokens: float  # valid tokens in the mini-batch
    norm_len: int  # constant length for seq-mean-token-sum-norm (the response budget)


def aggregate(loss: Tensor, mask: Tensor, mode: str, norm: AggNorm) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    - ``token-mean``: ``Σ loss·mask / Σ mask`` over the mini-batch. verl
      ``loss_agg_mode="token-mean"``; TRL ``loss_type="dapo"`` (and ``"bnpo"`` on one process).
    - ``seq-mean-token-mean``: each response's token mean, then the mean over responses. verl
      ``"seq-mean-token-mean"``; TRL ``loss_type="grpo"`` (the original GRPO).
    - ``seq-mean-token-sum-norm``: each response's token sum divided by a constant ``norm_len``
      (the response budget), then the mean over responses. verl ``"seq-mean-token-sum-norm"``
      (with ``loss_scale_factor = max_new_tokens``); TRL ``loss_type="dr_grpo"`` (Dr. GRPO).

    ``norm`` holds the mini-batch's counts, so the sum of this function over micro-batches
    equals its value on the whole mini-batch (gradient accumulation is exact).
    """
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * mask).sum() / max(norm.num_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / norm.num_seqs
    if mode == "seq-mean-token-sum-norm":
        return (loss * mask).sum() / (norm.norm_len * norm.num_seqs)
    raise ValueError(f"loss_agg must be token-mean, seq-mean-token-mean or seq-mean-token-sum-norm, got {mode!r}")
