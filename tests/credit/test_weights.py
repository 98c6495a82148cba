"""The shared weight step (METHOD §2.5, §4): datc.credit.weights.scores_to_weights.

Tolerances: weights are float32, so means and hand-derived values are checked to 1e-6
(a few float32 ulps at 1); "bit for bit" checks use torch.equal.
"""

import math

import pytest
import torch

from datc.credit.weights import WeightParams, scores_to_weights

CONFIGS = [
    {},
    {"tau": 0.3},
    {"normalizer": "linear", "alpha": 2.0},
    {"normalizer": "linear", "alpha": 0.5, "w_min": 0.2},
    {"normalizer": "rank_power", "alpha": 2.15},
    {"lam": 0.4},
    {"standardize": False, "normalizer": "linear"},
    {"w_max": 1.5},
    {"w_min": 0.5, "w_max": 1.3},
    {"normalizer": "linear", "alpha": 3.0, "w_min": 0.0, "w_max": 2.0},
    {"normalizer": "rank_power", "alpha": 4.0, "lam": 0.7, "w_min": 0.1, "w_max": 1.8},
]
NORMALIZERS = ["softmax", "linear", "rank_power"]


def random_case(seed: int, B: int = 6, T: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores with a wide range and right-padded masks of varied lengths (incl. 1 and T)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, T, generator=g) * torch.rand(B, 1, generator=g) * 10
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[0], lengths[-1] = T, 1
    mask = torch.arange(T) < lengths[:, None]
    scores = scores.masked_fill(~mask, float("nan"))  # padding must not leak anywhere
    return scores, mask


