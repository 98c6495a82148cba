"""A run's resident memory over its steps: whether it stays flat. Runs ``datc-train`` in a child
process with the given overrides (``trainer.steps`` as asked), samples the resident set of the
child and every process under it (vLLM's engine core runs in one) every second, and reads each
step's ``perf/rss_gb`` (the trainer's own VmRSS at the step's end) and ``perf/peak_mem_gb`` from
the run's ``metrics.jsonl``.

    DATC_CACHE=CACHE nice -n 19 python -m scripts.bench.memory_trace --name real_torch --steps 30 \\
        experiment=real_smollm2 trainer.threads=1
    -> results/bench/memory_trace_<name>.json, results/bench/memory_trace_<name>.md

"Flat" is read off the steps after the warm-up: the least-squares slope of the trainer's resident
set over the second half of the steps (MB per step) and its range there. Run it in the
environment that has the engine (``.venv-vllm`` for ``rollout=vllm``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from scripts.bench.render import write_result

OUT = Path("results/bench")


def tree_rss_mb(pid: int) -> tuple[float, int]:
    """The resident set of ``pid`` and all its descendants, MB, and how many processes that is."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return float("nan"), 0
    total, n = 0, 0
    for p in procs:
        try:
            total += p.memory_info().rss
            n += 1
        except psutil.Error:
            pass
    return total / 2**20, n


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys over xs."""
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else float("nan")


def trace(overrides: list[str], steps: int, run_dir: Path, every_s: float = 1.0) -> dict[str, Any]:
    """Run ``datc-train`` and trace it: the samples of the process tree and the steps' metrics."""
    cmd = [sys.executable, "-m", "datc.train", *overrides, f"trainer.steps={steps}", f"run_dir={run_dir}"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: list[dict[str, float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            mb, n = tree_rss_mb(proc.pid)
            if n:
                samples.append({"t_s": round(time.monotonic() - t0, 1), "tree_rss_mb": round(mb, 1), "processes": n})
            done.wait(every_s)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _, err = proc.communicate()
    done.set()
    th.join()
    if proc.returncode:
        raise SystemExit(f"memory_trace: datc-train exited {proc.returncode}: {err.strip().splitlines()[-1] if err.strip() else ''}")
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "perf/rss_gb" in rec:
            rows.append({"step": rec.get("step"), "rss_gb": rec["perf/rss_gb"], "peak_gb": rec.get("perf/peak_mem_gb"),
                         "step_s": rec.get("perf/step_s")})
    shown = [a for a in cmd[1:] if not a.startswith("run_dir=")]  # a temporary directory: not part of the command
    return {"command": shown, "samples": samples, "steps": rows, "wall_s": round(time.monotonic() - t0, 1)}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    rows = res["steps"]
    half = rows[len(rows) // 2:]
    rss = [r["rss_gb"] * 1024 for r in half]
    tree = [s["tree_rss_mb"] for s in res["samples"]]
    return {"steps": len(rows), "rss_first_gb": rows[0]["rss_gb"], "rss_last_gb": rows[-1]["rss_gb"],
            "rss_max_gb": max(r["rss_gb"] for r in rows), "peak_last_gb": rows[-1]["peak_gb"],
            "second_half_slope_mb_per_step": slope([float(r["step"]) for r in half], rss),
            "second_half_range_mb": max(rss) - min(rss), "tree_max_gb": max(tree) / 1024 if tree else float("nan")}


def markdown(res: dict[str, Any]) -> str:
    s = res["summary"]
    table = ["| step | trainer RSS (GB) | high-water mark (GB) | step (s) |", "|---|---|---|---|"]
    table += [f"| {r['step']} | {r['rss_gb']:.2f} | {r['peak_gb']:.2f} | {r['step_s']:.1f} |" for r in res["steps"]]
    la = res["load_average"]
    return f"""# A run's resident memory over its steps: {res['name']}

Written by `{res['command']}` (`scripts/bench/memory_trace.py`) at commit `{res['commit']}` ({res['date']}),
torch {res['machine']['torch']}, {res['machine']['cpus']} CPUs; load average (1, 5, 15 min) {la} at the start.
The run: `datc-train {' '.join(res['trace']['command'][2:])}`, {res['trace']['wall_s']:.0f} s.

Over {s['steps']} steps the trainer's resident set went from **{s['rss_first_gb']:.2f} GB** after step 1 to
**{s['rss_last_gb']:.2f} GB** at the last (largest {s['rss_max_gb']:.2f} GB; its high-water mark {s['peak_last_gb']:.2f} GB).
Over the second half of the steps: slope **{s['second_half_slope_mb_per_step']:+.1f} MB a step**, range
{s['second_half_range_mb']:.0f} MB. The process tree (the trainer and every process under it, sampled each second)
peaked at {s['tree_max_gb']:.2f} GB.

{chr(10).join(table)}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.memory_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True, help="the result's name: results/bench/memory_trace_<name>.md")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("overrides", nargs="*", help="hydra overrides of the run (e.g. experiment=real_smollm2 rollout=vllm)")
    a = ap.parse_args(argv)
    if a.steps < 4:
        ap.error("--steps: at least 4 (the slope is read over the second half)")
    from datc.run.provenance import provenance

    res: dict[str, Any] = {**provenance(" ".join(["python -m scripts.bench.memory_trace", *(argv if argv is not None else sys.argv[1:])])),
                           "name": a.name}
    with tempfile.TemporaryDirectory(prefix="datc-memory-trace-") as root:
        res["trace"] = trace(list(a.overrides), a.steps, Path(root) / "run")
    res["steps"] = res["trace"].pop("steps")
    res["samples"] = res["trace"].pop("samples")
    res["summary"] = summarize(res)
    print(write_result(Path(a.out), f"memory_trace_{a.name}", res, markdown(res)).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
