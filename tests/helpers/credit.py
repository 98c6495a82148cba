"""The credit-scheme tests' batch: a small float64 batch with every tensor input a DATC-family
scheme reads (hand-checked and brute-force tests compare against it)."""

from __future__ import annotations

import torch

from datc.credit.base import CreditBatch

F64 = torch.float64


def make_batch(seed: int = 0, B: int = 3, T: int = 5, V: int = 9, d: int = 4, lengths=(5, 4, 2),
               advantages=(0.8, -1.1, 0.5), logit_scale: float | None = 2.0, generator: bool = False) -> CreditBatch:
    """A (B, T) batch of random ids, masks of ``lengths`` (first B), float64 ``advantages`` (first
    B), RM gradients (B, T, d), an RM embedding (V, d) and, unless ``logit_scale`` is None, policy
    logits (B, T, V) times ``logit_scale``; drawn in that order from a generator seeded ``seed``.
    ``generator``: also a generator for random schemes, seeded ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(V, (B, T), generator=gen)
    rm_grad = torch.randn(B, T, d, generator=gen, dtype=F64)
    rm_embedding = torch.randn(V, d, generator=gen, dtype=F64)
    logits = torch.randn(B, T, V, generator=gen, dtype=F64) * logit_scale if logit_scale is not None else None
    return CreditBatch(
        response_ids=ids, response_mask=torch.arange(T) < torch.tensor(list(lengths))[:B, None],
        advantages=torch.tensor(list(advantages), dtype=F64)[:B], rm_grad=rm_grad, rm_embedding=rm_embedding,
        policy_logits=logits, generator=torch.Generator().manual_seed(seed) if generator else None,
    )
