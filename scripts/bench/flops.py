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
4. **Where the time goes** (``--ops``): steps under ``torch.profiler`` with each phase a labelled
   range; per phase, the number of torch operators the step dispatched and their own CPU time
   (matmuls, attention, the rest), and what is left of the phase's median time outside them (the
   Python around the operators: this project's step, transformers' modules, autograd's
   bookkeeping). At the testbed's size that share, not the arithmetic, is what bounds the step.

Achieved FLOP/s = the phase's FLOPs / its median time, and its fraction of the peak at the same
thread count. The response length is forced to the budget (``min_new_tokens``, as ``make
bench-real`` does), so every step does the same work.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import ExitStack, contextmanager
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


@contextmanager
def around_phases(s, wrap):
    """Every phase of the spine (``datc.step``'s phase functions and the session's rollout
    ``s.stream.take``) replaced by ``wrap(phase, fn)`` while the block runs."""
    import datc.step as spine

    with ExitStack() as stack:
        for name, phase in SPINE.items():
            stack.enter_context(mock.patch.object(spine, name, wrap(phase, getattr(spine, name))))
        stack.enter_context(mock.patch.object(s.stream, "take", wrap("rollout", s.stream.take)))
        yield


def count_flops(s, it: int, forced: int) -> dict[str, int]:
    """One step of ``s`` with a FLOP counter around each phase; the FLOPs by phase."""
    from scripts.bench.datc_side import step

    counts = dict.fromkeys(PHASES, 0)

    def counted(phase: str, fn):
        def run(*a, **k):
            with flop_counter() as fc:
                out = fn(*a, **k)
            counts[phase] += fc.get_total_flops()
            return out
        return run

    with around_phases(s, counted):
        step(s, it, forced)
    return counts


MATMULS = frozenset({"aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul", "aten::linear"})


def op_category(name: str) -> str:
    """``matmul``, ``attention`` or ``other`` for a torch operator's profiler name."""
    if name in MATMULS:
        return "matmul"
    return "attention" if "scaled_dot_product" in name or "flash_attention" in name else "other"


def op_times(events, phases: tuple[str, ...] = PHASES) -> dict[str, dict[str, float]]:
    """By phase, from profiler events (``prof.events()``: ``name``, ``cpu_parent``,
    ``self_cpu_time_total``, ``cpu_time_total`` in µs) under ranges named ``phase:<phase>``:
    ``profiled``, the ranges' time in ms; ``ops``, the torch operators dispatched from outside any
    other operator (what the Python above them called); and the operators' own CPU time in ms by
    :func:`op_category` (every ``aten::`` event's self time, nested ones included, so the
    categories add up to all operator time)."""
    out = {p: {"ops": 0, "matmul": 0.0, "attention": 0.0, "other": 0.0, "profiled": 0.0} for p in phases}
    for e in events:
        if e.name.startswith("phase:") and (p := e.name.removeprefix("phase:")) in out:
            out[p]["profiled"] += e.cpu_time_total / 1e3
        if not e.name.startswith("aten::"):
            continue
        top, parent = True, e.cpu_parent
        while parent is not None and not parent.name.startswith("phase:"):
            top = top and not parent.name.startswith("aten::")
            parent = parent.cpu_parent
        phase = parent.name.removeprefix("phase:") if parent is not None else None
        if phase not in out:
            continue
        out[phase]["ops"] += top
        out[phase][op_category(e.name)] += e.self_cpu_time_total / 1e3
    return out


def profile_ops(s, first_it: int, steps: int, forced: int) -> dict[str, dict[str, float]]:
    """``steps`` steps under ``torch.profiler`` (CPU), each phase a range named ``phase:<phase>``;
    :func:`op_times` per step (operator counts and times divided by ``steps``)."""
    from scripts.bench.datc_side import step

    def labelled(phase: str, fn):
        def run(*a, **k):
            with torch.profiler.record_function(f"phase:{phase}"):
                return fn(*a, **k)
        return run

    with around_phases(s, labelled), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            step(s, first_it + i, forced)
    return {p: {k: v / steps for k, v in d.items()} for p, d in op_times(prof.events()).items()}


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


def ops_table(res: dict[str, Any]) -> str:
    """Per credit and phase: the median time at the profiled thread count, the operators
    dispatched, their own time by category, and the time outside them (ms per step)."""
    rows = ["| credit | phase | median ms | profiled ms | operators | matmul ms | attention ms | other operators ms | outside operators ms (share) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for credit, r in res["credits"].items():
        if "ops" not in r:
            continue
        by_phase = r["time_s"][str(r["ops_threads"])]
        tot = {k: sum(d[k] for d in r["ops"].values()) for k in ("ops", "matmul", "attention", "other", "profiled")}
        for p in (*PHASES, "step"):
            d = tot if p == "step" else r["ops"][p]
            ms = (sum(statistics.median(by_phase[q]) for q in PHASES) if p == "step" else statistics.median(by_phase[p])) * 1e3
            outside = d["profiled"] - d["matmul"] - d["attention"] - d["other"]
            share = f"{outside / d['profiled']:.0%}" if d["profiled"] > 0 else "-"
            rows.append(f"| {credit} | {'the four phases' if p == 'step' else p} | {ms:.1f} | {d['profiled']:.1f} | {d['ops']:.0f} | {d['matmul']:.1f} | "
                        f"{d['attention']:.1f} | {d['other']:.1f} | {outside:.1f} ({share}) |")
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
{ops_section(res)}"""


def ops_section(res: dict[str, Any]) -> str:
    first = next((r for r in res["credits"].values() if "ops" in r), None)
    if first is None:
        return ""
    return f"""
## Where the time goes: operators and what is around them (`--ops`, {first['ops_threads']} thread(s))

Per step, from {res['ops_steps']} steps under `torch.profiler`: the phase's time there (profiled; the median
without the profiler beside it), the torch operators it dispatched (from the Python above them;
the ones they call inside not counted again), their own CPU time by kind, and what is left
outside them: the Python that calls them (this project's step, transformers' modules, autograd's
bookkeeping), plus the profiler's own cost per recorded event (the difference between the two
time columns bounds it).

{ops_table(res)}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.flops", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=list(SCALES), default="real")
    ap.add_argument("--threads", type=lambda x: [int(t) for t in x.split(",")], default=[1, 2], help="comma-separated, e.g. 1,2")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per thread count")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--credits", type=lambda x: x.split(","), default=["grpo", "datc"], help="comma-separated credit configs, each its own session")
    ap.add_argument("--ops", type=int, default=0, metavar="STEPS",
                    help="also profile this many steps per credit (at the first thread count): operators and the time around them")
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
        "scale": a.scale, "steps": a.steps, "ops_steps": a.ops, "credits": {}}
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
        res["credits"][credit] = r = {"flops": count_flops(s, 1, forced), "time_s": timed(s, 2, a.steps, a.threads, forced)}
        if a.ops:
            torch.set_num_threads(a.threads[0])
            r.update(ops=profile_ops(s, 2 + a.steps * len(a.threads), a.ops, forced), ops_threads=a.threads[0])
        del s
    res.update(wall_s=round(time.time() - t_start, 1), load_average_1_5_15min={"start": load_start, "end": load_average()})
    stem = "flops" if a.scale == "real" else f"flops_{a.scale}"
    print(write_result(Path(a.out), stem, res, markdown(res)).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
