"""A run's resident memory over its steps: whether it stays flat. Runs ``datc-train`` in a child
process with the given overrides (``trainer.steps`` as asked), samples the resident set of the
child and every process under it (vLLM's engine core runs in one) every second, and reads each
step's ``perf/rss_gb`` (the trainer's own VmRSS at the step's end) and ``perf/peak_mem_gb`` from
the run's ``metrics.jsonl``.

    DATC_CACHE=CACHE nice -n 19 python -m scripts.bench.memory_trace --name real_torch --steps 30 \\
        experiment=real_smollm2 trainer.threads=1
    -> results/bench/memory_trace_<name>.json, results/bench/memory_trace_<name>.md

"Flat" is read off the steps after the warm-up: the least-squares slope of the trainer's resident
set over the second half of the steps (MB per step) and its range there, and the same slopes of the
process tree's highest and lowest sample within each step (a step's samples are those taken while
its line was the next to come: its own work and any evaluation before it). The trainer's high-water
mark alone cannot tell a creep from new records of a noisy peak (it only rises); a rising floor can.
Run it in the environment that has the engine (``.venv-vllm`` for ``rollout=vllm``).

    python -m scripts.bench.memory_trace --windows results/bench/memory_trace_<name>.json --width 300 --skip 600

reads a committed trace again: the tree's highest and lowest sample in each window of ``--width``
seconds (for traces whose samples do not carry their step).
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
    """The resident set of ``pid`` and all its descendants, MB, and how many processes that is. A
    process that has exited and is not yet reaped (a zombie: its resident set reads 0) is not counted."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return float("nan"), 0
    total, n = 0, 0
    for p in procs:
        try:
            rss = p.memory_info().rss
        except psutil.Error:
            continue
        if rss > 0:
            total, n = total + rss, n + 1
    return total / 2**20, n


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys over xs."""
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else float("nan")


def steps_logged(metrics: Path) -> int:
    """How many step lines (those with ``perf/rss_gb``) ``metrics.jsonl`` holds now (0 before it exists)."""
    try:
        return sum('"perf/rss_gb"' in line for line in metrics.read_text().splitlines())
    except OSError:
        return 0


def per_step(samples: list[dict[str, Any]], steps: int) -> list[dict[str, float]]:
    """The tree's highest and lowest sample (MB) within each step: the samples taken while step ``k``'s
    line was the next to come (``steps_done == k - 1``); steps with no sample are left out."""
    out = []
    for k in range(1, steps + 1):
        xs = [s["tree_rss_mb"] for s in samples if s.get("steps_done") == k - 1]
        if xs:
            out.append({"step": k, "peak_mb": max(xs), "floor_mb": min(xs), "samples": len(xs)})
    return out


def windows(samples: list[dict[str, Any]], width_s: float) -> list[dict[str, float]]:
    """The tree's highest and lowest sample (MB) in consecutive windows of ``width_s`` seconds."""
    out: list[dict[str, float]] = []
    for s in samples:
        start = (s["t_s"] // width_s) * width_s
        if not out or out[-1]["start_s"] != start:
            out.append({"start_s": start, "peak_mb": s["tree_rss_mb"], "floor_mb": s["tree_rss_mb"], "samples": 0})
        w = out[-1]
        w["peak_mb"], w["floor_mb"] = max(w["peak_mb"], s["tree_rss_mb"]), min(w["floor_mb"], s["tree_rss_mb"])
        w["samples"] += 1
    return out


def trace(overrides: list[str], steps: int, run_dir: Path, every_s: float = 1.0) -> dict[str, Any]:
    """Run ``datc-train`` and trace it: the samples of the process tree and the steps' metrics."""
    cmd = [sys.executable, "-m", "datc.train", *overrides, f"trainer.steps={steps}", f"run_dir={run_dir}"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: list[dict[str, float]] = []
    done = threading.Event()
    metrics = run_dir / "metrics.jsonl"

    def sample() -> None:
        while not done.is_set():
            mb, n = tree_rss_mb(proc.pid)
            if n:
                samples.append({"t_s": round(time.monotonic() - t0, 1), "tree_rss_mb": round(mb, 1), "processes": n,
                                "steps_done": steps_logged(metrics)})
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
    steps = per_step(res["samples"], len(rows))
    late = [w for w in steps if w["step"] > len(rows) // 2]
    xs = [float(w["step"]) for w in late]
    return {"steps": len(rows), "rss_first_gb": rows[0]["rss_gb"], "rss_last_gb": rows[-1]["rss_gb"],
            "rss_max_gb": max(r["rss_gb"] for r in rows), "peak_last_gb": rows[-1]["peak_gb"],
            "second_half_slope_mb_per_step": slope([float(r["step"]) for r in half], rss),
            "second_half_range_mb": max(rss) - min(rss), "tree_max_gb": max(tree) / 1024 if tree else float("nan"),
            "tree_step_peak_slope_mb_per_step": slope(xs, [w["peak_mb"] for w in late]),
            "tree_step_floor_slope_mb_per_step": slope(xs, [w["floor_mb"] for w in late])}


def markdown(res: dict[str, Any]) -> str:
    s = res["summary"]
    tree = {w["step"]: w for w in per_step(res["samples"], len(res["steps"]))}
    table = ["| step | trainer RSS (GB) | high-water mark (GB) | tree: highest, lowest sample (GB) | step (s) |",
             "|---|---|---|---|---|"]
    table += [f"| {r['step']} | {r['rss_gb']:.2f} | {r['peak_gb']:.2f} | "
              + (f"{tree[r['step']]['peak_mb'] / 1024:.2f}, {tree[r['step']]['floor_mb'] / 1024:.2f}" if r["step"] in tree else "-")
              + f" | {r['step_s']:.1f} |" for r in res["steps"]]
    la = res["load_average"]
    return f"""# A run's resident memory over its steps: {res['name']}

Written by `{res['command']}` (`scripts/bench/memory_trace.py`) at commit `{res['commit']}` ({res['date']}),
torch {res['machine']['torch']}, {res['machine']['cpus']} CPUs; load average (1, 5, 15 min) {la} at the start.
The run: `datc-train {' '.join(res['trace']['command'][2:])}`, {res['trace']['wall_s']:.0f} s.

Over {s['steps']} steps the trainer's resident set went from **{s['rss_first_gb']:.2f} GB** after step 1 to
**{s['rss_last_gb']:.2f} GB** at the last (largest {s['rss_max_gb']:.2f} GB; its high-water mark {s['peak_last_gb']:.2f} GB).
Over the second half of the steps: slope **{s['second_half_slope_mb_per_step']:+.1f} MB a step**, range
{s['second_half_range_mb']:.0f} MB. The process tree (the trainer and every process under it, sampled each second)
peaked at {s['tree_max_gb']:.2f} GB; over the second half its highest sample within a step moved
**{s['tree_step_peak_slope_mb_per_step']:+.1f} MB a step** and its lowest **{s['tree_step_floor_slope_mb_per_step']:+.1f} MB a step**
(least squares).

{chr(10).join(table)}
"""


def print_windows(path: Path, width_s: float, skip_s: float) -> int:
    """The ``--windows`` table of a trace's samples, and the least-squares slopes (MB an hour) of its
    windows' highest and lowest samples over the windows that begin at ``skip_s`` or later (past the
    start-up: loading, the engine's start, the first evaluation) and before the last (the run's end)."""
    res = json.loads(path.read_text())
    ws = windows(res["samples"], width_s)
    print(f"{path}: the process tree's samples in windows of {width_s:g} s")
    print("| from (s) | highest (GB) | lowest (GB) | samples |\n|---|---|---|---|")
    for w in ws:
        print(f"| {w['start_s']:.0f} | {w['peak_mb'] / 1024:.2f} | {w['floor_mb'] / 1024:.2f} | {w['samples']} |")
    mid = [w for w in ws[:-1] if w["start_s"] >= skip_s]
    xs = [w["start_s"] / 3600 for w in mid]
    print(f"the {len(mid)} windows from {skip_s:g} s to the last: highest {slope(xs, [w['peak_mb'] for w in mid]):+.0f} MB an hour, "
          f"lowest {slope(xs, [w['floor_mb'] for w in mid]):+.0f} MB an hour")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.memory_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", help="the result's name: results/bench/memory_trace_<name>.md")
    ap.add_argument("--windows", metavar="JSON", help="read a committed trace instead of running one: its tree's "
                    "highest and lowest sample in each window of --width seconds")
    ap.add_argument("--width", type=float, default=300.0, help="--windows: the window, seconds")
    ap.add_argument("--skip", type=float, default=600.0, help="--windows: the slopes leave out the windows that begin "
                    "before this many seconds (the start-up)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("overrides", nargs="*", help="hydra overrides of the run (e.g. experiment=real_smollm2 rollout=vllm)")
    a = ap.parse_args(argv)
    if a.windows:
        return print_windows(Path(a.windows), a.width, a.skip)
    if not a.name:
        ap.error("--name: required to run a trace (or give --windows JSON)")
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
