"""Group-relative advantages (METHOD §1), as pure tensor functions."""

from __future__ import annotations

import torch
from torch import Tensor

SCALE_EPS = 1e-4  # TRL's GRPOTrainer adds 1e-4 to the std


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: str = "group", eps: float = SCALE_EPS) -> Tensor:
    """``A_i = (r_i - mean_group(r)) / (std + eps)``.

    Matches TRL ``GRPOTrainer`` (``scale_rewards`` = ``"group"``, ``"batch"``, ``"none"``):
    the mean is over the prompt's group of ``num_generations`` consecutive responses; the std is
    the unbiased (Bessel-corrected, ``torch.std``) std of the group (``group``), of the whole
    batch (``batch``), or omitted (``none``, Dr. GRPO). A group whose rewards are all equal
    gets ``A = 0`` exactly (METHOD §1): the float32 mean of equal values can miss them by a
    rounding step, and that step over ``std + eps`` (std about 0) gave advantages up to about
    0.02, so such groups are found by ``max == min`` and set to 0. Every other group is
    computed as TRL computes it, in the rewards' dtype.

    rewards: (B,) with B = groups * num_generations, groups laid out contiguously.
    returns: (B,)
    """
    grouped = rewards.view(-1, num_generations)  # (groups, G)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale_rewards == "group":
        std = grouped.std(dim=1).repeat_interleave(num_generations)
        adv = adv / (std + eps)
    elif scale_rewards == "batch":
        adv = adv / (rewards.std() + eps)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")
    equal = grouped.amax(dim=1) == grouped.amin(dim=1)  # (groups,) False for a NaN group
    return torch.where(equal.repeat_interleave(num_generations), 0.0, adv)