def mean_over_valid(w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (w * mask).sum(-1) / mask.sum(-1)


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_nonnegative_mean_one_and_advantage_kept(cfg, seed):
    scores, mask = random_case(seed)
    params = WeightParams(**cfg)
    w, fallback = scores_to_weights(scores, mask, params)
    assert w.dtype == torch.float32 and w.shape == mask.shape and fallback.shape == (6,)
    assert torch.isfinite(w).all()
    assert (w >= 0).all()
    assert torch.allclose(mean_over_valid(w, mask), torch.ones(6), atol=1e-6, rtol=0)
    assert (w[~mask] == 0).all()
    # Â = A·w: never the opposite sign of A, and the mean token advantage is A (METHOD §4).
    A = torch.randn(6)
    adv = A[:, None] * w
    assert (adv * A[:, None] >= 0).all()
    assert torch.allclose(mean_over_valid(adv, mask), A, atol=1e-6, rtol=1e-6)
    if params.w_min is not None:
        assert (w[mask] >= params.w_min - 1e-6).all()
    if params.w_max is not None:
        assert (w[mask] <= params.w_max + 1e-6).all()


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_lambda_zero_is_uniform_bit_for_bit(cfg):
    scores, mask = random_case(7)
    w, _ = scores_to_weights(scores, mask, WeightParams(**{**cfg, "lam": 0.0}))
    assert torch.equal(w, mask.float())


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_padding_neither_weighted_nor_influential(cfg):
    scores, mask = random_case(3)
    params = WeightParams(**cfg)
    w, fb = scores_to_weights(scores, mask, params)
    # Other values at masked positions: no change.
    garbage = scores.masked_fill(~mask, 0.0) + (~mask) * torch.tensor(1e30)
    pad = (~mask).nonzero()[::2]
    garbage[pad[:, 0], pad[:, 1]] = float("inf")
    w2, fb2 = scores_to_weights(garbage, mask, params)
    assert torch.equal(w, w2) and torch.equal(fb, fb2)
    # Extra padding columns: no change on the original ones, zeros on the new ones.
    pad_s = torch.cat([scores, torch.randn(6, 4)], dim=1)
    pad_m = torch.cat([mask, torch.zeros(6, 4, dtype=torch.bool)], dim=1)
    w3, fb3 = scores_to_weights(pad_s, pad_m, params)
    assert torch.allclose(w3[:, :9], w, atol=1e-7, rtol=0) and (w3[:, 9:] == 0).all()
    assert torch.equal(fb, fb3)


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_responses_are_independent(cfg):
    """The vectorised batch equals one call per response (no leakage across rows)."""
    scores, mask = random_case(11)
    params = WeightParams(**cfg)
    w, fb = scores_to_weights(scores, mask, params)
    for i in range(scores.shape[0]):
        wi, fbi = scores_to_weights(scores[i : i + 1], mask[i : i + 1], params)
        assert torch.allclose(wi[0], w[i], atol=1e-7, rtol=0) and fbi[0] == fb[i]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_permutation_equivariant(cfg):
    """Permuting a response's valid scores permutes its weights (datc_shuffled relies on it)."""
    scores, mask = random_case(5)
    params = WeightParams(**cfg)
    w, _ = scores_to_weights(scores, mask, params)
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(0))
    wp, _ = scores_to_weights(scores[:1, perm], mask[:1, perm], params)  # row 0 is unpadded
    assert torch.allclose(wp[0], w[0, perm], atol=1e-6, rtol=0)


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.get("standardize", True)], ids=str)
@pytest.mark.parametrize("c", [1e-2, 7.0, 1e4])
def test_invariant_to_positive_scaling(cfg, c):
    """Scores scale with the reward model's output; z-scoring removes c up to eps/(c·std),
    about 1e-6 here (std of order 1): below the 1e-5 tolerance."""
    scores, mask = random_case(2)
    scores = scores / scores.nan_to_num().std(-1, keepdim=True)
    params = WeightParams(**cfg)
    w, _ = scores_to_weights(scores, mask, params)
    wc, _ = scores_to_weights(scores * c, mask, params)
    assert torch.allclose(w, wc, atol=1e-5, rtol=0)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_fallback_cases(normalizer):
    T = 5
    scores = torch.tensor(
        [
            [0.3, 0.3, 0.3, 0.3, 0.3],  # constant
            [2.0, 0.0, 0.0, 0.0, 0.0],  # one valid token
            [1.0, float("nan"), 2.0, 0.5, 0.0],  # non-finite valid score
            [1.0, float("inf"), 2.0, 0.0, 0.0],  # infinite valid score
            [1.0, 1.0 + 1e-9, 1.0, 1.0 - 1e-9, 1.0],  # spread below min_std: rounding noise
            [0.0, 0.0, 0.0, 0.0, 0.0],  # no valid token at all
            [1.0, 3.0, 2.0, 0.0, 0.0],  # a normal response
        ],
        dtype=torch.float64,
    )
    lengths = torch.tensor([5, 1, 5, 3, 5, 0, 3])
    mask = torch.arange(T) < lengths[:, None]
    w, fb = scores_to_weights(scores, mask, WeightParams(normalizer=normalizer, alpha=2.0))
    assert fb.tolist() == [True] * 6 + [False]
    assert torch.equal(w[:5], mask[:5].float())
    assert (w[5] == 0).all()
    assert not torch.equal(w[6, :3], torch.ones(3))


