"""Achieved FLOP/s of each phase of this project's training step against the machine's matmul
peak: how near its floor each phase runs.

    python -m scripts.bench.flops --scale real --threads 1,2 --credits grpo,datc [hydra overrides]
    -> results/bench/flops.json, results/bench/flops.md

1. **The peak**: fp32 ``torch.mm`` on square matrices (256 to 2048; the best of each size's
   timed repeats is the machine's peak at that thread count), and at the shapes the rollout's
   decode multiplies (the step's responses times the policy's hidden and MLP widths, and its
   vocabulary for the LM head): what a decode step could reach if it were nothing but matmuls.
2. **The work**: one step with :class:`torch.utils.flop_counter.FlopCounterMode` around each
   phase of the spine (``datc.step``: the rollout ``s.stream.take``, the frozen passes and the
   reward, the credit, the update), counting the FLOPs of every matmul, attention and convolution
   torch runs (backward included; elementwise work is not counted, so achieved FLOP/s is a floor).
3. **The time**: steps without the counter, the thread counts alternating, each phase's time from
   the step's own ``perf/`` figures; the median over the steps.

Achieved FLOP/s = the phase's FLOPs / its median time, and its fraction of the peak at the same
thread count. The response length is forced to the budget (``min_new_tokens``, as ``make
bench-real`` does), so every step does the same work.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.utils.flop_counter import FlopCounterMode

from scripts.bench.render import write_result
from scripts.bench.scales import OUT, SCALES

PHASES = ("rollout", "reward", "credit", "update")  # as the step's perf/<phase>_s figures time them
SPINE = {"frozen_passes": "reward", "reward": "reward", "assign_credit": "credit", "update": "update"}  # datc.step's names


def mm_gflops(m: int, k: int, n: int, threads: int, min_s: float = 0.3, repeats: int = 5) -> float:
    """Best GFLOP/s of ``(m, k) @ (k, n)`` in fp32 over ``repeats`` timings of at least ``min_s`` each."""
    torch.set_num_threads(threads)
    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    torch.mm(a, b, out=out)
    best = 0.0
    for _ in range(repeats):
        reps, t0 = 0, time.perf_counter()
        while (dt := time.perf_counter() - t0) < min_s or reps == 0:
            torch.mm(a, b, out=out)
            reps += 1
        best = max(best, 2 * m * k * n * reps / dt / 1e9)
    return best


def peaks(threads: list[int], shapes: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
    """The square peak (best over sizes) and each named shape's GFLOP/s, per thread count."""
    out: dict[str, Any] = {}
    for t in threads:
        square = {n: mm_gflops(n, n, n, t) for n in (256, 512, 1024, 2048)}
        out[str(t)] = {"square_by_size": {str(n): round(g, 2) for n, g in square.items()},
                       "peak_gflops": round(max(square.values()), 2),
                       "shapes": {name: round(mm_gflops(*mkn, t), 2) for name, mkn in shapes.items()}}
    return out


class _NoModules:
    """A stand-in for FlopCounterMode's module tracker: every count goes to "Global"."""

    parents = frozenset({"Global"})

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def flop_counter() -> FlopCounterMode:
    """torch's FlopCounterMode without its per-module breakdown: the module tracker's backward
    hooks refuse ``autograd.grad`` to a leaf ("A leaf node was passed to
    _will_engine_execute_node"), which the reward model's input gradient on the shared trunk
    (``datc.forward.trunk``) is. Totals only (``get_total_flops``)."""
    fc = FlopCounterMode(display=False)
    fc.mod_tracker = _NoModules()
    return fc


def count_flops(s, it: int, forced: int) -> dict[str, int]:
    """One step of ``s`` with a FLOP counter around each phase; the FLOPs by phase."""
    import datc.step as spine
    from scripts.bench.datc_side import step

    counts = dict.fromkeys(PHASES, 0)

    def counted(phase: str, fn):
        def run(*a, **k):
            with flop_counter() as fc:
                out = fn(*a, **k)
            counts[phase] += fc.get_total_flops()
            return out
        return run

    with ExitStack() as stack:
        for name, phase in SPINE.items():
            stack.enter_context(mock.patch.object(spine, name, counted(phase, getattr(spine, name))))
        stack.enter_context(mock.patch.object(s.stream, "take", counted("rollout", s.stream.take)))
        step(s, it, forced)
    return counts


def timed(s, first_it: int, steps: int, threads: list[int], forced: int) -> dict[str, dict[str, list[float]]]:
    """``steps`` steps at each thread count, alternating; each phase's seconds per step."""
    from scripts.bench.datc_side import step

    times: dict[str, dict[str, list[float]]] = {str(t): {p: [] for p in (*PHASES, "step")} for t in threads}
    it = first_it
    for _ in range(steps):
        for t in threads:
            torch.set_num_threads(t)
            m = step(s, it, forced)
            it += 1
            for p in PHASES:
                times[str(t)][p].append(m[f"perf/{p}_s"])
            times[str(t)]["step"].append(m["perf/step_s"])
    return times


