"""DATC's per-token math (METHOD §2 steps 2-4, §4): datc.credit.datc_math.

Float64 throughout unless stated, so the closed forms match the explicit reference to 1e-10
(differences are rounding of O(1) quantities, ~1e-15). Finite differences use a central step
of 1e-5, whose truncation error is O(1e-10), checked to 1e-7.
"""

import itertools

import pytest
import torch

from datc.credit.datc_math import (
    ALIGNMENTS,
    LOGIT_MAPS,
    datc_scores,
    force_norm,
    rm_saliency,
)
from tests.helpers.datc_reference import reference_force, reference_pi, reference_scores

F64 = torch.float64
COMBOS = list(itertools.product(LOGIT_MAPS, ALIGNMENTS))


def case(seed: int, N: int = 9, V: int = 13, d: int = 5, scale: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(N, d, generator=gen, dtype=F64)
    E = torch.randn(V, d, generator=gen, dtype=F64)
    logits = torch.randn(N, V, generator=gen, dtype=F64) * scale
    y = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(-1)
    sign = torch.tensor([1.0, -1.0, 0.0] * (N // 3) + [1.0] * (N % 3), dtype=F64)
    return g, E, logits, y, sign


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().to(F64), b.argsort().argsort().to(F64)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float(ra @ rb / (ra.norm() * rb.norm()))


@pytest.mark.parametrize("top_k", [None, 1, 4, 13, 50])
@pytest.mark.parametrize("logit_map, alignment", COMBOS)
def test_closed_form_matches_reference(logit_map, alignment, top_k):
    g, E, logits, y, sign = case(0)
    fast = datc_scores(g, E, logits, y, sign, logit_map=logit_map, alignment=alignment, top_k=top_k)
    ref = reference_scores(
        g, E, logits, y, sign, logit_map=logit_map, alignment=alignment, top_k=top_k
    )
    assert fast.shape == (9,) and fast.dtype == F64
    assert torch.allclose(fast, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("top_k", [None, 4])
@pytest.mark.parametrize("logit_map", LOGIT_MAPS)
def test_force_norm_matches_reference(logit_map, top_k):
    g, E, logits, _, _ = case(1)
    fast = force_norm(g, E, logits, logit_map=logit_map, top_k=top_k)
    ref = reference_force(g, E, logits, logit_map, top_k).norm(dim=-1)
    assert torch.allclose(fast, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("logit_map, alignment", COMBOS)
@pytest.mark.parametrize("chunk_size", [1, 2, 4, 9, 100])
def test_chunked_equals_unchunked(logit_map, alignment, chunk_size):
    g, E, logits, y, sign = case(2)
    kw = {"logit_map": logit_map, "alignment": alignment}
    whole = datc_scores(g, E, logits, y, sign, chunk_size=10_000, **kw)
    chunked = datc_scores(g, E, logits, y, sign, chunk_size=chunk_size, **kw)
    assert torch.allclose(chunked, whole, atol=1e-12, rtol=0)
    norm_whole = force_norm(g, E, logits, logit_map=logit_map, chunk_size=10_000)
    norm_chunked = force_norm(g, E, logits, logit_map=logit_map, chunk_size=chunk_size)
    assert torch.allclose(norm_chunked, norm_whole, atol=1e-12, rtol=0)


def test_chunks_sized_by_memory(monkeypatch):
    """``chunk_size`` None: rows per chunk from the byte budget and the vocabulary (float64
    halves them); the scores are those of any explicit chunking."""
    import datc.credit.datc_math as dm

    assert dm.chunk_rows(None, 192) == dm.CHUNK_BYTES // (192 * 4) and dm.chunk_rows(None, 49152) == 341
    assert dm.chunk_rows(None, 49152, torch.float64) == 170 and dm.chunk_rows(7, 49152) == 7
    assert dm.chunk_rows(None, 2 * dm.CHUNK_BYTES) == 1  # never 0 rows
    g, E, logits, y, sign = case(2)
    whole = datc_scores(g, E, logits, y, sign, chunk_size=10_000)
    norm_whole = force_norm(g, E, logits, chunk_size=10_000)
    sizes = []
    real_chunks = dm._chunks
    monkeypatch.setattr(dm, "_chunks", lambda m, rows, size: sizes.append(size) or real_chunks(m, rows, size))
    monkeypatch.setattr(dm, "CHUNK_BYTES", 3 * E.shape[0] * 8)  # three float64 rows of the test's vocabulary
    assert torch.allclose(datc_scores(g, E, logits, y, sign), whole, atol=1e-12, rtol=0)
    assert torch.allclose(force_norm(g, E, logits), norm_whole, atol=1e-12, rtol=0)
    assert sizes == [3, 3]


@pytest.mark.parametrize("logit_map, alignment", COMBOS)
def test_a_bf16_autocast_region_leaves_the_math_in_float32(logit_map, alignment):
    """The trainer's step runs in a bf16 autocast region; the scores' matrix products must not
    be cast to bf16 there (a float32 input gives float32 arithmetic, bit for bit)."""
    g, E, logits, y, sign = case(4, N=12, V=40, d=8)
    g, E, logits, sign = g.float(), E.float(), logits.float(), sign.float()
    kw = {"logit_map": logit_map, "alignment": alignment}
    plain = datc_scores(g, E, logits, y, sign, **kw)
    plain_norm = force_norm(g, E, logits, logit_map=logit_map)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(datc_scores(g, E, logits, y, sign, **kw), plain)
        assert torch.equal(force_norm(g, E, logits, logit_map=logit_map), plain_norm)


def test_rows_select_without_changing_values():
    g, E, logits, y, sign = case(3)
    rows = torch.tensor([7, 0, 3, 8])
    full = datc_scores(g, E, logits, y, sign, chunk_size=3)
    assert torch.allclose(datc_scores(g, E, logits, y, sign, chunk_size=3, rows=rows), full[rows])
    full_norm = force_norm(g, E, logits, chunk_size=3)
    assert torch.allclose(force_norm(g, E, logits, chunk_size=3, rows=rows), full_norm[rows])
    empty = datc_scores(g, E, logits, y, sign, rows=torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0,)


def _reward(seed: int, d: int):
    """A small smooth reward of one input embedding: R(h) = a · tanh(W h + b)."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(7, d, generator=gen, dtype=F64)
    b = torch.randn(7, generator=gen, dtype=F64)
    a = torch.randn(7, generator=gen, dtype=F64)
    return lambda h: a @ torch.tanh(W @ h + b)


@pytest.mark.parametrize("seed", range(4))
def test_jacobian_force_is_the_gradient_of_the_reward_wrt_logits(seed):
    """f_t (jacobian) = ∂/∂z R(softmax(z)ᵀE), by autograd and by a finite difference."""
    V, d, eps = 11, 6, 1e-5
    gen = torch.Generator().manual_seed(100 + seed)
    E = torch.randn(V, d, generator=gen, dtype=F64)
    z = torch.randn(V, generator=gen, dtype=F64) * 2
    R = _reward(seed, d)

    def reward_of_logits(zz):
        return R(torch.softmax(zz, -1) @ E)

    h = (torch.softmax(z, -1) @ E).requires_grad_()
    (g,) = torch.autograd.grad(R(h), h)  # the reward force at the expected embedding
    z_var = z.clone().requires_grad_()
    (grad_z,) = torch.autograd.grad(reward_of_logits(z_var), z_var)

    f = reference_force(g[None], E, z[None], "jacobian")[0]
    assert torch.allclose(f, grad_z, atol=1e-12, rtol=0)
    v = torch.randn(V, generator=gen, dtype=F64)
    fd = (reward_of_logits(z + eps * v) - reward_of_logits(z - eps * v)) / (2 * eps)
    assert abs(float(fd - f @ v)) < 1e-7

    # The fast path: work = ⟨f, e_y - π⟩ is the derivative along the GRPO displacement.
    y = int(torch.randint(V, (1,), generator=gen))
    u = torch.nn.functional.one_hot(torch.tensor(y), V).to(F64) - torch.softmax(z, -1)
    fd_u = (reward_of_logits(z + eps * u) - reward_of_logits(z - eps * u)) / (2 * eps)
    work = datc_scores(
        g[None], E, z[None], torch.tensor([y]), torch.ones(1, dtype=F64), alignment="work"
    )
    assert abs(float(fd_u - work[0])) < 1e-7
    assert torch.allclose(force_norm(g[None], E, z[None])[0], grad_z.norm(), atol=1e-12)


@pytest.mark.parametrize("logit_map, alignment", COMBOS)
def test_sign_flips_score(logit_map, alignment):
    g, E, logits, y, sign = case(4)
    kw = {"logit_map": logit_map, "alignment": alignment}
    plus = datc_scores(g, E, logits, y, torch.ones_like(sign), **kw)
    minus = datc_scores(g, E, logits, y, -torch.ones_like(sign), **kw)
    zero = datc_scores(g, E, logits, y, torch.zeros_like(sign), **kw)
    assert torch.equal(minus, -plus) and (zero == 0).all() and (plus != 0).all()


@pytest.mark.parametrize("logit_map, alignment", COMBOS)
@pytest.mark.parametrize("c", [1e-3, 5.0])
def test_scaling_the_reward_gradient(logit_map, alignment, c):
    """f is linear in g: work/projection scale by c, cosine does not change."""
    g, E, logits, y, sign = case(5)
    kw = {"logit_map": logit_map, "alignment": alignment}
    s = datc_scores(g, E, logits, y, sign, **kw)
    sc = datc_scores(c * g, E, logits, y, sign, **kw)
    expected = s if alignment == "cosine" else c * s
    assert torch.allclose(sc, expected, atol=1e-12, rtol=1e-10)


def test_identity_work_is_the_cheap_identity():
    # ⟨ρ - mean ρ, e_y - π⟩ = g · (E[y] - πᵀE): the displacement sums to 0.
    g, E, logits, y, sign = case(6)
    expected = sign * (g * (E[y] - torch.softmax(logits, -1) @ E)).sum(-1)
    fast = datc_scores(g, E, logits, y, sign, logit_map="identity", alignment="work")
    assert torch.allclose(fast, expected, atol=1e-12, rtol=0)


def test_rm_saliency_matches_its_definition():
    g, E, _, y, _ = case(7)
    expected = torch.stack([(g[t] @ E[y[t]]).abs() for t in range(g.shape[0])])
    assert torch.allclose(rm_saliency(g, E, y), expected, atol=1e-12, rtol=0)


def test_collapsed_policy_gives_zero_not_nan():
    """π = e_y exactly: no displacement, no Jacobian force; every score is 0, never NaN."""
    g, E, logits, y, sign = case(8, N=3)
    logits = torch.zeros_like(logits).scatter(-1, y[:, None], 1e4)
    for logit_map, alignment in COMBOS:
        s = datc_scores(g, E, logits, y, sign, logit_map=logit_map, alignment=alignment)
        assert torch.equal(s, torch.zeros_like(s))
    assert torch.equal(force_norm(g, E, logits), torch.zeros(3, dtype=F64))


@pytest.mark.parametrize("logit_map, alignment", COMBOS)
def test_float32_keeps_relative_precision_on_peaked_policies(logit_map, alignment):
    """1 - π_y down to ~1e-10, sampled and unsampled modes: float32 within 1e-3 of float64."""
    N, V, d = 200, 300, 16
    gen = torch.Generator().manual_seed(9)
    g = torch.randn(N, d, generator=gen, dtype=F64)
    E = torch.randn(V, d, generator=gen, dtype=F64)
    logits = torch.randn(N, V, generator=gen, dtype=F64) * 4
    logits[:, 0] += torch.linspace(5, 25, N, dtype=F64)
    logits = logits.float().to(F64)  # the same inputs for both precisions
    y = torch.zeros(N, dtype=torch.long)
    y[::2] = torch.randint(1, V, (N // 2,), generator=gen)  # half: the mode is not sampled
    sign = torch.ones(N, dtype=F64)
    kw = {"logit_map": logit_map, "alignment": alignment}
    s64 = datc_scores(g, E, logits, y, sign, **kw)
    s32 = datc_scores(g.float(), E.float(), logits.float(), y, sign.float(), **kw)
    assert s32.dtype == torch.float32
    rel = (s32.to(F64) - s64).abs() / s64.abs()
    assert rel.max() < 1e-3 and rel.median() < 1e-5


@pytest.mark.parametrize("logit_map, alignment", COMBOS)
def test_top_k_error_against_exact_scores(logit_map, alignment):
    """Rank correlation of top-k scores with the exact ones on a peaked random policy
    (mean top-1 mass ~0.23 over V = 2000). Measured: k=20 >= 0.98, k=50 >= 0.994 for every
    combination; asserted with a margin. Run with -s to see the values."""
    N, V, d = 400, 2000, 16
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(N, d, generator=gen, dtype=F64)
    E = torch.randn(V, d, generator=gen, dtype=F64)
    logits = torch.randn(N, V, generator=gen, dtype=F64) * 3
    y = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(-1)
    sign = torch.ones(N, dtype=F64)
    kw = {"logit_map": logit_map, "alignment": alignment}
    exact = datc_scores(g, E, logits, y, sign, **kw)
    rho = {k: spearman(exact, datc_scores(g, E, logits, y, sign, top_k=k, **kw)) for k in (20, 50)}
    print(f"top_k rank correlation {logit_map}/{alignment}: {rho}")
    assert rho[20] >= 0.97 and rho[50] >= 0.99
    assert torch.equal(datc_scores(g, E, logits, y, sign, top_k=V, **kw), exact)


def test_reference_pi_top_k():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]], dtype=F64)
    pi = reference_pi(logits, top_k=2)
    e = torch.exp(torch.tensor([2.0, 1.0], dtype=F64))
    assert torch.allclose(pi, torch.stack([0 * e[0], e[0], e[1], 0 * e[0]])[None] / e.sum())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"logit_map": "softmax"}, "logit_map"),
        ({"alignment": "dot"}, "alignment"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"top_k": 0}, "top_k"),
    ],
)
def test_invalid_options(kwargs, match):
    g, E, logits, y, sign = case(0)
    with pytest.raises(ValueError, match=match):
        datc_scores(g, E, logits, y, sign, **kwargs)


def test_vocabulary_mismatch_is_a_clear_error():
    g, E, logits, y, sign = case(0)
    with pytest.raises(ValueError, match="vocabulary"):
        datc_scores(g, E, logits[:, :-1], y, sign)
    with pytest.raises(ValueError, match="width"):
        force_norm(g[:, :-1], E, logits)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("logit_map,alignment", COMBOS)
def test_nonfinite_logit_gives_nan_score(bad, logit_map, alignment):
    # METHOD §2.5: a NaN or +inf policy logit must make its response fall back to w = 1, not
    # score 0 (projection/cosine divided 0 by a NaN norm and returned 0 before).
    g, E, logits, y, sign = case(3)
    logits = logits.clone()
    logits[2, 5] = bad
    s = datc_scores(g, E, logits, y, sign, logit_map=logit_map, alignment=alignment, chunk_size=4)
    assert torch.isnan(s[2])
    others = torch.arange(s.numel()) != 2
    assert torch.isfinite(s[others]).all()
    clean = torch.cat([logits[:2], logits[3:]])
    ref = datc_scores(torch.cat([g[:2], g[3:]]), E, clean, torch.cat([y[:2], y[3:]]),
                      torch.cat([sign[:2], sign[3:]]), logit_map=logit_map, alignment=alignment)
    torch.testing.assert_close(s[others], ref)
    assert torch.isnan(force_norm(g, E, logits, logit_map=logit_map)[2])


@pytest.mark.parametrize("top_k", [None, 4])
@pytest.mark.parametrize("logit_map,alignment", COMBOS)
def test_a_minus_inf_logit_off_the_sampled_token_is_probability_zero(logit_map, alignment, top_k):
    # METHOD §2.5: -inf on a token that was not sampled (a masked or padded vocabulary row, a
    # banned token) is an entry with pi_v = 0, and DATC computes through it (it fell back to
    # w = 1 before, turning DATC into GRPO under any logit processor that writes -inf). The
    # expected score is the slow reference's, whose softmax gives exactly 0 there.
    g, E, logits, y, sign = case(3)
    logits = logits.clone()
    row = 4  # sign -1
    banned = [v for v in range(logits.shape[1]) if v != int(y[row])][:3]
    logits[row, banned] = -torch.inf
    logits[7, [v for v in range(logits.shape[1]) if v != int(y[7])][5]] = -torch.inf
    kw = dict(logit_map=logit_map, alignment=alignment, top_k=top_k)
    s = datc_scores(g, E, logits, y, sign, chunk_size=4, **kw)
    assert torch.isfinite(s).all()
    torch.testing.assert_close(s, reference_scores(g, E, logits, y, sign, **kw))
    assert s[row] != 0 and s[7] != 0
    assert torch.isfinite(force_norm(g, E, logits, logit_map=logit_map, top_k=top_k)).all()
    # the sampled token itself at -inf has probability 0 under the policy: that row falls back
    logits[row, y[row]] = -torch.inf
    s2 = datc_scores(g, E, logits, y, sign, chunk_size=4, **kw)
    assert torch.isnan(s2[row]) and torch.isfinite(s2[torch.arange(s2.numel()) != row]).all()
    assert torch.equal(s2[:row], s[:row]) and torch.equal(s2[row + 1:], s[row + 1:])  # bit for bit
    # a row of -inf only is no distribution at all
    logits[row] = -torch.inf
    assert torch.isnan(force_norm(g, E, logits, logit_map=logit_map, top_k=top_k)[row])


def test_finite_logits_give_the_same_scores_bit_for_bit_beside_a_minus_inf_row():
    g, E, logits, y, sign = case(5)
    z = logits.clone()
    z[1, (int(y[1]) + 1) % z.shape[1]] = -torch.inf
    for alignment in ALIGNMENTS:
        a = datc_scores(g, E, logits, y, sign, alignment=alignment, chunk_size=3)
        b = datc_scores(g, E, z, y, sign, alignment=alignment, chunk_size=3)
        keep = torch.arange(a.numel()) != 1
        assert torch.equal(a[keep], b[keep])


@pytest.mark.parametrize("logit_map", LOGIT_MAPS)
@pytest.mark.parametrize("alignment", ALIGNMENTS)
def test_a_nan_reward_gradient_gives_nan_not_zero(logit_map, alignment):
    # cosine divided a NaN work by a NaN norm and the zero-denominator rule returned s = 0 (no
    # fallback) for a direct caller; every alignment now scores NaN there.
    g, E, logits, y, sign = case(3)
    g = g.clone()
    g[4, 1] = torch.nan
    s = datc_scores(g, E, logits, y, sign, logit_map=logit_map, alignment=alignment)
    assert torch.isnan(s[4]) and torch.isfinite(s[torch.arange(s.numel()) != 4]).all()


def test_finite_logits_whose_sum_overflows_still_score():
    # the non-finite check sums each row first; a sum that overflows must not make finite logits fall back
    g, E, logits, y, sign = case(3)
    big = logits.clone().double()
    big[2] = 3e38 + logits[2]  # every entry finite in float32 (max 3.4e38), their sum is not
    big[2, 0] = -3e38  # and mixed signs
    big = big.float()
    assert torch.isfinite(big).all() and not torch.isfinite(big[2].sum())
    s = datc_scores(g, E, big, y, sign, chunk_size=4)
    assert torch.isfinite(s).all()
    s_ref = datc_scores(g, E, logits, y, sign, chunk_size=4)
    torch.testing.assert_close(s[torch.arange(s.numel()) != 2], s_ref[torch.arange(s.numel()) != 2])
