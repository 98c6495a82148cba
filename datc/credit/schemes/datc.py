"""``datc``: the full method of METHOD §2 (credit as work), and the helpers its ablations share.

Score per valid token: the reward model's input-embedding gradient mapped into the policy's
logit space (``logit_map``), aligned (``alignment``) with the signed GRPO displacement
``sign(A_i) (e_{y_t} - π_t)`` (``direction``), computed by :func:`datc.credit.datc_math.datc_scores`
from the rollout logits. The shared weight step (:mod:`datc.credit.weights`) turns the scores
into weights with mean 1 per response.

Choices: only valid tokens are scored (gathered one chunk at a time from the flattened batch, so
the logits are never copied whole); masked positions get score 0. ``sign(A_i)`` is
``torch.sign``, so a response with ``A_i = 0`` scores 0 everywhere and falls back to ``w = 1``
(its weights do not matter: ``Â = 0``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from datc.credit import register_credit
from datc.credit.base import POLICY_LOGITS, RM_EMBEDDING, RM_GRAD, CreditBatch
from datc.credit.datc_math import check_matmul_dtype, check_options, datc_scores
from datc.credit.weights import WeightParams

DIRECTIONS = ("signed", "unsigned")


@dataclass
class DATCParams(WeightParams):
    """The weight step's fields plus the DATC switches (METHOD §2 steps 2-4)."""

    logit_map: str = "jacobian"  # jacobian | identity: how the reward force enters logit space
    direction: str = "signed"  # signed | unsigned: multiply the displacement by sign(A_i) or not
    alignment: str = "projection"  # projection | work | cosine: score of force vs displacement
    chunk_size: int | None = None  # tokens per chunk, extra memory O(chunk_size * V); None: sized by memory
    top_k: int | None = None  # keep the k most likely tokens of pi_t (renormalised); None: exact
    matmul_dtype: str = "float32"  # float32 | bfloat16 | tf32: the exact credit's |V|-wide products (datc_math.datc_scores)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        check_options(self.logit_map, self.alignment, self.chunk_size, self.top_k)
        check_matmul_dtype(self.matmul_dtype, self.alignment, self.top_k)


def flat_valid(batch: CreditBatch) -> tuple[Tensor, Tensor, Tensor]:
    """Flattened views for per-token math: rm_grad (B·T, d), response ids (B·T,) and the rows
    (N,) of the valid tokens."""
    B, T = batch.response_mask.shape
    g = batch.rm_grad.reshape(B * T, -1)
    rows = batch.response_mask.reshape(-1).nonzero().squeeze(-1)
    return g, batch.response_ids.reshape(-1), rows


def scatter_valid(values: Tensor, rows: Tensor, mask: Tensor) -> Tensor:
    """(N,) values of the valid rows -> (B, T) with 0 at masked positions."""
    out = torch.zeros(mask.numel(), dtype=values.dtype, device=values.device)
    return out.index_copy(0, rows, values).view(mask.shape)


def datc_token_scores(batch: CreditBatch, params: DATCParams) -> Tensor:
    """(B, T) DATC scores of every valid token, 0 where masked."""
    B, T = batch.response_mask.shape
    g, y, rows = flat_valid(batch)
    sign = torch.ones(B, device=g.device)
    if params.direction == "signed":
        sign = torch.sign(batch.advantages).to(g.device)
    scores = datc_scores(
        g,
        batch.rm_embedding,
        batch.policy_logits.reshape(B * T, -1),
        y,
        sign[:, None].expand(B, T).reshape(-1),
        logit_map=params.logit_map,
        alignment=params.alignment,
        chunk_size=params.chunk_size,
        top_k=params.top_k,
        rows=rows,
        matmul_dtype=params.matmul_dtype,
    )
    return scatter_valid(scores, rows, batch.response_mask)


@register_credit(
    "datc", needs={RM_GRAD, RM_EMBEDDING, POLICY_LOGITS}, output="scores", params=DATCParams, row_local=True,
    row_separable=True,
)
def datc(batch: CreditBatch, params: DATCParams) -> Tensor:
    """DATC: the reward force in logit space, projected on the signed GRPO displacement."""
    return datc_token_scores(batch, params)
