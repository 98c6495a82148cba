"""2 to 5: throughput in interleaved blocks, peak memory of each side alone, scaling with the
response length and the group size, and the profile of this project's step."""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import math
import pstats
import re
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from datc.utils import peak_rss_mb
from scripts.bench.datc_side import datc_session, step
from scripts.bench.scales import CONTESTANTS, ROOT
from scripts.bench.stats import block_summary, rotated_order, spread
from scripts.bench.trl_side import build_trl, run_trl_block


def run_datc_block(overrides: list[str], steps: int, warmup: int, seed: int, max_new_tokens: int | None = None,
                   force_length: bool = False) -> list[dict[str, float]]:
    s = datc_session(overrides, max_new_tokens)  # another budget without re-preparing the cache (keyed by it)
    torch.manual_seed(seed)
    rows = []
    forced = s.c.trainer.max_new_tokens if force_length else 0
    for it in range(warmup + steps):
        t0 = time.perf_counter()
        m = step(s, it, forced)
        dt = time.perf_counter() - t0
        if it >= warmup:
            rows.append({"step_s": dt, "tokens": m["perf/tokens_per_s"] * m["perf/step_s"],
                         "rollout_s": m["perf/rollout_s"], "reward_s": m["perf/reward_s"],
                         # perf/reward_s holds both frozen models' passes (reference and reward
                         # model) whatever the plan; perf/credit_s the credit alone
                         "prep_s": m["perf/credit_s"], "update_s": m["perf/update_s"]})
    return rows


# ---- 2. throughput -----------------------------------------------------------------------------


LOAD_MOVE = 1.0  # a repeat whose 1-minute load average moved more than this is flagged


def measure(overrides: list[str], steps: int, warmup: int, repeats: int, seed: int, max_new_tokens: int | None = None,
            force_length: bool = False, until: float | None = None, max_repeats: int = 60,
            max_s: float = 900.0) -> dict[str, Any]:
    """Interleaved blocks of every contestant, ``repeats`` of them, or with ``until`` as many more
    as it takes for the 95% intervals of the two headline medians (credit=grpo / TRL samples per
    second, credit=datc / credit=grpo step time) to be within ±``until`` of them (relative), at most ``max_repeats`` and about ``max_s`` seconds. The 1-minute load
    average is kept per repeat; a repeat during which it moved more than :data:`LOAD_MOVE` is
    flagged, and the ratios are given over every repeat and over the unflagged ones."""
    from datc.run.provenance import load_average

    s = datc_session(overrides, max_new_tokens)
    B = s.c.trainer.batch_size
    work = {"max_new_tokens": max_new_tokens, "force_length": force_length}
    blocks: dict[str, list[dict]] = {k: [] for k in CONTESTANTS}
    loads: list[dict[str, float]] = []
    t0, r = time.time(), 0

    def ratios(keep: list[int]) -> dict[str, Any]:
        def pick(who: str) -> list[dict]:
            return [blocks[who][i] for i in keep]
        g, t, d = pick("grpo"), pick("trl"), pick("datc")
        return {"grpo_over_trl_samples_per_s": spread([a["samples_per_s"] / b["samples_per_s"] for a, b in zip(g, t, strict=True)]),
                "datc_over_trl_samples_per_s": spread([a["samples_per_s"] / b["samples_per_s"] for a, b in zip(d, t, strict=True)]),
                "datc_over_grpo_step_s": spread([a["step_s"] / b["step_s"] for a, b in zip(d, g, strict=True)])}

    def more() -> bool:
        if r < repeats:
            return True
        if until is None or r >= max_repeats or time.time() - t0 > max_s:
            return False
        now = ratios(list(range(r)))
        rels = [now[k]["ci_rel"] for k in ("grpo_over_trl_samples_per_s", "datc_over_grpo_step_s")]
        return any(x is None or x > until for x in rels)

    while more():
        start = load_average()[0]
        for who in rotated_order(CONTESTANTS, r):
            if who == "trl":
                rows = run_trl_block(s, steps, warmup, seed + r, **work)
            else:
                rows = run_datc_block([*overrides, f"credit={who}"], steps, warmup, seed + r, **work)
            blocks[who].append(block_summary(rows, B))
            print(f"repeat {r} {who}: {blocks[who][-1]['samples_per_s']:.1f} samples/s, "
                  f"step {blocks[who][-1]['step_s'] * 1000:.1f} ms", file=sys.stderr)
        end = load_average()[0]
        loads.append({"start": start, "end": end, "flagged": abs(end - start) > LOAD_MOVE})
        r += 1
    keys = list(blocks["trl"][0])
    summary = {who: {k: statistics.median(b[k] for b in bs) for k in keys} for who, bs in blocks.items()}
    steady = [i for i, x in enumerate(loads) if not x["flagged"]]
    return {"batch_size": B, "blocks": blocks, "median_over_repeats": summary, **ratios(list(range(r))),
            "repeats_run": r, "load_per_repeat": loads, "until": until, "measure_s": round(time.time() - t0, 1),
            "steady": {"repeats": len(steady), **(ratios(steady) if len(steady) >= 1 else {})}}