def test_softmax_hand_derived():
    # s = [0, 1, 2]: mean 1, population std sqrt(2/3), so z = [-r, 0, r] with r = sqrt(3/2)
    # (eps = 1e-8 is far below the tolerance). tau = 1: w_i = 3 e^{z_i} / (e^{-r} + 1 + e^{r}).
    # With lam = 0.5 the mix is 0.5 + 0.5 w.
    r = math.sqrt(1.5)
    den = math.exp(-r) + 1 + math.exp(r)
    expected = torch.tensor([3 * math.exp(-r) / den, 3 / den, 3 * math.exp(r) / den])
    mask = torch.ones(1, 3, dtype=torch.bool)
    w, fb = scores_to_weights(torch.tensor([[0.0, 1.0, 2.0]]), mask, WeightParams())
    assert not fb.any()
    assert torch.allclose(w[0], expected, atol=1e-6, rtol=0)
    w, _ = scores_to_weights(torch.tensor([[0.0, 1.0, 2.0]]), mask, WeightParams(lam=0.5))
    assert torch.allclose(w[0], 0.5 + 0.5 * expected, atol=1e-6, rtol=0)
    # tau = 2 halves z: w_i = 3 e^{z_i/2} / (e^{-r/2} + 1 + e^{r/2}).
    w, _ = scores_to_weights(torch.tensor([[0.0, 1.0, 2.0]]), mask, WeightParams(tau=2.0))
    den2 = math.exp(-r / 2) + 1 + math.exp(r / 2)
    assert torch.allclose(w[0, 2], torch.tensor(3 * math.exp(r / 2) / den2), atol=1e-6)


def test_linear_hand_derived():
    # s = [0, 1, 2, 3]: mean 1.5, population variance (2.25 + .25 + .25 + 2.25)/4 = 1.25, so
    # z = [-3, -1, 1, 3]/sqrt(5). alpha = 1: 1 + z = [1 - 3/√5, 1 - 1/√5, 1 + 1/√5, 1 + 3/√5];
    # the first is negative, floored at LINEAR_FLOOR = 0.01 (no w_min). Sum = 3.01 + 3/√5, so
    # w = 4 v / (3.01 + 3/√5).
    q = 1 / math.sqrt(5)
    v = torch.tensor([0.01, 1 - q, 1 + q, 1 + 3 * q])
    expected = 4 * v / (3.01 + 3 * q)
    mask = torch.ones(1, 4, dtype=torch.bool)
    scores = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    w, _ = scores_to_weights(scores, mask, WeightParams(normalizer="linear"))
    assert torch.allclose(w[0], expected, atol=1e-6, rtol=0)
    # standardize: false only centres: 1 + 0.1·(s - 1.5) = [0.85, 0.95, 1.05, 1.15], mean 1.
    w, _ = scores_to_weights(
        scores, mask, WeightParams(normalizer="linear", alpha=0.1, standardize=False)
    )
    assert torch.allclose(w[0], torch.tensor([0.85, 0.95, 1.05, 1.15]), atol=1e-6, rtol=0)


def test_rank_power_hand_derived():
    # s = [3, 1, 2, 2]: ascending ranks 4, 1, and the tie shares (2 + 3)/2 = 2.5.
    # alpha = 2: (rank/4)^2 ∝ [16, 1, 6.25, 6.25], sum 29.5, mean 7.375, so w = that / 7.375.
    mask = torch.ones(1, 4, dtype=torch.bool)
    params = WeightParams(normalizer="rank_power", alpha=2.0)
    w, _ = scores_to_weights(torch.tensor([[3.0, 1.0, 2.0, 2.0]]), mask, params)
    expected = torch.tensor([16.0, 1.0, 6.25, 6.25]) / 7.375
    assert torch.allclose(w[0], expected, atol=1e-6, rtol=0)


def test_clip_hand_derived():
    # rank_power, alpha = 1, s = [1, 2, 3, 4]: rank/4 = [.25, .5, .75, 1], mean .625, so
    # w = [0.4, 0.8, 1.2, 1.6] before clipping.
    mask = torch.ones(1, 4, dtype=torch.bool)
    scores = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    base = {"normalizer": "rank_power", "alpha": 1.0}
    w, _ = scores_to_weights(scores, mask, WeightParams(**base))
    assert torch.allclose(w[0], torch.tensor([0.4, 0.8, 1.2, 1.6]), atol=1e-6, rtol=0)
    # w_max = 1.4: the last token sits on 1.4, the others shift by b with
    # 0.4 + 0.8 + 1.2 + 3b + 1.4 = 4, b = 1/15 (1.2 + b < 1.4, so nothing else clips).
    w, _ = scores_to_weights(scores, mask, WeightParams(**base, w_max=1.4))
    expected = torch.tensor([0.4 + 1 / 15, 0.8 + 1 / 15, 1.2 + 1 / 15, 1.4])
    assert torch.allclose(w[0], expected, atol=1e-6, rtol=0)
    # w_min = 0.5 and w_max = 1.4: 0.5 + (0.8 + b) + (1.2 + b) + 1.4 = 4, b = 0.05
    # (0.4 + b < 0.5 and 1.6 + b > 1.4 stay clipped; 0.85 and 1.25 are inside).
    w, _ = scores_to_weights(scores, mask, WeightParams(**base, w_min=0.5, w_max=1.4))
    assert torch.allclose(w[0], torch.tensor([0.5, 0.85, 1.25, 1.4]), atol=1e-6, rtol=0)


