"""The shared-prompt tests' batch: prompts repeated in groups, left-padded, with responses of
different lengths (also the shared trunk's and LoRA's tests'), and a count of a model's forwards."""

from __future__ import annotations

import torch

from datc.batch import Rollout

G, N, P, T = 3, 4, 6, 5  # 4 prompts x 3 responses


def grouped_rollout(vocab: int, seed: int = 0):
    """Left-padded prompts of 6, 3, 4 and 1 tokens, repeated G times; responses of 1 to T tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([6, 3, 4, 1])
    pmask = torch.arange(P)[None] >= (P - lens)[:, None]
    pids = torch.randint(5, vocab, (N, P), generator=g) * pmask
    pids, pmask = pids.repeat_interleave(G, 0), pmask.repeat_interleave(G, 0)
    rlen = torch.randint(1, T + 1, (N * G,), generator=g)
    rmask = torch.arange(T)[None] < rlen[:, None]
    rids = torch.randint(5, vocab, (N * G, T), generator=g) * rmask
    return Rollout(pids, pmask, rids, rmask, ~rmask.all(-1), [{}] * (N * G))


def forward_rows(model):
    """The number of rows each forward of ``model`` is called with."""
    rows = []
    model.register_forward_pre_hook(lambda mod, args, kw: rows.append(
        (kw.get("input_ids") if kw.get("input_ids") is not None else kw["inputs_embeds"]).shape[0]), with_kwargs=True)
    return rows