# ---- 3. peak memory, each side alone in a fresh process ---------------------------------------


def memory_child(who: str, overrides: list[str], steps: int, max_new_tokens: int | None = None,
                 force_length: bool = False) -> dict[str, float]:
    """Run ``steps`` steps of one side; peak resident memory of the whole process (models,
    libraries and all) and its growth over the set-up (the training steps' working memory)."""
    if who == "trl":
        s = datc_session(overrides, max_new_tokens)
        trainer, _ = build_trl(s, steps, s.c.seed, max_new_tokens, force_length)
        del s
        base = peak_rss_mb()
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
    else:
        s = datc_session([*overrides, f"credit={who}"], max_new_tokens)
        base = peak_rss_mb()
        for it in range(steps):
            step(s, it, s.c.trainer.max_new_tokens if force_length else 0)
    peak = peak_rss_mb()
    return {"peak_rss_mb": peak, "setup_rss_mb": base, "step_growth_mb": peak - base}


def peak_memory(overrides: list[str], steps: int, threads: int, child_args: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """Each side alone in a fresh process; ``child_args``: the scale's options (budget, lengths)."""
    out = {}
    for who in CONTESTANTS:
        cmd = [sys.executable, "-m", "scripts.bench", "--memory-child", who, "--memory-steps", str(steps),
               "--threads", str(threads), *child_args, *overrides]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if res.returncode != 0:
            raise RuntimeError(f"memory run of {who} failed:\n{res.stderr[-3000:]}")
        out[who] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


# ---- 4. scaling -------------------------------------------------------------------------------


def scaling(overrides: list[str], lengths: list[int], groups: list[int], steps: int, warmup: int, seed: int,
            max_new_tokens: int | None = None, force_length: bool = False) -> dict:
    """Median step time (s) of this project (credit=grpo) and TRL, one block each per point,
    interleaved. Lengths: responses forced to the budget. Groups: 8 prompts per step, the
    scale's budget and lengths (micro-batches: the whole batch where the scale has no smaller
    ones)."""
    base = datc_session(overrides)
    t = base.c.trainer
    out: dict[str, list[dict]] = {"length": [], "group": []}
    for i, T in enumerate(lengths):
        row = {"max_new_tokens": T}
        for who in (("grpo", "trl") if i % 2 == 0 else ("trl", "grpo")):
            if who == "trl":
                rows = run_trl_block(base, steps, warmup, seed, max_new_tokens=T, force_length=True)
            else:
                rows = run_datc_block([*overrides, "credit=grpo"], steps, warmup, seed, max_new_tokens=T, force_length=True)
            row[who] = block_summary(rows, t.batch_size)
        out["length"].append(row)
    work = {"max_new_tokens": max_new_tokens, "force_length": force_length}
    for i, G in enumerate(groups):
        micro = 8 * G if t.micro_batch_size == t.batch_size else math.gcd(t.micro_batch_size, 8 * G)
        ov = [*overrides, f"trainer.num_generations={G}", f"trainer.batch_size={8 * G}",
              f"trainer.mini_batch_size={8 * G}", f"trainer.micro_batch_size={micro}"]
        s = datc_session(ov)
        row = {"num_generations": G, "batch_size": 8 * G}
        for who in (("grpo", "trl") if i % 2 == 0 else ("trl", "grpo")):
            rows = (run_trl_block(s, steps, warmup, seed, **work) if who == "trl"
                    else run_datc_block([*ov, "credit=grpo"], steps, warmup, seed, **work))
            row[who] = block_summary(rows, 8 * G)
        out["group"].append(row)
    return out


# ---- 5. profile of this project's step --------------------------------------------------------


def profile_datc(overrides: list[str], steps: int, credit: str = "grpo", warm: int = 2, max_new_tokens: int | None = None,
                 force_length: bool = False) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    s = datc_session([*overrides, f"credit={credit}"], max_new_tokens)
    forced = s.c.trainer.max_new_tokens if force_length else 0
    for it in range(warm):
        step(s, it, forced)
    pr = cProfile.Profile()
    pr.enable()
    for it in range(warm, warm + steps):
        step(s, it, forced)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(30)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for it in range(warm + steps, warm + 2 * steps):
            step(s, it, forced)
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    return {"steps": steps, "credit": credit, "cprofile_cumulative": _strip_paths(buf.getvalue()), "torch_ops": ops}


def _strip_paths(text: str) -> str:
    """Profile lines name files relative to their package, not where they are installed."""
    text = text.replace(str(ROOT) + "/", "")
    text = re.sub(r"\S*/site-packages/", "", text)
    return re.sub(r"\S*/lib/python3\.\d+/", "", text)
