"""The reward model's inputs: the sampled response ids spliced after the reward model's prompt
prefix, never re-tokenized (:class:`RMInputs`, built by :func:`build_rm_inputs`; chat templates'
prefixes and suffixes by :mod:`datc.models.chat`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class RMInputs:
    """Reward-model inputs in two blocks of columns: the prompt prefix (columns ``< prefix_len``,
    left-padded; the same for every response to one prompt) and the continuation (the response,
    and the template's suffix if any; left-padded too, so the last column is every row's last
    token and the score is read there). The padding between the blocks is masked and skipped by
    the positions, so the model sees each row as ``prefix + continuation``; the split lets each
    distinct prefix be forwarded once (:mod:`datc.models.shared_prompt`). L = prefix_len + the
    continuation's width."""

    input_ids: Tensor  # (B, L) long
    attention_mask: Tensor  # (B, L) bool
    response_pos: Tensor  # (B, T) long: position in the RM input of response token t (valid where response_mask)
    mapped: Tensor | None = None  # (B, T) bool: tokens with a position (chat templates may leave the EOS without one)
    prefix_len: int = 0  # columns of the prefix block (0: no split known, forwarded whole)

    def select(self, rows: Tensor) -> RMInputs:
        """The inputs of responses ``rows`` (k,) long, padding kept as it is."""
        return RMInputs(self.input_ids[rows], self.attention_mask[rows], self.response_pos[rows],
                        None if self.mapped is None else self.mapped[rows], self.prefix_len)


def left_align_index(mask: Tensor) -> tuple[Tensor, Tensor]:
    """For rows whose padding ``~mask`` (B, L) is all on the right: ``src`` (B, L), the gather
    index along dim 1 that moves the padding to the left (token t to column ``t + shift``), and
    ``shift`` (B,)."""
    L = mask.shape[1]
    shift = (~mask).sum(-1)
    return (torch.arange(L, device=mask.device)[None, :] - shift[:, None]) % L, shift  # roll right by shift


def left_align(ids: Tensor, mask: Tensor, pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded rows (valid tokens first) shifted so their padding is all on the left:
    (ids, mask, shift (B,)), token t of a row moving to column ``t + shift``."""
    src, shift = left_align_index(mask)
    ids, mask = ids.gather(1, src), mask.gather(1, src)
    return torch.where(mask, ids, torch.full_like(ids, pad_id)), mask, shift


def build_rm_inputs(prefix_ids: Tensor, prefix_mask: Tensor, response_ids: Tensor, response_mask: Tensor, pad_id: int) -> RMInputs:
    """Splice the sampled response ids after the reward model's prompt prefix, never
    re-tokenizing them: the prefix block as given, then the response block shifted so its
    padding is on the left (:class:`RMInputs`).

    prefix_ids/prefix_mask (B, P) left-padded; response_ids/response_mask (B, T) right-padded.
    """
    resp, rmask, shift = left_align(response_ids, response_mask, pad_id)
    P, T = prefix_ids.shape[1], response_ids.shape[1]
    response_pos = P + torch.arange(T, device=resp.device)[None, :] + shift[:, None]
    response_pos = torch.where(response_mask, response_pos, torch.zeros_like(response_pos))
    prefix_ids = torch.where(prefix_mask, prefix_ids, torch.full_like(prefix_ids, pad_id))
    return RMInputs(torch.cat([prefix_ids, resp], 1), torch.cat([prefix_mask, rmask], 1), response_pos, prefix_len=P)
