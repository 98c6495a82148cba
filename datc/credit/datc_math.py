"""DATC's per-token scores (METHOD §2, steps 2-4) as pure tensor functions.

Per token ``t`` (one row): ``g`` (d,) the reward gradient at the token's reward-model input
embedding, ``E`` (V, d) the reward model's input-embedding matrix, ``z`` (V,) the rollout
policy's logits, ``π = softmax(z)``, ``y`` the sampled id, ``ρ = E g`` (V,) and

- force ``f``: ``jacobian``: ``f = (diag π - π πᵀ) ρ = π ⊙ (ρ - π·ρ)``;
  ``identity``: ``f = ρ - mean_v ρ``;
- displacement ``u = sign · (e_y - π)``;
- score ``s``: ``projection`` ``⟨f,u⟩/‖u‖``, ``work`` ``⟨f,u⟩``, ``cosine``
  ``⟨f,u⟩/(‖f‖‖u‖)``; a zero denominator gives ``s = 0`` (no displacement or no force), a
  NaN one (a NaN reward gradient) ``s = NaN``;
  a row with a NaN or ``+inf`` logit, or whose sampled token's logit is ``-inf``, gives
  ``s = NaN``, so its response falls back to ``w = 1`` in the weight step. Any other ``-inf``
  logit is a vocabulary entry of probability 0 (masked or padded rows, banned tokens): the
  score is computed through it with ``π_v = 0``.

The fast functions use METHOD's cheap identities, in a form that keeps relative precision when
``π`` is peaked. Every score is unchanged by adding a constant to all entries of ``ρ``, so ``ρ``
is taken relative to the mode ``m`` of ``π``, ``ρ'_v = g·(E_v - E_m)``; with ``D = π - e_m`` and
``Q = π² - (Σπ²) e_m`` (exact entry-wise: their ``m`` entries are minus sums of the others),

- ``π·ρ' = g · (D E) = D · ρ``, ``Σ_v π_v² ρ'_v = g · (Q E) = Q · ρ`` (METHOD's ``πᵀE`` and
  ``(π²)ᵀE``, shifted by ``E_m``): on the whole vocabulary from one ``[chunk, d] × [d, V]``
  product ``ρ = E g``, with top-k from the support's rows of ``E``; ``ρ'_y = g · (E_y - E_m)``;
- ``⟨f_jac, e_y - π⟩ = π_y ρ'_y + (Σπ² - π_y) (π·ρ') - Σ_v π_v² ρ'_v``;
- ``⟨f_id, e_y - π⟩ = ρ_y - π·ρ = ρ'_y - π·ρ'``;
- ``‖e_y - π‖² = (1 - π_y)² + Σ_{v≠y} π_v²``, with ``1 - π_y = Σ_{v≠y} π_v``.

``ρ`` is formed for one chunk of rows at a time (on the support with top-k ``work`` or
``projection``, it is never formed: two products with the support's rows of ``E``); ``cosine``
and the magnitude score also need ``‖f‖`` from it. Rows are processed in
chunks, so the extra memory is ``O(chunk · V)`` (``O(chunk · k · d)`` with ``top_k``) and no
``(N, V, d)`` tensor is built. Computation is in float32 (float64 if any input is float64).

``top_k``: ``π`` is replaced by its ``k`` largest entries, renormalised (the force and the
displacement both use the truncated ``π``; ``identity``'s force does not involve ``π``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from datc.credit.low_precision import (  # noqa: F401  (check_matmul_dtype: importable from here as before)
    MATMUL_DTYPES,
    check_matmul_dtype,
    low_precision_embedding,
    low_product,
)

LOGIT_MAPS = ("jacobian", "identity")
ALIGNMENTS = ("projection", "work", "cosine")
CHUNK_BYTES = 64 * 2**20  # chunk_size None: rows per chunk so that one (chunk, V) temporary fits in this


@torch.no_grad()
def datc_scores(
    g: Tensor,
    E: Tensor,
    logits: Tensor,
    y: Tensor,
    sign: Tensor,
    *,
    logit_map: str = "jacobian",
    alignment: str = "projection",
    chunk_size: int | None = None,
    top_k: int | None = None,
    rows: Tensor | None = None,
    matmul_dtype: str = "float32",
) -> Tensor:
    """DATC alignment scores ``s_t`` (METHOD §2 steps 2-4), via the closed forms.

    Args:
        g: (M, d) reward gradients ``∂R/∂h_t``.
        E: (V, d) reward-model input-embedding matrix.
        logits: (M, V) rollout-policy logits ``z_t``.
        y: (M,) long, sampled token ids.
        sign: (M,) ``sign(A_i)`` of each token's response, in {-1, 0, 1} (ones: unsigned).
        logit_map: ``jacobian`` | ``identity``.
        alignment: ``projection`` | ``work`` | ``cosine``.
        chunk_size: rows per chunk; bounds the extra memory to ``O(chunk_size · V)``. None: as
            many rows as keep one (chunk, V) temporary within ``CHUNK_BYTES`` (at the testbed's
            192 words every token in one chunk, where per-chunk overhead is the cost; at 49k
            words 341 rows in float32).
        top_k: keep the ``k`` largest entries of ``π_t`` (renormalised); None: exact.
        rows: (N,) long, the rows to score (e.g. the valid tokens of a flattened batch), gathered
            one chunk at a time so ``logits`` is never copied whole; None: all M rows.
        matmul_dtype: precision of the exact credit's ``|V|``-wide work (``top_k`` None,
            ``alignment`` projection or work): ``float32`` (the computation dtype throughout);
            ``bfloat16``: ``ρ = E g`` as a bf16 product with float32 accumulation, ``π``'s
            ``(chunk, V)`` passes and the two row products ``D·ρ``, ``Q·ρ`` in bf16 with float32
            accumulation, the softmax itself and every per-row quantity in float32; ``tf32``:
            ``ρ = E g`` on TF32 tensor cores (on a CPU emulated: both operands rounded to TF32's
            10-bit mantissa, then a float32 product), the rest float32. Both low precisions take
            ``E`` centred (``E - mean_v E_v``): a constant added to every ``ρ_v`` leaves each score
            unchanged, and centring keeps a common component of the embeddings out of the
            rounding. Errors against float64: results/bench/credit_precision.md.

    Returns:
        (N,) scores, float32 (float64 if any input is float64); NaN on a row whose logits hold
        a NaN or a ``+inf``, or put the sampled token at ``-inf``.
    """
    check_options(logit_map, alignment, chunk_size, top_k)
    check_matmul_dtype(matmul_dtype, alignment, top_k)
    _check_shapes(g, E, logits, y, sign)
    dtype = _compute_dtype(g, E, logits)
    E = E.to(dtype)
    need_rho = alignment == "cosine"
    out = []
    with _no_autocast(g):
        E_low = low_precision_embedding(E, matmul_dtype)  # once per call, not per chunk
        for sel in _chunks(g.shape[0], rows, chunk_rows(chunk_size, E.shape[0], dtype)):
            z = logits[sel]  # gathered once: for the terms and the non-finite check
            work, u_norm, f_norm = _chunk_terms(g[sel].to(dtype), E, z, y[sel], logit_map, top_k, need_rho,
                                                matmul_dtype, E_low)
            signed = sign[sel].to(dtype) * work
            if alignment == "work":
                score = signed
            elif alignment == "projection":
                score = _safe_div(signed, u_norm)
            else:
                score = _safe_div(signed, f_norm * u_norm)
            out.append(_nan_where_nonfinite(score, z, y[sel]))
    return _cat(out, g, dtype)


@torch.no_grad()
def force_norm(
    g: Tensor,
    E: Tensor,
    logits: Tensor,
    *,
    logit_map: str = "jacobian",
    chunk_size: int | None = None,
    top_k: int | None = None,
    rows: Tensor | None = None,
) -> Tensor:
    """``‖f_t‖``, the magnitude of the reward force in logit space (``datc_magnitude``).

    Shapes and options as in :func:`datc_scores`; returns (N,). Needs ``ρ_t`` one chunk at a
    time.
    """
    check_options(logit_map, "work", chunk_size, top_k)
    _check_shapes(g, E, logits)
    dtype = _compute_dtype(g, E, logits)
    E = E.to(dtype)
    out = []
    with _no_autocast(g):
        for sel in _chunks(g.shape[0], rows, chunk_rows(chunk_size, E.shape[0], dtype)):
            z = logits[sel]  # the displacement terms are unused, so any ids serve as y
            _, _, f_norm = _chunk_terms(g[sel].to(dtype), E, z, z.argmax(-1), logit_map, top_k, True)
            out.append(_nan_where_nonfinite(f_norm, z))
    return _cat(out, g, dtype)


@torch.no_grad()
def rm_saliency(g: Tensor, E: Tensor, y: Tensor) -> Tensor:
    """``|g_t · E[y_t]|`` (METHOD §3 ``rm_saliency``): g (N, d), E (V, d), y (N,) -> (N,).

    Gradient-times-input saliency of the reward model; ignores the policy.
    """
    dtype = _compute_dtype(g, E)
    return (g.to(dtype) * E[y].to(dtype)).sum(-1).abs()


def chunk_rows(chunk_size: int | None, vocab: int, dtype: torch.dtype = torch.float32) -> int:
    """Rows per chunk: ``chunk_size``, or with None as many as keep one (rows, vocab) tensor of
    ``dtype`` within ``CHUNK_BYTES`` (at least 1)."""
    if chunk_size is not None:
        return chunk_size
    return max(1, CHUNK_BYTES // (vocab * dtype.itemsize))


def check_options(logit_map: str, alignment: str, chunk_size: int | None, top_k: int | None) -> None:
    """Raise ValueError naming the option and its valid values if one is out of range."""
    if logit_map not in LOGIT_MAPS:
        raise ValueError(f"logit_map must be one of {LOGIT_MAPS}, got {logit_map!r}")
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None (sized by memory) or an integer >= 1, got {chunk_size!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")


# ---- internals -------------------------------------------------------------------------------
def _chunk_terms(
    g: Tensor,
    E: Tensor,
    logits: Tensor,
    y: Tensor,
    logit_map: str,
    top_k: int | None,
    need_rho: bool,
    matmul_dtype: str = "float32",
    E_low: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """For one chunk of c rows: ``⟨f, e_y - π⟩`` (c,), ``‖e_y - π‖`` (c,) and, if ``need_rho``,
    ``‖f‖`` (c,) (else None).

    ``π`` is held on a support of K entries: the whole vocabulary (``sup`` None) or the top-k ids
    ``sup`` (c, K). ``ρ`` is taken relative to the mode ``m`` of ``π``: ``ρ'_v = g·(E_v - E_m)``.
    Every term below is then of the order of the result even when ``π`` is peaked (the mode's
    entries, which would cancel, are written as minus sums of the other entries);
    ``ρ'`` on the support is formed only if ``need_rho``.
    """
    dtype = g.dtype
    pi = torch.softmax(logits.to(dtype), dim=-1)  # (c, V)
    if top_k is None or top_k >= pi.shape[-1]:
        if not need_rho:
            return _full_vocab_terms(g, E, pi, y, logit_map, matmul_dtype, E_low)
    sup = None
    if top_k is not None and top_k < pi.shape[-1]:
        pi, sup = pi.topk(top_k, dim=-1)  # (c, K), (c, K), sorted: the mode first
        pi = pi / pi.sum(-1, keepdim=True)
        at_m = torch.zeros_like(pi, dtype=torch.bool)
        at_m[:, 0] = True
        m, at_y = sup[:, 0], sup == y[:, None]  # at_y is all False if y is off the support
    else:
        m = pi.argmax(-1)
        at_m = torch.zeros_like(pi, dtype=torch.bool).scatter(-1, m[:, None], True)
        at_y = torch.zeros_like(pi, dtype=torch.bool).scatter(-1, y[:, None], True)
    pi_y = torch.where(at_y, pi, 0.0).sum(-1)  # (c,)
    not_y = torch.where(at_y, 0.0, pi)  # (c, K)
    u_norm = (not_y.sum(-1).square() + not_y.square().sum(-1)).sqrt()  # ‖e_y - π‖
    not_m = torch.where(at_m, 0.0, pi)  # (c, K)
    pi_m, not_m_sum, not_m_sq = (pi - not_m).sum(-1), not_m.sum(-1), not_m.square().sum(-1)
    s2_minus_pi_y = not_m_sq - pi_m * not_m_sum + (pi_m - pi_y)  # Σπ² - π_y, (c,)
    E_m = E[m]  # (c, d)
    rho_y = (g * (E[y] - E_m)).sum(-1)  # (c,) ρ'_y, exactly 0 when y = m
    E_sup = E[sup] if sup is not None else None  # (c, K, d), top-k only

    if need_rho:
        rho = g @ E.T if sup is None else torch.einsum("cd,ckd->ck", g, E_sup)  # (c, K)
        rho_rel = torch.where(at_m, 0.0, rho - (g * E_m).sum(-1, keepdim=True))  # ρ' on support
        pi_rho = (pi * rho_rel).sum(-1)  # (c,) π·ρ'
        if logit_map == "jacobian":
            work = pi_y * rho_y + s2_minus_pi_y * pi_rho - (pi.square() * rho_rel).sum(-1)
            f_norm = (pi * (rho_rel - pi_rho[:, None])).norm(dim=-1)
        else:
            work = rho_y - pi_rho
            rho_full = rho if sup is None else g @ E.T  # identity's force spans the vocabulary
            f_norm = (rho_full - rho_full.mean(-1, keepdim=True)).norm(dim=-1)
        return work, u_norm, f_norm

    # The two products, with π - e_m and π² - (Σπ²) e_m (exact entry-wise) for πᵀE and (π²)ᵀE.
    if sup is None:
        d_e = torch.where(at_m, -not_m_sum[:, None], pi) @ E  # (c, d) Σ_v π_v (E_v - E_m)
    else:
        E_rel = E_sup - E_m[:, None, :]  # (c, K, d)
        d_e = torch.einsum("ck,ckd->cd", pi, E_rel)
    pi_rho = (g * d_e).sum(-1)  # (c,) π·ρ'
    if logit_map == "identity":
        return rho_y - pi_rho, u_norm, None
    if sup is None:
        q_e = torch.where(at_m, -not_m_sq[:, None], pi.square()) @ E  # Σ_v π_v² (E_v - E_m)
    else:
        q_e = torch.einsum("ck,ckd->cd", pi.square(), E_rel)
    work = pi_y * rho_y + s2_minus_pi_y * pi_rho - (g * q_e).sum(-1)
    return work, u_norm, None


def _full_vocab_terms(g: Tensor, E: Tensor, pi: Tensor, y: Tensor, logit_map: str, matmul_dtype: str = "float32",
                      E_low: Tensor | None = None) -> tuple[Tensor, Tensor, None]:
    """``_chunk_terms`` on the whole vocabulary with one ``[c, d] × [d, V]`` product, in as few
    ``(c, V)`` passes and tensors as the same precision allows: ``π`` (consumed: overwritten in
    place) with the mode's entry zeroed gives the sums over the other entries, then that entry is
    overwritten with minus their sum (``D = π - e_m``); squared in place with the same entry
    rewritten it is ``Q = π² - (Σπ²) e_m`` (no masks, no copies: ``π``, ``ρ`` and nothing else of
    size ``(c, V)``). ``ρ = E g`` is formed once and ``π·ρ' = D·ρ``, ``Σ_v π_v² ρ'_v = Q·ρ``: the
    same sums as ``g · (D E)`` and ``g · (Q E)`` with the same rounding order of magnitude (each
    term ``π_v (ρ_v - ρ_m)``, the mode's written as minus the others), for half the multiply-adds
    of the two products.

    ``matmul_dtype`` bfloat16 (``E_low``: the centred bf16 ``E``): ``π`` is rounded to bf16 once
    its mode and sampled entries are read in float32, its passes and ``ρ`` are bf16, and every
    sum accumulates in float32; tf32: ``ρ`` from a TF32 product, the rest float32."""
    dtype = g.dtype
    rows = torch.arange(pi.shape[0], device=pi.device)
    pi_m, m = pi.max(-1)  # (c,), (c,)
    pi_y = pi.gather(-1, y[:, None]).squeeze(-1)  # (c,)
    a = pi if matmul_dtype != "bfloat16" else pi.to(torch.bfloat16)  # π with the mode's entry zeroed, in place
    a[rows, m] = 0.0
    not_m_sum = a.sum(-1, dtype=dtype)  # Σ_{v≠m} π_v, exact even when π is peaked
    not_m_sq = _rowdot(a, a).to(dtype)  # Σ_{v≠m} π_v²
    y_is_m = y == m
    # ‖e_y - π‖² = (Σ_{v≠y} π_v)² + Σ_{v≠y} π_v²; if y ≠ m then π_y ≤ 1/2 and nothing cancels.
    not_y_sum = torch.where(y_is_m, not_m_sum, not_m_sum + pi_m - pi_y)
    not_y_sq = torch.where(y_is_m, not_m_sq, not_m_sq + pi_m.square() - pi_y.square())
    u_norm = (not_y_sum.square() + not_y_sq).sqrt()
    s2_minus_pi_y = not_m_sq - pi_m * not_m_sum + (pi_m - pi_y)  # Σπ² - π_y
    E_m = E[m]  # (c, d)
    rho_y = (g * (E[y] - E_m)).sum(-1)  # ρ'_y, exactly 0 when y = m
    rho = g @ E.T if E_low is None else low_product(g, E_low, matmul_dtype)  # (c, V) ρ = E g, one product
    a[rows, m] = (-not_m_sum).to(a.dtype)  # D
    pi_rho = _rowdot(a, rho).to(dtype)  # π·ρ' = Σ_v π_v (ρ_v - ρ_m)
    if logit_map == "identity":
        return rho_y - pi_rho, u_norm, None
    a.square_()
    a[rows, m] = (-not_m_sq).to(a.dtype)  # Q
    work = pi_y * rho_y + s2_minus_pi_y * pi_rho - _rowdot(a, rho).to(dtype)  # Σ_v π_v² (ρ_v - ρ_m)
    return work, u_norm, None


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise dot products of two (c, V) tensors, (c,), without a (c, V) temporary."""
    return (a[:, None, :] @ b[:, :, None]).reshape(-1)


def _nan_where_nonfinite(score: Tensor, logits: Tensor, y: Tensor | None = None) -> Tensor:
    """NaN for the rows (c,) whose logits (c, V) hold a NaN or a ``+inf``, or whose sampled id
    ``y`` (c,) has a ``-inf`` logit (every entry ``-inf`` without ``y``), else ``score``.

    A NaN or ``+inf`` logit makes ``π`` NaN, which ``_safe_div``'s zero-denominator rule would
    silently turn into a score of 0; a NaN score instead makes the weight step give the whole
    response ``w = 1`` (METHOD §2.5). A ``-inf`` logit elsewhere is an entry of probability 0
    (``softmax`` gives exactly 0 there, and every term is finite): the score stands, so a logit
    processor that bans tokens does not turn DATC into GRPO. The sampled token itself at
    ``-inf`` has probability 0, impossible under the policy: it falls back.

    A row's sum is finite only if all its entries are (a NaN or an inf makes it NaN or inf), so
    one reduction settles every row whose sum is finite; only the others (non-finite entries,
    or finite entries whose sum overflows) are tested entry by entry."""
    ok = torch.isfinite(logits.sum(-1))
    if not bool(ok.all()):
        rows = (~ok).nonzero().squeeze(-1)
        z = logits[rows]
        bad = torch.isnan(z).any(-1) | (z == torch.inf).any(-1)
        if y is None:
            bad |= (z == -torch.inf).all(-1)
        else:
            bad |= z.gather(-1, y[rows][:, None]).squeeze(-1) == -torch.inf
        ok[rows] = ~bad
    return torch.where(ok, score, torch.nan)


def _no_autocast(like: Tensor):
    """No autocast on ``like``'s device: the products stay in the computation dtype (float32 or
    float64) inside a bf16 training step's autocast region."""
    return torch.autocast(like.device.type, enabled=False)


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` where ``den > 0``, else 0 (a zero norm means no displacement or force);
    NaN where either is NaN (a NaN reward gradient must fall back, not score 0)."""
    zero_or_nan = torch.where(torch.isnan(num) | torch.isnan(den), torch.nan, 0.0)
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), zero_or_nan)


def _chunks(m: int, rows: Tensor | None, chunk_size: int) -> Iterator[slice | Tensor]:
    """Row selectors covering ``rows`` (or 0..m-1) in order, ``chunk_size`` at a time."""
    n = m if rows is None else rows.numel()
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        yield slice(start, stop) if rows is None else rows[start:stop]


def _cat(parts: list[Tensor], like: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=like.device)


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _check_shapes(
    g: Tensor, E: Tensor, logits: Tensor, y: Tensor | None = None, sign: Tensor | None = None
) -> None:
    m, d = g.shape
    v, d_e = E.shape
    if d != d_e:
        raise ValueError(f"reward gradient width {d} != embedding width {d_e}")
    if logits.shape != (m, v):
        raise ValueError(
            f"logits {tuple(logits.shape)} must be (rows, V) = ({m}, {v}); a policy vocabulary "
            "that differs from the reward model's (e.g. padded differently) must be aligned first"
        )
    for name, t in (("y", y), ("sign", sign)):
        if t is not None and t.shape != (m,):
            raise ValueError(f"{name} {tuple(t.shape)} must be ({m},)")
