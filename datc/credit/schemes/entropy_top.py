"""``entropy_top``: the high-entropy minority rule ("80/20", arXiv 2506.01939), METHOD §3.

Only the top ``ρ`` fraction of the batch's valid tokens by rollout entropy carry the advantage
(default ``ρ = 0.2``; the threshold is the batch's ``1 - ρ`` entropy quantile, ties kept). As
in the paper's code, the loss is averaged over the kept tokens only: the kept tokens get
``w = N_valid / N_kept`` and the others 0, so under ``token-mean`` aggregation the loss equals
the mean over kept tokens (normalization ``global``: the batch's mean weight is 1, a single
response's need not be).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from datc.credit import register_credit
from datc.credit.base import ENTROPY, CreditBatch


@dataclass
class EntropyTopParams:
    rho: float = 0.2  # fraction of the batch's tokens kept, highest rollout entropy first

    def __post_init__(self) -> None:
        if not 0.0 < self.rho <= 1.0:
            raise ValueError(f"rho must be in (0, 1], got {self.rho}")


@register_credit("entropy_top", needs={ENTROPY}, output="weights", normalization="global",
                 params=EntropyTopParams)
def entropy_top(batch: CreditBatch, params: EntropyTopParams) -> Tensor:
    """``N_valid / N_kept`` on the kept high-entropy tokens, 0 elsewhere. (B, T)"""
    mask = batch.response_mask
    ent = batch.entropy.double()
    valid = batch.rank_cat(ent[mask])  # the whole (global) batch's valid tokens
    if valid.numel() == 0:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    threshold = torch.quantile(valid, 1.0 - params.rho)
    kept = mask & (ent >= threshold)
    n_kept = batch.rank_sum(kept.sum().double())
    w = valid.numel() / n_kept.clamp(min=1)
    return torch.where(kept, w.to(torch.float32), torch.zeros((), dtype=torch.float32))
