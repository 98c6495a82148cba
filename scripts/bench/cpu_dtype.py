"""Training-step time in float32 against bfloat16 compute (``policy.dtype``), two sessions in one
process, their steps interleaved, written to results/bench/cpu_dtype_<name>.{json,md}.

    nice -n 10 python -m scripts.bench.cpu_dtype --name real --steps 4 experiment=real_smollm2 trainer.threads=1

``policy.dtype=bfloat16`` keeps float32 master weights and the optimizer's state; the update runs
under bf16 autocast and the frozen models (reference, reward model) hold bf16 weights
(:func:`datc.training.model_set.load_models`). On a CPU with bf16 instructions (``avx512_bf16``,
``amx_bf16``) oneDNN runs its matmuls in bf16; elsewhere they are emulated and slower. What this
measures is time per step and per phase; whether the learning is the same is not measured here
(a study compares runs of one dtype only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("float32", "bfloat16")
PHASES = ("step_s", "rollout_s", "reward_s", "credit_s", "update_s")
MIN_TIMED_S = 0.01  # a phase's ratio is left out below this median (a scheme without credit work: noise)


def cpu_flags() -> list[str]:
    """The CPU's bf16 and AMX flags from /proc/cpuinfo (empty where it is missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return sorted(f for f in set(flags) if "bf16" in f or f.startswith("amx"))


def summarize(times: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Per dtype and phase the median, min and max over the measured steps; the float32 / bfloat16
    ratio of the medians (above 1: bf16 faster)."""
    out: dict[str, Any] = {d: {p: {"median": statistics.median(v), "min": min(v), "max": max(v)} for p, v in ph.items()}
                           for d, ph in times.items()}
    out["float32_over_bfloat16"] = {p: out["float32"][p]["median"] / out["bfloat16"][p]["median"]
                                    for p in PHASES if min(out[d][p]["median"] for d in DTYPES) >= MIN_TIMED_S}
    return out


def markdown(res: dict[str, Any]) -> str:
    s, la = res["summary"], res["load_average"]
    rows = [f"| {d} | " + " | ".join(f"{s[d][p]['median']:.2f}" for p in PHASES)
            + f" | {s[d]['response_len']['median']:.1f} |" for d in DTYPES]
    r = s["float32_over_bfloat16"]
    ratio = " | ".join(f"{r[p]:.2f}" if p in r else "-" for p in PHASES)
    return "\n".join([
        f"# Step time, float32 against bfloat16 compute on a CPU: {res['name']}", "",
        f"Written by `{res['command']}` (`scripts/bench/cpu_dtype.py`) at commit `{res['commit']}` ({res['date']}), "
        f"torch {res['machine']['torch']}, {res['threads']} torch thread(s), {res['machine']['cpus']} CPUs (bf16 flags: {', '.join(res['cpu_flags']) or 'none'}); "
        f"load average (1, 5, 15 min) {la} at the start, {res['load_average_end']} at the end.", "",
        f"Two sessions of the same config in one process, `policy.dtype` float32 and bfloat16, their steps "
        f"interleaved (the order alternating), {res['steps']} measured steps each after one warm-up step. "
        "Medians in seconds:", "",
        "| policy.dtype | step | rollout | reward (frozen passes) | credit | update | response length |",
        "|---|---|---|---|---|---|---|", *rows,
        f"| float32 / bfloat16 | {ratio} | |", "",
        "Time only: whether bf16 compute learns the same is not measured here.", ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.cpu_dtype", description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True, help="the result's name: results/bench/cpu_dtype_<name>.md")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per dtype (after one warm-up step each)")
    ap.add_argument("--out", default=str(ROOT / "results/bench"))
    ap.add_argument("overrides", nargs="*", help="hydra overrides of both sessions (policy.dtype is set here)")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error("--steps: at least 1")
    if any(o.split("=", 1)[0].lstrip("+~") == "policy.dtype" for o in a.overrides):
        ap.error("policy.dtype: set by this script (float32 and bfloat16), leave it out of the overrides")
    import os

    import torch

    from datc.analysis.inputs import session_for
    from datc.run.provenance import provenance
    from datc.step import train_step
    from datc.utils import quiet_libraries
    from scripts.bench.render import write_result

    quiet_libraries()
    res: dict[str, Any] = {**provenance(" ".join(["python -m scripts.bench.cpu_dtype", *(argv if argv is not None else sys.argv[1:])])),
                           "name": a.name, "steps": a.steps, "cpu_flags": cpu_flags()}
    sessions = {d: session_for([*a.overrides, f"policy.dtype={d}"]) for d in DTYPES}
    torch.set_num_threads(sessions["float32"].c.trainer.threads)  # as datc-train does (trainer.threads)
    res["threads"] = torch.get_num_threads()
    times: dict[str, dict[str, list[float]]] = {d: {p: [] for p in (*PHASES, "response_len")} for d in DTYPES}
    for it in range(a.steps + 1):
        for d in DTYPES if it % 2 == 0 else reversed(DTYPES):
            m = train_step(sessions[d], it).metrics
            if it > 0:  # the first round warms up
                for p in PHASES:
                    times[d][p].append(m[f"perf/{p}"])
                times[d]["response_len"].append(m["rollout/response_len"])
    res["all"] = times
    res["summary"] = summarize(times)
    res["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print(write_result(Path(a.out), f"cpu_dtype_{a.name}", res, markdown(res)).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
