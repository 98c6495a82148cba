"""DATC's exact credit in low precision against float64, over a stated family of inputs at the
paper presets' real shapes, written to results/bench/credit_precision.{json,md}.

For each family's reward-model shape (Qwen3-1.7B: |V| = 151,936, d = 2048; Llama-3.2-1B:
|V| = 128,256, d = 2048) and ``--tokens`` response tokens (default 256, as 2 responses of 128,
one of each sign), :func:`datc.credit.datc_math.datc_scores` (jacobian, projection, signed: the
preset's DATC) runs with ``matmul_dtype`` float32, bfloat16 and tf32 (on a CPU bf16 products are
torch's CPU bf16 GEMM, TF32 is emulated by rounding both operands to a 10-bit mantissa), and the
scores go through the weight step (datc.credit.weights, the preset's softmax normalizer, tau 1),
each against the same computation in float64.

The family (``--scales`` x the embeddings below x ``--seeds`` draws, at each shape): logits
``scale·N(0,1)`` for scale 0.5, 1, 2, 4 (4: as scripts/bench/credit.py and the GPU check, peaked;
0.5: nearly flat over |V|), sampled ids drawn from them, reward gradients N(0,1), and an
embedding matrix ``N(0, σ²)`` for σ = 1 and 0.02 in float32 (``gauss``), ``0.02·N(0,1)`` rounded to
bf16 (``bf16``: a bf16 reward model's own), and the same with a common component of that scale
added to every row before the rounding (``bf16_shifted``: real embeddings share a mean vector).
Scale 4 with ``bf16`` and ``bf16_shifted`` is the construction this benchmark used alone before.
Each draw has its own seed. Reported per path: the largest error and high quantiles over every
token of the family, the largest per logit scale and per embedding, and each construction's.

The floor the reward model's inputs already carry on a GPU (scale 4, bf16 embeddings): the
reward gradient rounded to bf16 (the reward model runs in bf16 there), through float64.

    python -m scripts.bench.credit_precision [--tokens 256] [--families qwen3 llama32]
        [--scales 0.5 1 2 4] [--embeddings gauss_1 gauss_0.02 bf16 bf16_shifted] [--seeds 1]
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

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "results" / "bench"
SHAPES = {"qwen3": (151_936, 2048), "llama32": (128_256, 2048)}
PATHS = ("float32", "bfloat16", "tf32")
RESPONSE = 128  # tokens per response
SCALES = (0.5, 1.0, 2.0, 4.0)
EMBEDDINGS = ("gauss_1", "bf16", "bf16_shifted")  # the defaults; gauss_0.02 (E ~ N(0, 0.02²)) on request
EMBEDDING_CHOICES = ("gauss_1", "gauss_0.02", "bf16", "bf16_shifted")
QUANTILES = (0.99, 0.999)


def inputs(vocab: int, hidden: int, tokens: int, scale: float = 4.0, embedding: str = "bf16", seed: int = 0):
    """(grad, E, logits, y, sign) of one construction of the family (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, vocab, generator=g).mul_(scale)
    sigma = float(embedding.split("_")[1]) if embedding.startswith("gauss_") else 0.02
    E = torch.randn(vocab, hidden, generator=g).mul_(sigma)
    if embedding == "bf16_shifted":
        E += sigma * torch.randn(1, hidden, generator=g)
    if embedding.startswith("bf16"):
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


