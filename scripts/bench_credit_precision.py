"""DATC's exact credit in low precision against float64, at the paper presets' real shapes,
written to results/bench/credit_precision.{json,md}.

For each family's reward-model shape (Qwen3-1.7B: |V| = 151,936, d = 2048; Llama-3.2-1B:
|V| = 128,256, d = 2048) and ``--tokens`` response tokens (default 512, as 4 responses of 128),
:func:`datc.credit.datc_math.datc_scores` (jacobian, projection, signed: the preset's DATC) runs
with ``matmul_dtype`` float32, bfloat16 and tf32 (on a CPU bf16 products are torch's CPU bf16
GEMM, TF32 is emulated by rounding both operands to a 10-bit mantissa), and the scores go
through the weight step (datc.credit.weights, the preset's softmax normalizer, tau 1), each
against the same computation in float64. Inputs: logits 4·N(0,1) (as scripts/bench_credit.py
and the GPU check), sampled ids drawn from them, reward gradients N(0,1), and an embedding
matrix 0.02·N(0,1) rounded to bf16 (a bf16 reward model's own), once centred and once with a
common component of the same scale added to every row (real embeddings share a mean vector).

The floor the reward model's inputs already carry on a GPU: the reward gradient rounded to bf16
(the reward model runs in bf16 there), through the float64 computation.

    python scripts/bench_credit_precision.py [--tokens 512] [--families qwen3 llama32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from datc.credit.datc_math import datc_scores
from datc.credit.weights import WeightParams, scores_to_weights

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "bench"
SHAPES = {"qwen3": (151_936, 2048), "llama32": (128_256, 2048)}
PATHS = ("float32", "bfloat16", "tf32")
RESPONSE = 128  # tokens per response


def inputs(vocab: int, hidden: int, tokens: int, shifted: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, vocab, generator=g).mul_(4.0)
    E = torch.randn(vocab, hidden, generator=g).mul_(0.02)
    if shifted:
        E += 0.02 * torch.randn(1, hidden, generator=g)
    E = E.bfloat16().float()  # a bf16 reward model's embedding, held in float32
    grad = torch.randn(tokens, hidden, generator=g)
    y = torch.multinomial(torch.softmax(logits, -1), 1, generator=g).squeeze(-1)
    sign = torch.tensor([1.0, -1.0]).repeat_interleave(RESPONSE).repeat(tokens // (2 * RESPONSE) + 1)[:tokens]
    return grad, E, logits, y, sign


def scores(grad, E, logits, y, sign, dtype=None, matmul_dtype="float32"):
    if dtype is not None:
        grad, E, logits = grad.to(dtype), E.to(dtype), logits.to(dtype)
    t0 = time.perf_counter()
    s = datc_scores(grad, E, logits, y, sign, logit_map="jacobian", alignment="projection", chunk_size=128,
                    matmul_dtype=matmul_dtype)
    return s.double(), time.perf_counter() - t0


def weights(s: torch.Tensor) -> torch.Tensor:
    rows = s.view(-1, RESPONSE)
    w, _ = scores_to_weights(rows, torch.ones_like(rows, dtype=torch.bool), WeightParams())
    return w.double()


def errors(s: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Score error in units of each response's score spread (what the weight step's z-score
    sees), and the weights' relative error."""
    sr, rr = s.view(-1, RESPONSE), ref.view(-1, RESPONSE)
    z_err = ((sr - rr).abs() / rr.std(-1, unbiased=False, keepdim=True)).flatten()
    w, w_ref = weights(s), weights(ref)
    rel = ((w - w_ref).abs() / w_ref).flatten()
    return {"score_err_max_in_std": float(z_err.max()), "score_err_median_in_std": float(z_err.median()),
            "weight_rel_err_max": float(rel.max()), "weight_rel_err_median": float(rel.median()),
            "weight_abs_err_max": float((w - w_ref).abs().max())}


def measure(family: str, tokens: int) -> dict:
    vocab, hidden = SHAPES[family]
    out = {"vocab": vocab, "hidden": hidden, "tokens": tokens, "cases": {}}
    for shifted in (False, True):
        grad, E, logits, y, sign = inputs(vocab, hidden, tokens, shifted)
        ref, t64 = scores(grad, E, logits, y, sign, torch.float64)
        case = {"seconds": {"float64": t64}}
        for path in PATHS:
            s, t = scores(grad, E, logits, y, sign, matmul_dtype=path)
            case[path] = errors(s, ref)
            case["seconds"][path] = t
        floor, _ = scores(grad.bfloat16().float(), E, logits, y, sign, torch.float64)
        case["reward_gradient_in_bf16"] = errors(floor, ref)
        out["cases"]["shifted" if shifted else "centred"] = case
        del grad, E, logits
    return out


def render(report: dict) -> str:
    lines = ["# DATC's exact credit in low precision against float64", "",
             f"Command: `{report['command']}` (commit {report['commit']}, {report['machine']}, load average "
             f"{report['load_average'][0]:.2f} / {report['load_average'][1]:.2f} / {report['load_average'][2]:.2f} "
             f"at the start; torch {report['torch']}). On a CPU: bf16 products are torch's CPU bf16 GEMM (float32 "
             "accumulation), TF32 is emulated (operands rounded to 10 mantissa bits, float32 product). Errors of "
             "`datc_scores(..., matmul_dtype=...)` (jacobian, projection, signed, chunks of 128) against the same "
             "computation in float64, on the same inputs (module docstring of scripts/bench_credit_precision.py); "
             "scores in units of their response's standard deviation (what the weight step's z-score sees), "
             "weights (softmax normalizer, tau 1, mean 1 per response of 128 tokens) as relative errors.", "",
             "| family | tokens x V x d | embeddings | path | score err max (std) | median | weight rel err max | median | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for fam, r in report["families"].items():
        for emb, c in r["cases"].items():
            for path in (*PATHS, "reward_gradient_in_bf16"):
                e = c[path]
                label = "g rounded to bf16, float64 (input floor)" if path == "reward_gradient_in_bf16" else path
                secs = f"{c['seconds'][path]:.2f}" if path in c["seconds"] else "-"
                lines.append(f"| {fam} | {r['tokens']} x {r['vocab']:,} x {r['hidden']} | {emb} | {label} | "
                             f"{e['score_err_max_in_std']:.2e} | {e['score_err_median_in_std']:.2e} | "
                             f"{e['weight_rel_err_max']:.2e} | {e['weight_rel_err_median']:.2e} | {secs} |")
    lines += ["", "float64 itself took " + ", ".join(f"{c['seconds']['float64']:.1f} s ({fam}, {emb})"
                                                     for fam, r in report["families"].items()
                                                     for emb, c in r["cases"].items()) + " on this CPU.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512, help="response tokens (a multiple of 256)")
    ap.add_argument("--families", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    report = {"command": "python scripts/bench_credit_precision.py" + "".join(f" {x}" for x in (argv or [])),
              "commit": commit, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "torch": torch.__version__, "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
              "families": {}}
    for fam in a.families:
        report["families"][fam] = measure(fam, a.tokens)
        print(f"{fam}: done", flush=True)
    report["load_average_end"] = os.getloadavg()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "credit_precision.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "credit_precision.md").write_text(render(report))
    print(render(report))
    return report


if __name__ == "__main__":
    main()
