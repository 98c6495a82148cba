"""The sampler/trainer mismatch: its figures, and the importance-sampling correction for it.

An inference engine (vLLM) samples with its own kernels, so the probability it gave a sampled
token, ``π_sampler``, differs slightly from the trainer's ``π_train`` of the same weights
(another matmul order, another attention kernel, bf16 rounding). The policy gradient then uses
samples from ``π_sampler`` as if they came from ``π_train``. Truncated importance sampling
(TIS; Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
2025) re-weights each token's policy-gradient term by ``ρ = π_train / π_sampler``, capped.

Pure tensor functions. The modes and their formulas are TRL's
(``GRPOTrainer``: ``vllm_importance_sampling_mode`` / ``vllm_importance_sampling_cap``):

- ``token_truncate``: ``ρ_t = min(exp(log π_train_t − log π_sampler_t), C)`` per token (TIS;
  verl's ``rollout_is`` with ``rollout_is_level="token"``, ``rollout_is_mode="truncate"``).
- ``token_mask``: ``ρ_t`` as above, set to 0 where it exceeds C (the token is dropped).
- ``sequence_truncate``: ``ρ = min(exp(Σ_t (log π_train_t − log π_sampler_t)), C)`` over the
  response's valid tokens, one ratio for all its tokens (verl ``rollout_is_level="sequence"``).
- ``sequence_mask``: the sequence ratio, 0 where it exceeds C (TRL's default mode, cap 3).

``log π_train`` is the trainer's log-prob of the sampled token under the rollout's weights (the
loss's "old" log-probs), detached: ρ carries no gradient. It multiplies the clipped surrogate's
per-token term before the KL term is added, as TRL does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from datc.math.losses import k3

MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def is_weights(train_logps: Tensor, sampler_logps: Tensor, mask: Tensor, mode: str, cap: float) -> Tensor | None:
    """The correction's weights: (B, T) for the ``token_*`` modes, (B, 1) for ``sequence_*``
    (broadcast over the response's tokens); None for ``none``. ``train_logps`` and
    ``sampler_logps`` (B, T), ``mask`` (B, T) the valid tokens (padding contributes nothing
    to a sequence's ratio)."""
    if mode == "none":
        return None
    if mode not in MODES:
        raise ValueError(f"importance-sampling mode {mode!r}; choose one of {', '.join(MODES)}")
    diff = (train_logps.detach().float() - sampler_logps.float()) * mask.float()
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio.clamp(max=cap)
    return ratio.masked_fill(ratio > cap, 0.0)


def mismatch_sums(train_logps: Tensor, sampler_logps: Tensor, mask: Tensor) -> dict[str, float]:
    """Sums over the valid tokens of the sampler-vs-trainer gap, to be reduced over
    micro-batches and ranks: ``abs`` Σ|log π_train − log π_sampler| (its mean is TRL's
    ``sampling/sampling_logp_difference/mean``), ``k3`` Σ (exp(d) − d − 1) with
    ``d = log π_train − log π_sampler`` (the k3 estimate of KL(π_sampler ‖ π_train) on the
    sampler's own samples, verl's ``rollout_corr/kl`` family), ``max`` the largest |gap| and
    ``tokens`` the count."""
    m = mask.bool()
    d = (train_logps.detach().float() - sampler_logps.float())[m]
    if d.numel() == 0:
        return {"abs": 0.0, "k3": 0.0, "max": 0.0, "tokens": 0.0}
    return {"abs": float(d.abs().sum()), "k3": float(k3(d).sum()), "max": float(d.abs().max()),
            "tokens": float(d.numel())}


def weight_stats(w: Tensor, mask: Tensor) -> dict[str, float]:
    """min, sum and max of the correction's weights over the valid tokens (``token_*``) or the
    responses (``sequence_*``, ``w`` (B, 1)), and their count: TRL's
    ``sampling/importance_sampling_ratio/{min,mean,max}`` before the reduction."""
    flat = w.flatten() if w.shape[-1] == 1 else w[mask.bool()]
    if flat.numel() == 0:
        return {"min": float("inf"), "sum": 0.0, "max": float("-inf"), "n": 0.0}
    return {"min": float(flat.min()), "sum": float(flat.sum()), "max": float(flat.max()), "n": float(flat.numel())}