def token_errors(s: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: the score error in units of its response's score spread (what the weight
    step's z-score sees) and the weight's relative error."""
    sr, rr = s.view(-1, RESPONSE), ref.view(-1, RESPONSE)
    z_err = ((sr - rr).abs() / rr.std(-1, unbiased=False, keepdim=True)).flatten()
    w, w_ref = weights(s), weights(ref)
    return z_err, ((w - w_ref).abs() / w_ref).flatten()


def summary(z_err: torch.Tensor, rel: torch.Tensor) -> dict[str, float]:
    out = {"score_err_max_in_std": float(z_err.max()), "score_err_median_in_std": float(z_err.median()),
           "weight_rel_err_max": float(rel.max()), "weight_rel_err_median": float(rel.median())}
    for q in QUANTILES:
        out[f"weight_rel_err_q{q}"] = float(rel.quantile(q))
        out[f"score_err_q{q}_in_std"] = float(z_err.quantile(q))
    return out


def measure(family: str, tokens: int, scale: float, embedding: str, seed: int, pooled: dict) -> dict:
    """One construction: each path's errors (its per-token errors also appended to ``pooled``)."""
    grad, E, logits, y, sign = inputs(*SHAPES[family], tokens, scale, embedding, seed)
    ref, t64 = scores(grad, E, logits, y, sign, torch.float64)
    case = {"family": family, "tokens": tokens, "scale": scale, "embedding": embedding, "seed": seed,
            "seconds": {"float64": t64}}
    for path in PATHS:
        s, case["seconds"][path] = scores(grad, E, logits, y, sign, matmul_dtype=path)
        z, rel = token_errors(s, ref)
        case[path] = summary(z, rel)
        pooled.setdefault(path, []).append((z, rel))
    if scale == 4.0 and embedding.startswith("bf16"):
        floor, _ = scores(grad.bfloat16().float(), E, logits, y, sign, torch.float64)
        case["reward_gradient_in_bf16"] = summary(*token_errors(floor, ref))
    return case


def family_summary(cases: list[dict], pooled: dict) -> dict:
    out = {}
    for path in PATHS:
        z, rel = (torch.cat([p[i] for p in pooled[path]]) for i in (0, 1))
        out[path] = {**summary(z, rel), "tokens": int(rel.numel()),
                     "weight_rel_err_max_by_scale": {str(s): max(c[path]["weight_rel_err_max"] for c in cases
                                                                 if c["scale"] == s) for s in {c["scale"] for c in cases}},
                     "weight_rel_err_max_by_embedding": {e: max(c[path]["weight_rel_err_max"] for c in cases
                                                                if c["embedding"] == e) for e in {c["embedding"] for c in cases}}}
    return out


def render(report: dict) -> str:
    la, fam, cases = report["load_average"], report["family"], report["cases"]
    shapes = ", ".join(f"{f} ({report['tokens']} x {v:,} x {d})" for f, (v, d) in SHAPES.items() if f in report["families"])
    lines = ["# DATC's exact credit in low precision against float64", "",
             f"Command: `{report['command']}` (commit {report['commit']}, {report['machine']}, load average "
             f"{la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f} at the start, {report['load_average_end'][0]:.2f} at the end; "
             f"torch {report['torch']}, {report['threads']} thread(s)). On a CPU: bf16 products are torch's CPU bf16 GEMM "
             "(float32 accumulation), TF32 is emulated (operands rounded to 10 mantissa bits, float32 product). Errors of "
             "`datc_scores(..., matmul_dtype=...)` (jacobian, projection, signed, chunks of 128) against the same "
             "computation in float64, on the same inputs; scores in units of their response's standard deviation "
             "(what the weight step's z-score sees), weights (softmax normalizer, tau 1, mean 1 per response of 128 "
             "tokens) as relative errors.", "",
             f"The family ({len(cases)} constructions, {fam['float32']['tokens']} tokens per path): shapes {shapes}; "
             f"logits `scale·N(0,1)`, scale in {', '.join(f'{s:g}' for s in report['scales'])}; embeddings "
             f"{', '.join(report['embeddings'])} (`gauss_σ`: E ~ N(0, σ²) in float32; `bf16`: 0.02·N(0,1) rounded to "
             "bf16; `bf16_shifted`: the same with a common component of that scale added to every row); reward "
             f"gradients N(0,1); {report['seeds']} draw(s) per construction and shape, each with its own seed. These "
             "are measured maxima over this family, not bounds: other inputs (other logit or embedding statistics, "
             "more tokens) can exceed them.", "",
             "## Over the whole family", "",
             "| path | weight rel err max | q99.9 | q99 | median | score err max (std) | q99.9 | q99 |",
             "|---|---|---|---|---|---|---|---|"]
    for path in PATHS:
        e = fam[path]
        lines.append(f"| {path} | {e['weight_rel_err_max']:.2e} | {e['weight_rel_err_q0.999']:.2e} | "
                     f"{e['weight_rel_err_q0.99']:.2e} | {e['weight_rel_err_median']:.2e} | {e['score_err_max_in_std']:.2e} | "
                     f"{e['score_err_q0.999_in_std']:.2e} | {e['score_err_q0.99_in_std']:.2e} |")
    scales, embs = sorted(fam["float32"]["weight_rel_err_max_by_scale"], key=float), report["embeddings"]
    lines += ["", "Largest weight relative error per logit scale and per embedding (each over the family's other axes):", "",
              "| path | " + " | ".join(f"scale {float(s):g}" for s in scales) + " | " + " | ".join(embs) + " |",
              "|---|" + "---|" * (len(scales) + len(embs))]
    for path in PATHS:
        e = fam[path]
        lines.append(f"| {path} | " + " | ".join(f"{e['weight_rel_err_max_by_scale'][s]:.2e}" for s in scales) + " | "
                     + " | ".join(f"{e['weight_rel_err_max_by_embedding'][m]:.2e}" for m in embs) + " |")
    lines += ["", "## Per construction", "",
              "Weight relative error, largest over the construction's tokens (score error max in std in brackets); "
              "the last column is float64 with the reward gradient rounded to bf16 (the input floor a bf16 reward "
              "model already carries), measured at scale 4 with bf16 embeddings.", "",
              "| family | embeddings | scale | seed | float32 | bfloat16 | tf32 | g in bf16, float64 | s (f64 / f32 / bf16 / tf32) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        cell = [f"{c[p]['weight_rel_err_max']:.2e} ({c[p]['score_err_max_in_std']:.1e})"
                for p in (*PATHS, "reward_gradient_in_bf16") if p in c]
        cell += ["-"] * (4 - len(cell))
        secs = " / ".join(f"{c['seconds'][p]:.1f}" for p in ("float64", *PATHS))
        lines.append(f"| {c['family']} | {c['embedding']} | {c['scale']:g} | {c['seed']} | {' | '.join(cell)} | {secs} |")
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.credit_precision", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256, help="response tokens (a multiple of 256)")
    ap.add_argument("--families", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--scales", nargs="+", type=float, default=list(SCALES), help="logit scales")
    ap.add_argument("--embeddings", nargs="+", default=list(EMBEDDINGS), choices=list(EMBEDDING_CHOICES))
    ap.add_argument("--seeds", type=int, default=1, help="draws per construction and shape")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    report = {"command": "python -m scripts.bench.credit_precision" + "".join(f" {x}" for x in (argv or [])),
              "commit": commit, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "torch": torch.__version__, "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
              "tokens": a.tokens, "families": a.families, "scales": a.scales, "embeddings": a.embeddings,
              "seeds": a.seeds, "cases": []}
    pooled: dict = {}
    draw = 0
    for fam in a.families:
        for emb in a.embeddings:
            for scale in a.scales:
                for _ in range(a.seeds):
                    report["cases"].append(measure(fam, a.tokens, scale, emb, draw, pooled))
                    draw += 1
                    c = report["cases"][-1]
                    print(f"{fam} {emb} scale {scale:g} seed {c['seed']}: " + ", ".join(
                        f"{p} {c[p]['weight_rel_err_max']:.2e}" for p in PATHS), flush=True)
    report["family"] = family_summary(report["cases"], pooled)
    report["load_average_end"] = os.getloadavg()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "credit_precision.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "credit_precision.md").write_text(render(report))
    print(render(report))
    return report


if __name__ == "__main__":
    main()
