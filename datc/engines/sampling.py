"""One draw per row: the nucleus filter and the categorical draw, shared by both decode loops
(:func:`datc.engines.generate.sample_tokens`'s dynamic-cache loop and :mod:`datc.engines.static_decode`). The
nucleus filter and ``sample_categorical(..., sync_free=True)`` read no tensor's value on the
host, so they can run inside a captured CUDA graph.

Shapes: B rows, V vocabulary.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor


def top_p_filter(scores: Tensor, top_p: float) -> Tensor:
    """Nucleus filter, as transformers' ``TopPLogitsWarper`` (``min_tokens_to_keep=1``): the
    smallest-probability tokens whose cumulative mass is at most ``1 - top_p`` get ``-inf``."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p)
    remove[..., -1:] = False
    return scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))


def sample_categorical(probs: Tensor, sync_free: bool = False, generator: torch.Generator | None = None,
                       uniforms: Tensor | None = None) -> Tensor:
    """One draw per row of ``probs`` (B, V) by inverting its cumulative sum with one uniform
    number per row: the same distribution as ``torch.multinomial(probs, 1)``, at a small
    fraction of its cost on the CPU (multinomial was a sixth of the rollout). Tokens of
    probability 0 (top-p, banned EOS) are never drawn. -> (B,) long

    ``u * total`` can round up to the total, and then ``searchsorted`` answers V, past the end:
    that row takes the last token of positive probability. By default the host checks whether
    any row did (one synchronization; on CPU cheaper than the O(B·V) minimum below, about 0.1 ms
    a draw at the testbed's 64 x 192). ``sync_free``: the minimum with that index is taken for
    every row, which reads nothing on the host (the static decode step, captured as a CUDA
    graph) and draws the same tokens: an answer ``idx < V`` has ``cdf[idx - 1] <= u < cdf[idx]``,
    and past the last positive token the cdf stays at the total (adding zeros), so
    ``idx > last`` would give ``cdf[idx - 1] = total >= cdf[idx] > u``: every such answer is
    ``<= last`` already. ``generator``: the uniform numbers' stream (None: torch's global one; a
    sampler on another thread passes its own, :mod:`datc.engines.own_copy`). ``uniforms`` (B,):
    the rows' uniform numbers, drawn beforehand (:func:`row_uniforms`), instead of any stream."""
    cdf = probs.cumsum(-1)
    if uniforms is None:
        u = torch.rand(probs.shape[0], 1, device=probs.device, dtype=cdf.dtype, generator=generator)
    else:
        u = uniforms.to(device=probs.device, dtype=cdf.dtype).reshape(-1, 1)
    u = u * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).squeeze(1)
    V = probs.shape[1]
    if sync_free or bool((idx >= V).any()):
        last = V - 1 - (probs > 0).flip(-1).to(torch.uint8).argmax(-1)  # (B,) the last positive-probability token
        idx = torch.minimum(idx, last)
    return idx


def row_seed(prompt_seed: int, index: int) -> int:
    """The seed of the ``index``-th response to a prompt of seed ``prompt_seed``
    (:func:`datc.engines.base.prompt_seeds`), a hash of both to 32 bits: torch's CPU generator
    (a Mersenne Twister) keeps only a seed's low 32 bits."""
    h = hashlib.blake2b(f"{int(prompt_seed)}:{int(index)}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little")


def row_uniforms(prompt_seeds: list[int], num_generations: int, max_new_tokens: int, device=None) -> Tensor:
    """``trainer.deterministic``: every uniform number the draws of a rollout use, each response's
    row from its own CPU generator seeded by (its prompt's seed, its index in the group):
    (B = len(prompt_seeds) * G, T) float32. A response's draws then depend on its prompt's seed
    alone, not on the rank that samples it, the batch it is in or the device (B generator calls a
    rollout)."""
    out = torch.empty(len(prompt_seeds) * num_generations, max_new_tokens)
    for i, seed in enumerate(prompt_seeds):
        for j in range(num_generations):
            g = torch.Generator().manual_seed(row_seed(seed, j))
            out[i * num_generations + j] = torch.rand(max_new_tokens, generator=g)
    return out if device is None else out.to(device)