def table(res: dict[str, Any]) -> str:
    rows = ["| credit | threads | phase | GFLOP per step | median s | achieved GFLOP/s | of the square peak |",
            "|---|---|---|---|---|---|---|"]
    for credit, r in res["credits"].items():
        for t, by_phase in r["time_s"].items():
            peak = res["peaks"][t]["peak_gflops"]
            for p in (*PHASES, "step"):
                fl = sum(r["flops"].values()) if p == "step" else r["flops"][p]
                sec = statistics.median(by_phase[p])
                g = fl / sec / 1e9 if sec > 0 else 0.0
                rows.append(f"| {credit} | {t} | {p} | {fl / 1e9:.1f} | {sec:.2f} | {g:.1f} | {g / peak:.0%} |")
    return "\n".join(rows)


def markdown(res: dict[str, Any]) -> str:
    pk = ["| threads | square peak GFLOP/s (size: GFLOP/s) | " + " | ".join(res["shapes"]) + " |",
          "|---|---|" + "---|" * len(res["shapes"])]
    for t, p in res["peaks"].items():
        sizes = ", ".join(f"{n}: {g:.1f}" for n, g in p["square_by_size"].items())
        pk.append(f"| {t} | **{p['peak_gflops']:.1f}** ({sizes}) | " + " | ".join(f"{p['shapes'][k]:.1f}" for k in res["shapes"]) + " |")
    shapes = "; ".join(f"{k} = ({m}×{kk}) @ ({kk}×{n})" for k, (m, kk, n) in res["shapes"].items())
    la = res["load_average_1_5_15min"]
    return f"""# Achieved FLOP/s of each phase against the matmul peak ({res['scale']})

Written by `{res['command']}` (`scripts/bench/flops.py`) at commit `{res['commit']}` ({res['date']}), torch
{res['machine']['torch']}, {res['machine']['cpus']} CPUs ({res['machine']['cpu']}); load average (1, 5, 15 min)
{la['start']} at the start, {la['end']} at the end; {res['wall_s']:.0f} s.

Work: {res['work']}; each credit scheme in its own session. FLOPs counted by `torch.utils.flop_counter.FlopCounterMode` around each phase of
one step (matmuls, attention, convolutions, backward included; elementwise work is not counted, so
an achieved figure is a floor); times are the median of {res['steps']} steps per thread count, the
counts alternating, from each step's `perf/` figures (`reward` holds the reference and reward-model
passes).

## The matmul peak (fp32 `torch.mm`, GFLOP/s, best of 5 timings)

{chr(10).join(pk)}

Shapes: {shapes}.

## Each phase

{table(res)}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.flops", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=list(SCALES), default="real")
    ap.add_argument("--threads", type=lambda x: [int(t) for t in x.split(",")], default=[1, 2], help="comma-separated, e.g. 1,2")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per thread count")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--credits", type=lambda x: x.split(","), default=["grpo", "datc"], help="comma-separated credit configs, each its own session")
    ap.add_argument("overrides", nargs="*", help="hydra overrides (e.g. cache_dir=...)")
    a = ap.parse_args(argv)
    from datc.run.provenance import load_average, provenance
    from datc.utils import keep_freed_memory, quiet_libraries
    from scripts.bench.datc_side import datc_session, step

    keep_freed_memory()
    quiet_libraries()
    sc = SCALES[a.scale]
    t_start, load_start = time.time(), load_average()
    res: dict[str, Any] = {
        **provenance(" ".join(["python -m scripts.bench.flops", *(argv if argv is not None else sys.argv[1:])]), "transformers"),
        "scale": a.scale, "steps": a.steps, "credits": {}}
    for credit in a.credits:
        s = datc_session([*sc.overrides, f"credit={credit}", *a.overrides], sc.max_new_tokens)
        t = s.c.trainer
        forced = t.max_new_tokens if sc.force_length else 0
        if "peaks" not in res:  # once, at the first session's shapes
            cfg = s.m.policy.config
            hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
            inner = getattr(cfg, "intermediate_size", None) or 4 * hidden
            res["shapes"] = {"decode MLP": (t.batch_size, hidden, inner), "decode LM head": (t.batch_size, hidden, cfg.vocab_size)}
            res["peaks"] = peaks(a.threads, res["shapes"])
            res["work"] = (f"{t.batch_size // t.num_generations} prompts × {t.num_generations} responses of "
                           f"{t.max_new_tokens} tokens{' (forced)' if forced else ''}, policy {s.c.policy.name} "
                           f"({sum(p.numel() for p in s.m.policy.parameters()) / 1e6:.3g}M parameters), micro-batch "
                           f"{t.micro_batch_size}, dtype {s.c.policy.dtype}, the built-in sampler")
        torch.set_num_threads(max(a.threads))
        step(s, 0, forced)  # warm-up
        res["credits"][credit] = {"flops": count_flops(s, 1, forced), "time_s": timed(s, 2, a.steps, a.threads, forced)}
        del s
    res.update(wall_s=round(time.time() - t_start, 1), load_average_1_5_15min={"start": load_start, "end": load_average()})
    stem = "flops" if a.scale == "real" else f"flops_{a.scale}"
    print(write_result(Path(a.out), stem, res, markdown(res)).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
