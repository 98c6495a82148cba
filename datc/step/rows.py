"""Select → compute → scatter: a computation over some rows of a batch, made whole.

The zero-advantage skip (``trainer.skip_zero_advantage``) computes credit only for the
responses with ``A != 0``; the others take fixed values. :func:`on_rows` is that pattern once:
the rows are selected, computed on, and scattered into the whole batch's values.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor


def on_rows(rows: Tensor, n: int, compute: Callable[[Tensor | None], dict[str, Tensor | None]],
            rest: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
    """``compute(rows)``'s named (k, ...) outputs for the rows ``rows`` (k,) long of an n-row batch,
    scattered into ``rest``, the n-row values the other rows keep (its rows ``rows`` are
    overwritten; a None there takes an uninitialized tensor). When ``rows`` is every row,
    ``compute(None)`` runs on the whole batch and its outputs are returned as they are (no
    select, no copy). An output that is not a tensor (None, a label) leaves ``rest``'s value."""
    if rows.numel() == n:
        return compute(None)
    out = dict(rest)
    if rows.numel() == 0:
        return out
    for k, v in compute(rows).items():
        if not isinstance(v, Tensor):  # None, or a value of the whole batch (rest's stands)
            continue
        whole = out.get(k)
        whole = v.new_empty((n, *v.shape[1:])) if whole is None else whole.to(v.dtype)
        whole[rows.to(whole.device)] = v
        out[k] = whole
    return out
