"""Pure figures of the benchmark: spreads, block summaries, the contestants' order, closeness
(tested in tests/test_bench.py)."""

from __future__ import annotations

import statistics

from scripts.bench.scales import PHASES


def spread(xs: list[float]) -> dict[str, float]:
    """Median, min, max and quartiles of a list of figures (quartiles need 2+ values)."""
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q1": q[0], "q3": q[2], "n": len(xs)}


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
