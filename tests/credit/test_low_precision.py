"""DATC's exact credit in bf16 / TF32 (``credit.matmul_dtype``: datc.credit.low_precision, through
datc.credit.datc_math.datc_scores) against float64 (results/bench/credit_precision.md), and the option's checks.

The weights' largest relative error against float64 that METHOD states from that measurement at the presets' shapes:
the presets' construction (logits 4·N(0,1), 0.02·N(0,1) in bf16 with or without a common component: bf16 1.7e-2 to
2.2e-2, tf32 1.1e-3 to 1.6e-3, rounded up here) and the generic one (logits 2·N(0,1), E ~ N(0,1): bf16 up to 1.03e-1,
tf32 up to 6.0e-3, as stated), checked here on small shapes of each construction.
"""

import pytest
import torch

from datc.credit.datc_math import datc_scores

BOUNDS = {"preset": {"bfloat16": 3e-2, "tf32": 3e-3}, "generic": {"bfloat16": 1.03e-1, "tf32": 6.0e-3}}


def _precision_inputs(shifted: bool, V: int = 3000, d: int = 128, n: int = 256, generic: bool = False, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g) * (2 if generic else 4)
    E = torch.randn(V, d, generator=g) * (1 if generic else 0.02)
    if shifted:
        E += 0.02 * torch.randn(1, d, generator=g)
    E = E if generic else E.bfloat16().float()
    grad = torch.randn(n, d, generator=g)
    y = torch.multinomial(torch.softmax(logits, -1), 1, generator=g).squeeze(-1)
    sign = torch.tensor([1.0, -1.0]).repeat_interleave(128)
    return grad, E, logits, y, sign


def _weights(s):
    from datc.credit.weights import WeightParams, scores_to_weights

    rows = s.float().view(-1, 128)
    return scores_to_weights(rows, torch.ones_like(rows, dtype=torch.bool), WeightParams())[0].double()


@pytest.mark.parametrize(("shifted", "generic", "seeds"), [(False, False, [3]), (True, False, [3]), (False, True, [3, 4, 5])])
@pytest.mark.parametrize("matmul_dtype", ["bfloat16", "tf32"])
def test_low_precision_credit_is_within_its_stated_measured_maximum(shifted, generic, seeds, matmul_dtype):
    bound = BOUNDS["generic" if generic else "preset"][matmul_dtype]
    kw = dict(logit_map="jacobian", alignment="projection", chunk_size=64)
    for seed in seeds:
        grad, E, logits, y, sign = _precision_inputs(shifted, generic=generic, seed=seed)
        ref = datc_scores(grad.double(), E.double(), logits.double(), y, sign, **kw)
        low = datc_scores(grad, E, logits, y, sign, matmul_dtype=matmul_dtype, **kw)
        assert low.dtype == torch.float32
        w, w_ref = _weights(low), _weights(ref)
        assert ((w - w_ref).abs() / w_ref).max() <= bound, seed
        f32 = datc_scores(grad, E, logits, y, sign, **kw)  # float32's own error is far below either
        assert ((_weights(f32) - w_ref).abs() / w_ref).max() <= 1e-4


def test_float32_is_unchanged_by_the_option():
    grad, E, logits, y, sign = _precision_inputs(True)
    for kw in (dict(logit_map="jacobian", alignment="projection"), dict(logit_map="identity", alignment="work"),
               dict(logit_map="jacobian", alignment="cosine"), dict(logit_map="jacobian", alignment="projection", top_k=8)):
        default = datc_scores(grad, E, logits, y, sign, chunk_size=64, **kw)
        assert torch.equal(datc_scores(grad, E, logits, y, sign, chunk_size=64, matmul_dtype="float32", **kw), default)


def test_matmul_dtype_is_checked():
    grad, E, logits, y, sign = _precision_inputs(False, V=50, d=8, n=128)
    with pytest.raises(ValueError, match="matmul_dtype must be one of"):
        datc_scores(grad, E, logits, y, sign, matmul_dtype="float16")
    with pytest.raises(ValueError, match="applies to the exact credit"):
        datc_scores(grad, E, logits, y, sign, matmul_dtype="bfloat16", top_k=4)


def test_tf32_rounding_keeps_ten_mantissa_bits():
    from datc.credit.low_precision import round_to_tf32

    x = torch.tensor([1.0, 1.0 + 2**-10, 1.0 + 2**-12, -3.0e-5, 1.0 + 2**-11 + 2**-20])
    r = round_to_tf32(x)
    assert r[0] == 1 and r[1] == 1.0 + 2**-10 and r[2] == 1.0 and r[4] == 1.0 + 2**-10
    assert ((r[3] - x[3]).abs() / x[3].abs()) <= 2**-11
