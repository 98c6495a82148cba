"""Pure figures of the benchmark: spreads, block summaries, the contestants' order, closeness
(tested in tests/scripts/test_bench.py)."""

from __future__ import annotations

import statistics

from scripts.bench.scales import PHASES

CONFIDENCE = 0.95


def median_interval(xs: list[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The distribution-free interval of the median: ``(x_(k), x_(n-k+1))`` of the sorted values
    with the largest ``k`` such that ``P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2``, which
    covers the median with probability at least ``confidence`` for any continuous distribution
    of independent values (the sign-test interval). None when ``n`` is too small (n < 6 at 95%)."""
    from scipy.stats import binom

    xs, n = sorted(xs), len(xs)
    alpha = (1 - confidence) / 2
    k = 0
    while k + 1 <= n // 2 and binom.cdf(k, n, 0.5) <= alpha:  # P(B <= k) = P(B < k + 1)
        k += 1
    return None if k == 0 else (xs[k - 1], xs[n - k])


def spread(xs: list[float]) -> dict[str, float]:
    """Median, min, max, quartiles (2+ values) and the median's 95% interval (``ci_low``,
    ``ci_high``, ``ci_rel``: the larger side over the median; None below 6 values)."""
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    med = statistics.median(xs)
    ci = median_interval(xs)
    rel = None if ci is None or med == 0 else max(med - ci[0], ci[1] - med) / abs(med)
    return {"median": med, "min": xs[0], "max": xs[-1], "q1": q[0], "q3": q[2], "n": len(xs),
            "ci_low": None if ci is None else ci[0], "ci_high": None if ci is None else ci[1], "ci_rel": rel}


def block_summary(rows: list[dict[str, float]], batch_size: int) -> dict[str, float]:
    """One block of measured steps -> throughput (totals over the block) and median phase times.
    Each row: ``step_s``, ``tokens`` and one ``<phase>_s`` per phase."""
    total = sum(r["step_s"] for r in rows)
    out = {"samples_per_s": batch_size * len(rows) / total, "tokens_per_s": sum(r["tokens"] for r in rows) / total,
           "step_s": statistics.median(r["step_s"] for r in rows),
           "response_len": sum(r["tokens"] for r in rows) / (batch_size * len(rows))}
    for p in PHASES:
        out[f"{p}_s"] = statistics.median(r[f"{p}_s"] for r in rows)
    out["other_s"] = out["step_s"] - sum(out[f"{p}_s"] for p in PHASES)
    return out


def rotated_order(names: tuple[str, ...], repeat: int) -> list[str]:
    """Order of the contestants in repeat ``repeat``: rotated by one each repeat and reversed
    every other repeat, so each runs first, middle and last alike."""
    k = repeat % len(names)
    order = list(names[k:] + names[:k])
    return order[::-1] if (repeat // len(names)) % 2 else order


def close(a: float, b: float, rtol: float, atol: float = 1e-7) -> bool:
    """``|a - b| <= rtol * max(|a|, |b|) + atol``."""
    return abs(a - b) <= rtol * max(abs(a), abs(b)) + atol
