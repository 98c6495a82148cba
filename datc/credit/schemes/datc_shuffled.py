"""``datc_shuffled``: DATC's weights randomly permuted within each response (METHOD §3), which
isolates the allocation of credit from its spread.

The weight step runs after the scheme and is permutation-equivariant within a response (the
z-score, softmax, linear map, ranks, mixing and clipping treat tokens symmetrically), so
permuting DATC's *scores* among a response's valid tokens yields exactly DATC's weights,
permuted. The permutation is uniform, drawn with ``batch.generator`` (a fixed seed, 0, when it
is None, so runs are reproducible); masked positions stay in place. All fields are DATC's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from datc.credit import register_credit
from datc.credit.base import POLICY_LOGITS, RM_EMBEDDING, RM_GRAD, CreditBatch
from datc.credit.schemes.datc import DATCParams, datc_token_scores

DEFAULT_SEED = 0  # used when the batch carries no generator


def permute_valid(x: Tensor, mask: Tensor, generator: torch.Generator | None) -> Tensor:
    """Permute the valid entries of each row of ``x`` (B, T) uniformly at random among the
    row's valid positions; masked entries stay where they are. Returns (B, T)."""
    if generator is None:
        generator = torch.Generator().manual_seed(DEFAULT_SEED)
    keys = torch.rand(mask.shape, generator=generator, device=generator.device).to(mask.device)
    T = mask.shape[-1]
    pos = torch.arange(T, device=mask.device).expand_as(mask)
    # Sorting puts each row's valid positions first: in order (targets), in random order (sources).
    targets = torch.where(mask, pos, pos + T).argsort(dim=-1)
    sources = torch.where(mask, keys, 2.0).argsort(dim=-1)
    return torch.empty_like(x).scatter(-1, targets, x.gather(-1, sources))


@register_credit(
    "datc_shuffled",
    needs={RM_GRAD, RM_EMBEDDING, POLICY_LOGITS},
    output="scores",
    row_local=True,  # per-token scores, per-response weights: computed a micro-batch of rows at a time
    # not row_separable: the permutations are drawn for the rows in turn, so leaving out the rows
    # with A = 0 would give the others other permutations
    params=DATCParams,
)
def datc_shuffled(batch: CreditBatch, params: DATCParams) -> Tensor:
    """DATC's scores, randomly permuted among each response's valid tokens."""
    scores = datc_token_scores(batch, params)
    return permute_valid(scores, batch.response_mask, batch.generator)
