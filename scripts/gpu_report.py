"""Print one line per run directory: mean step time, tokens/s, samples/s (warm-up steps
skipped), peak memory and final eval metrics. Used by the GPU check scripts.

    python scripts/gpu_report.py runs/gpu_check/none runs/gpu_check/zero2 ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def row(run: Path, skip: int = 2) -> str:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_s" in r]
    steps = steps[skip:] or steps  # the first steps include warm-up (allocator, kernels)

    def mean(k: str) -> float:
        return sum(r[k] for r in steps) / len(steps)

    peak = max(r.get("perf/peak_mem_gb", float("nan")) for r in steps)
    final = json.loads((run / "summary.json").read_text())["eval"]["final"] if (run / "summary.json").exists() else {}
    gold = final.get("eval/gold")
    return (f"{run.name:<28} {mean('perf/step_s'):>8.3f} {mean('perf/tokens_per_s'):>10.0f} {mean('perf/samples_per_s'):>10.1f} "
            f"{peak:>9.2f} {final.get('eval/rm_score', float('nan')):>9.3f} {'-' if gold is None else f'{gold:.3f}':>6}")


def main(paths: list[str]) -> None:
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (no GPU: a smoke test, not a measurement)"
    print(f"device: {dev}")
    print(f"{'run':<28} {'step s':>8} {'tokens/s':>10} {'samples/s':>10} {'peak GiB':>9} {'rm score':>9} {'gold':>6}")
    for p in paths:
        print(row(Path(p)))


if __name__ == "__main__":
    main(sys.argv[1:])
