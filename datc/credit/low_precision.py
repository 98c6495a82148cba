"""DATC's exact credit in a lower precision (``credit.matmul_dtype``: bfloat16 or tf32): the
reward model's embedding matrix centred and rounded once per call, and the one ``ρ = E g``
product in that precision. The measured error against float64 is in
``results/bench/credit_precision.md``; float32 stays the default."""

from __future__ import annotations

import torch
from torch import Tensor

MATMUL_DTYPES = ("float32", "bfloat16", "tf32")  # datc_scores' matmul_dtype (results/bench/credit_precision.md)


def check_matmul_dtype(matmul_dtype: str, alignment: str, top_k: int | None) -> None:
    """Raise ValueError naming ``matmul_dtype`` and its valid values, or where it does not apply."""
    if matmul_dtype not in MATMUL_DTYPES:
        raise ValueError(f"matmul_dtype must be one of {MATMUL_DTYPES}, got {matmul_dtype!r}")
    if matmul_dtype != "float32" and (top_k is not None or alignment == "cosine"):
        raise ValueError(f"matmul_dtype={matmul_dtype!r} applies to the exact credit (top_k null, alignment projection "
                         f"or work), got top_k={top_k!r}, alignment={alignment!r}; use matmul_dtype float32 there")


def round_to_tf32(x: Tensor) -> Tensor:
    """float32 ``x`` rounded to TF32 (10 mantissa bits, round half up on the bit pattern; the
    exponent unchanged): what a TF32 tensor core reads of a float32 operand."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def low_precision_embedding(E: Tensor, matmul_dtype: str) -> Tensor | None:
    """``E`` centred and in the product's precision (None for float32)."""
    if matmul_dtype == "float32":
        return None
    centred = E - E.mean(0, keepdim=True)
    if matmul_dtype == "bfloat16":
        return centred.to(torch.bfloat16)
    return centred.float() if E.device.type == "cuda" else round_to_tf32(centred)


def low_product(g: Tensor, E_low: Tensor, matmul_dtype: str) -> Tensor:
    """(c, V) ``ρ = E g`` (centred) in the low precision: bf16 out of a bf16 GEMM, or float32 out
    of a TF32 one."""
    if matmul_dtype == "bfloat16":
        return g.to(torch.bfloat16) @ E_low.T
    if g.device.type != "cuda":
        return round_to_tf32(g) @ E_low.T
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return g.float() @ E_low.T
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
