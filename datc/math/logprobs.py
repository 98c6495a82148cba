"""Per-token log-probabilities and entropies from logits, without materializing full
log-probabilities over the vocabulary for the whole batch."""

from __future__ import annotations

import torch
from torch import Tensor

# Rows per chunk are chosen so that one chunk's float32 temporaries stay near 2^22 values
# (16 MB): the testbed's whole batch is one chunk (no Python loop), a real vocabulary with long
# responses goes one row at a time (no full-batch log-probabilities over the vocabulary).
CHUNK_ELEMENTS = 2**22


def rows_per_chunk(logits: Tensor, chunk: int | None) -> int:
    """``chunk`` if given, else as many rows as fit in ``CHUNK_ELEMENTS`` values (at least 1)."""
    if chunk is not None:
        return chunk
    return max(1, CHUNK_ELEMENTS // max(1, logits[0].numel()))


def selective_log_softmax(logits: Tensor, index: Tensor, chunk: int | None = None) -> Tensor:
    """``log_softmax(logits)[..., index]`` computed per chunk of rows: ``z_y - logsumexp(z)``
    (as TRL's ``selective_log_softmax``). logits (B, T, V), index (B, T) -> (B, T) float32."""
    chunk = rows_per_chunk(logits, chunk)
    parts = []
    for i in range(0, logits.shape[0], chunk):
        z = logits[i : i + chunk].float()
        parts.append(z.gather(-1, index[i : i + chunk, :, None]).squeeze(-1) - torch.logsumexp(z, -1))
    return torch.cat(parts)


@torch.no_grad()
def entropy_from_logits(logits: Tensor, chunk: int | None = None) -> Tensor:
    """Entropy of ``softmax(logits)`` in nats, per position. (B, T, V) -> (B, T) float32."""
    chunk = rows_per_chunk(logits, chunk)
    out = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
    for i in range(0, logits.shape[0], chunk):
        logp = torch.log_softmax(logits[i : i + chunk].float(), -1)
        out[i : i + chunk] = -(logp.exp() * logp).sum(-1)
    return out


def _head_chunk(head, h: Tensor, index: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    z = head(h).float()
    if temperature != 1.0:
        z = z / temperature
    logps = z.gather(-1, index[..., None]).squeeze(-1) - torch.logsumexp(z, -1)
    with torch.no_grad():
        logp = torch.log_softmax(z.detach(), -1)
        ent = -(logp.exp() * logp).sum(-1)
    return logps, ent


def chunked_head_logps(head, hidden: Tensor, index: Tensor, temperature: float, chunk: int) -> tuple[Tensor, Tensor]:
    """Log-probs of ``index`` under ``softmax(head(hidden) / temperature)`` and the entropies
    (nats, no gradient), ``chunk`` positions at a time, so that no (B, T, V) logits exist: each
    chunk's LM head and log-softmax run under activation checkpointing, so the backward keeps
    only the (B, chunk, V) logits of the chunk it is in (the fused linear-cross-entropy idea of
    Liger's ``LigerFusedLinearCrossEntropyLoss``, here without a custom kernel). ``head``: the
    LM head (a module or function, (…, d) -> (…, V)); hidden (B, T, d), index (B, T) long.
    The same values as :func:`selective_log_softmax` of the whole logits, up to the rounding of
    the LM head's product over fewer rows. -> ((B, T) float32 with a graph, (B, T) float32)"""
    from torch.utils.checkpoint import checkpoint

    logps, ents = [], []
    for s in range(0, hidden.shape[1], chunk):
        h, ix = hidden[:, s : s + chunk], index[:, s : s + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(_head_chunk, head, h, ix, temperature, use_reentrant=False)
        else:
            lp, ent = _head_chunk(head, h, ix, temperature)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps, 1), torch.cat(ents, 1)