def test_clip_with_zero_weights_and_extreme_peak():
    """A softmax so peaked that the other weights underflow to 0 still clips to mean 1."""
    scores = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    w, _ = scores_to_weights(scores, mask, WeightParams(tau=1e-3))
    assert w[0, :4].max() < 1e-30 and abs(w[0, 4].item() - 5) < 1e-5
    w, _ = scores_to_weights(scores, mask, WeightParams(tau=1e-3, w_max=2.0))
    assert torch.allclose(w[0], torch.tensor([0.75, 0.75, 0.75, 0.75, 2.0]), atol=1e-6, rtol=0)


def test_rows_within_bounds_are_untouched_by_clipping():
    scores, mask = random_case(4)
    w, _ = scores_to_weights(scores, mask, WeightParams(lam=0.1))
    wc, _ = scores_to_weights(scores, mask, WeightParams(lam=0.1, w_min=0.0, w_max=100.0))
    assert torch.equal(w, wc)


@pytest.mark.parametrize(
    "field, value",
    [
        ("normalizer", "exp"),
        ("tau", 0.0),
        ("alpha", -1.0),
        ("lam", 1.5),
        ("lam", -0.1),
        ("w_min", 1.2),
        ("w_min", -0.1),
        ("w_max", 0.9),
        ("min_std", -1.0),
        ("eps", float("nan")),
        ("standardize", "yes"),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        WeightParams(**{field: value})


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="mask"):
        scores_to_weights(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool), WeightParams())


def test_fallback_threshold_is_relative_so_tiny_scores_still_make_weights():
    # Scores of magnitude 1e-9 with a real spread (a barely trained reward model's gradients)
    # must give the same weights as the same scores at magnitude 1: min_std is relative.
    s = torch.tensor([[1.0, 3.0, 2.0, 0.5]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    w1, fb1 = scores_to_weights(s, mask, WeightParams())
    w2, fb2 = scores_to_weights(s * 1e-9, mask, WeightParams())
    assert not fb1.any() and not fb2.any()
    torch.testing.assert_close(w1, w2)


def test_linear_default_floor_keeps_every_valid_token_positive():
    # METHOD §2.5: with w_min unset the linear normalizer's floor is small and positive, so no
    # valid token's advantage is zeroed (a 0 floor zeroed about one token in eight here).
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 40, generator=gen) ** 3  # heavy tails: many 1 + z below 0
    mask = torch.rand(64, 40, generator=gen) < 0.9
    w, fb = scores_to_weights(scores, mask, WeightParams(normalizer="linear", alpha=2.0))
    assert not fb.any()
    assert (w[mask] > 0).all()
    assert (w[mask].min() < 0.01)  # the floor binds (0.01 before dividing by a mean >= 1)
    n = mask.sum(-1)
    torch.testing.assert_close(w.sum(-1) / n, torch.ones(64), atol=1e-5, rtol=0)
    # an explicit w_min = 0 still allows zeros
    w0, _ = scores_to_weights(scores, mask, WeightParams(normalizer="linear", alpha=2.0, w_min=0.0))
    assert (w0[mask] == 0).any()
