"""Benchmark of DATC's cost, written to results/bench/credit.{json,md}.

1. Testbed: training-step time of ``credit=datc`` over ``credit=grpo``, measured in one
   process, steps interleaved (grpo, datc, datc, grpo, ...) from the same weights and random
   stream (so both sample the same responses), with the breakdown rollout / reward (+ RM
   gradient) / credit / update.
2. Real vocabulary shape (|V| = 151,936, d = 896, 512 response tokens): the exact credit
   computation and its ``top_k = 64`` version against one LM-head-sized matmul of the same
   shape; time (median of repeats, interleaved) and peak memory (max RSS growth, each
   measurement in a fresh subprocess).
3. ``top_k = 64`` against the exact scores on testbed rollouts: Spearman rank correlation.

    python -m scripts.bench.credit [--steps 30] [--repeats 5] [hydra overrides ...]
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from datc.analysis.credit_cost import paired_steps
from datc.run.provenance import provenance
from datc.utils import peak_rss_mb

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "results" / "bench"
V, D, N = 151_936, 896, 512


# ---- 2. the real shape ------------------------------------------------------------------------


def _real_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # In place, so no transient copy sets the memory baseline's peak.
    logits = torch.randn(N, V, generator=g).mul_(4.0)  # peaked, as a trained LM's are
    E = torch.randn(V, D, generator=g).mul_(0.02)
    grad = torch.randn(N, D, generator=g)
    y = torch.randint(V, (N,), generator=g)
    h = torch.randn(N, D, generator=g)
    return logits, E, grad, y, h


def _run_real(kind: str, inputs) -> None:
    from datc.credit.datc_math import datc_scores

    logits, E, grad, y, h = inputs
    if kind == "lm_head":
        h @ E.T  # (N, d) x (d, V): one LM-head pass
    else:
        top_k = 64 if kind == "datc_top64" else None
        datc_scores(grad, E, logits, y, torch.ones(N), logit_map="jacobian", alignment="projection",
                    chunk_size=128, top_k=top_k)


def _hwm_mb() -> float:
    """This process's peak resident memory (VmHWM), in MB (:func:`datc.utils.peak_rss_mb`)."""
    mb = peak_rss_mb()
    if math.isnan(mb):
        raise RuntimeError("no VmHWM in /proc/self/status")
    return mb


def _peak_mem_mb(kind: str) -> float:
    """Peak resident memory growth of one call, in a fresh process so that nothing allocated
    earlier hides it."""
    out = subprocess.run([sys.executable, "-m", "scripts.bench.credit", "--memory-child", kind], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return float(out.stdout.strip().splitlines()[-1])


def _memory_child(kind: str) -> None:
    """The fresh process of :func:`_peak_mem_mb`: one call's growth of the peak, printed."""
    x = _real_inputs()
    base = _hwm_mb()
    _run_real(kind, x)
    print(_hwm_mb() - base)


def bench_real_shape(repeats: int) -> dict:
    inputs = _real_inputs()
    kinds = ["lm_head", "datc_exact", "datc_top64"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    _run_real("lm_head", inputs)  # warm up
    for r in range(repeats):
        for k in kinds if r % 2 == 0 else reversed(kinds):
            t0 = time.perf_counter()
            _run_real(k, inputs)
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    mem = {k: _peak_mem_mb(k) for k in kinds}
    return {
        "shape": {"V": V, "d": D, "tokens": N, "chunk_size": 128},
        "seconds_median": med,
        "seconds_all": times,
        "ratio_to_lm_head": {k: med[k] / med["lm_head"] for k in kinds},
        "peak_rss_growth_mb": mem,
    }


def topk_agreement(session) -> dict:
    """Spearman correlation of top_k=64 scores with exact scores on fresh testbed rollouts."""
    from scipy.stats import spearmanr

    from datc.analysis.inputs import credit_inputs
    from datc.credit.datc_math import datc_scores

    examples = [session.assets.eval[i] for i in range(64)]
    inputs = credit_inputs(session, examples, generator_seed=0)  # the trainer's rollout, reward and credit inputs
    ro, g, logits, E = inputs.rollout, inputs.batch.rm_grad, inputs.batch.policy_logits, inputs.batch.rm_embedding
    mk = ro.response_mask.reshape(-1)
    args = (g.reshape(-1, g.shape[-1])[mk], E, logits.reshape(-1, logits.shape[-1])[mk], ro.response_ids.reshape(-1)[mk],
            torch.ones(int(mk.sum())))
    exact = datc_scores(*args)
    approx = datc_scores(*args, top_k=64)
    return {"tokens": int(mk.sum()), "vocab": E.shape[0], "top_k": 64,
            "spearman": float(spearmanr(exact.numpy(), approx.numpy()).statistic)}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.credit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--memory-child", choices=("lm_head", "datc_exact", "datc_top64"), help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.memory_child:
        _memory_child(a.memory_child)
        return
    from datc.atomic import atomic_write_json, atomic_write_text
    from datc.utils import quiet_libraries

    quiet_libraries()
    tb = paired_steps(a.steps, a.overrides)
    topk = topk_agreement(tb.pop("sessions")["datc"])
    real = bench_real_shape(a.repeats)
    result = {
        **provenance("python -m scripts.bench.credit " + " ".join(sys.argv[1:]), threads=1),
        "testbed": tb, "real_shape": real, "top_k_testbed": topk,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    atomic_write_json(OUT / "credit.json", result)
    r, med = real["ratio_to_lm_head"], tb["median_seconds"]
    lines = [
        "# DATC cost", "", f"Command: `{result['command']}` (torch {result['machine']['torch']}, 1 thread).", "",
        "## Testbed training step, medians over interleaved steps", "",
        "| phase | grpo (s) | datc (s) |", "|---|---|---|",
        *[f"| {k.split('/')[1][:-2]} | {med['grpo'][k]:.4f} | {med['datc'][k]:.4f} |" for k in med["grpo"]],
        "", f"**datc / grpo step time: {tb['datc_over_grpo_step']:.3f}** (quartiles of the paired ratios: "
        + ", ".join(f"{q:.3f}" for q in tb["paired_ratio_quartiles"]) + f"); reward-model gradient adds "
        f"{tb['rm_gradient_extra_s'] * 1000:.1f} ms to the reward phase.", "",
        f"## Real shape: |V| = {V:,}, d = {D}, {N} tokens", "",
        "| computation | median s | × LM-head matmul | peak RSS growth (MB) |", "|---|---|---|---|",
        *[f"| {k} | {real['seconds_median'][k]:.3f} | {r[k]:.2f} | {real['peak_rss_growth_mb'][k]:.0f} |" for k in r],
        "", f"## top_k = 64 on testbed rollouts: Spearman {topk['spearman']:.4f} to the exact scores "
        f"({topk['tokens']} tokens, |V| = {topk['vocab']}).", "",
    ]
    atomic_write_text(OUT / "credit.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
