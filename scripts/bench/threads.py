"""Training-step time against the torch thread count, interleaved in one process, written to
results/bench/threads.{json,md}. Chooses ``trainer.threads``' default.

    python -m scripts.bench.threads [--steps 20] [--threads 1 2] [--busy N] [hydra overrides ...]

``--busy N`` runs the measurement beside N busy processes at the same priority (a machine shared
with other jobs), written to results/bench/threads_busy<N>.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.threads", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--busy", type=int, default=0, help="busy processes beside the measurement")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from datc.analysis.inputs import session_for
    from datc.atomic import atomic_write_json, atomic_write_text
    from datc.run.provenance import provenance
    from datc.step import train_step
    from datc.utils import quiet_libraries

    quiet_libraries()
    s = session_for(a.overrides)
    times: dict[int, list[float]] = {n: [] for n in a.threads}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        for it in range(a.steps + 1):
            for n in a.threads if it % 2 == 0 else reversed(a.threads):
                torch.set_num_threads(n)
                m = train_step(s, it).metrics
                if it > 0:  # the first round warms up
                    times[n].append(m["perf/step_s"])
    finally:
        for b in busy:
            b.kill()
    res = {n: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "cv": statistics.stdev(v) / statistics.mean(v)}
           for n, v in times.items()}
    cmd = "python -m scripts.bench.threads " + " ".join(sys.argv[1:])
    name = f"threads_busy{a.busy}" if a.busy else "threads"
    info = provenance(cmd)
    atomic_write_json(ROOT / f"results/bench/{name}.json", {**info, "steps": a.steps, "busy": a.busy, "threads": res, "all": times})
    beside = f", beside {a.busy} busy process(es) at the same priority" if a.busy else ""
    lines = ["# Step time against torch threads", "",
             f"Command: `{cmd}` (commit {info['commit']}, {info['machine']['cpus']} CPUs{beside}; load average at the end "
             f"{info['load_average'][0]})", "",
             "| threads | median s | min s | max s | coefficient of variation |", "|---|---|---|---|---|",
             *[f"| {n} | {r['median_s']:.4f} | {r['min_s']:.4f} | {r['max_s']:.4f} | {r['cv']:.2f} |" for n, r in res.items()]]
    atomic_write_text(ROOT / f"results/bench/{name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
