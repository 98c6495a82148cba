"""What oneDNN's process-wide primitive cache costs a vLLM CPU engine in memory and time: the
linear layers of SmolLM2-135M (30 layers of q, k+v, gate+up and down projections as vLLM's CPU
backend dispatches them, ``create_onednn_mm`` with its per-layer cache of 32 primitives), called
at a growing number of distinct row counts ``M`` (a generation call's prefill and decode batches
differ in rows), the resident set read as they grow; then a second pass over the same row counts,
timed. One process per capacity (oneDNN reads ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` once, at its
first primitive). Run it in ``.venv-vllm``:

    nice -n 10 .venv-vllm/bin/python -m scripts.bench.onednn_cache --capacities default,1024,128,0

Written to results/bench/onednn_cache.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# SmolLM2-135M (hidden 576, 9 heads of 64, 3 KV heads, MLP 1536) per layer as vLLM's CPU backend
# makes its linear layers: qkv fused (576 + 2 x 192 rows), o, gate+up fused, down: (N, K)
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def child(ms: int, every: int) -> dict[str, Any]:
    """In this process: every layer's handler made, each called at row counts 1..ms; the resident
    set (MB above the handlers') after every ``every`` row counts, then a second pass timed."""
    import torch
    from vllm import _custom_ops as ops

    from datc.utils import resident_mb

    torch.set_num_threads(1)
    torch.manual_seed(0)
    handlers = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            w = torch.randn(n, k)
            handlers.append((ops.create_onednn_mm(w.t(), 32), k, w))
    xs = {k: torch.randn(ms, k) for _, k in SHAPES}
    base = resident_mb()[0]
    grown = []
    t0 = time.perf_counter()
    for m in range(1, ms + 1):
        for h, k, _ in handlers:
            ops.onednn_mm(h, xs[k][:m], None)
        if m % every == 0:
            grown.append([m, round(resident_mb()[0] - base, 1)])
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for m in range(1, ms + 1):
        for h, k, _ in handlers:
            ops.onednn_mm(h, xs[k][:m], None)
    return {"handlers": len(handlers), "base_mb": round(base, 1), "grown_mb": grown, "first_pass_s": round(first_s, 2),
            "second_pass_s": round(time.perf_counter() - t0, 2), "after_second_mb": round(resident_mb()[0] - base, 1)}


def markdown(res: dict[str, Any]) -> str:
    la = res["load_average"]
    runs = res["runs"]
    marks = [m for m, _ in next(iter(runs.values()))["grown_mb"]]
    lines = [
        "# oneDNN's primitive cache under vLLM's CPU matmuls", "",
        f"Written by `{res['command']}` (`scripts/bench/onednn_cache.py`) at commit `{res['commit']}` ({res['date']}), "
        f"torch {res['machine']['torch']}, {res['machine']['cpus']} CPUs, one thread; load average (1, 5, 15 min) {la} at the start.", "",
        f"{next(iter(runs.values()))['handlers']} oneDNN matmul handlers shaped as SmolLM2-135M's linear layers "
        f"(vLLM's `create_onednn_mm`, its own cache of 32 primitives each), each called at row counts 1 to {res['ms']} in turn; "
        "the resident set above the handlers' after every step of row counts, then the same calls again, timed. "
        "One process per capacity of oneDNN's process-wide cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`; default: unset, oneDNN's 1024).", "",
        "| capacity | " + " | ".join(f"+MB at {m} row counts" for m in marks) + " | +MB after the second pass | first pass (s) | second pass (s) |",
        "|---|" + "---|" * (len(marks) + 3)]
    for cap, r in runs.items():
        lines.append(f"| {cap} | " + " | ".join(f"{mb:+.0f}" for _, mb in r["grown_mb"])
                     + f" | {r['after_second_mb']:+.0f} | {r['first_pass_s']:.1f} | {r['second_pass_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.onednn_cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--capacities", default="default,1024,128,0", help="comma-separated; default = the variable unset")
    ap.add_argument("--ms", type=int, default=160, help="distinct row counts, 1 to this")
    ap.add_argument("--every", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "results/bench"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.ms, a.every)))
        return 0
    caps = [c for c in a.capacities.split(",") if c]
    if bad := [c for c in caps if c != "default" and not (c.isdigit())]:
        ap.error(f"--capacities: {', '.join(bad)}: an integer >= 0 or default")
    from datc.run.provenance import provenance
    from scripts.bench.render import write_result

    res: dict[str, Any] = {**provenance(" ".join(["python -m scripts.bench.onednn_cache", *(argv if argv is not None else sys.argv[1:])])),
                           "ms": a.ms, "runs": {}}
    for cap in caps:
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
        if cap != "default":
            env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = cap
        p = subprocess.run([sys.executable, "-m", "scripts.bench.onednn_cache", "--child", "--ms", str(a.ms), "--every", str(a.every)],
                           cwd=ROOT, env=env, capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"onednn_cache: the capacity {cap} run failed:\n{p.stderr[-2000:]}")
        res["runs"][cap] = json.loads(p.stdout.strip().splitlines()[-1])
        print(cap, res["runs"][cap], flush=True)
    print(write_result(Path(a.out), "onednn_cache", res, markdown(res)).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
