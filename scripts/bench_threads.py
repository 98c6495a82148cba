"""Training-step time against the torch thread count, interleaved in one process, written to
results/bench/threads.{json,md}. Chooses ``trainer.threads``' default.

    python scripts/bench_threads.py [--steps 20] [--threads 1 2] [hydra overrides ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from datc.analysis.inputs import session_for
    from datc.run.provenance import provenance
    from datc.step import train_step
    from datc.utils import atomic_write_json, atomic_write_text, quiet_libraries

    quiet_libraries()
    s = session_for(a.overrides)
    times: dict[int, list[float]] = {n: [] for n in a.threads}
    for it in range(a.steps + 1):
        for n in a.threads if it % 2 == 0 else reversed(a.threads):
            torch.set_num_threads(n)
            m = train_step(s, it).metrics
            if it > 0:  # the first round warms up
                times[n].append(m["perf/step_s"])
    res = {n: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "cv": statistics.stdev(v) / statistics.mean(v)}
           for n, v in times.items()}
    cmd = "python scripts/bench_threads.py " + " ".join(sys.argv[1:])
    atomic_write_json(ROOT / "results/bench/threads.json", {**provenance(cmd), "steps": a.steps, "threads": res, "all": times})
    lines = ["# Step time against torch threads", "", f"Command: `{cmd}`", "",
             "| threads | median s | min s | max s | coefficient of variation |", "|---|---|---|---|---|",
             *[f"| {n} | {r['median_s']:.4f} | {r['min_s']:.4f} | {r['max_s']:.4f} | {r['cv']:.2f} |" for n, r in res.items()]]
    atomic_write_text(ROOT / "results/bench/threads.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
