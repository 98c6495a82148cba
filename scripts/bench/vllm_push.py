"""Which part of a vLLM rollout makes the process grow: sampling alone, the weight push alone, or
the push followed by sampling (what every step does), each repeated, the resident set read after
each call. Written to results/bench/vllm_push_<name>.{json,md}. Run it in ``.venv-vllm``:

    nice -n 10 .venv-vllm/bin/python -m scripts.bench.vllm_push --name real --calls 10 \\
        experiment=real_smollm2 rollout=vllm trainer.threads=1

The session is the run's (``datc.analysis.inputs.session_for``); no update runs, so every push
carries the same weights. ``--phases push_then_sample`` runs the last phase alone. ``--account``
also reads, after each call, the bytes of every tensor storage the garbage collector can reach and
the count of Python objects it tracks (what grows is then tensors, Python objects, or neither: memory
held below Python, by a library's own caches or the allocator); ``--trim`` returns the heap's free
pages to the OS (glibc's ``malloc_trim``) before each reading, so what is left is memory in use.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("sample", "push", "push_then_sample")


def growth(rows: list[dict[str, Any]], phase: str, skip: int = 2) -> dict[str, float]:
    """The phase's resident-set growth: MB from its first call's end to its last's, and the
    least-squares slope over its calls after the first ``skip`` (warm-up), MB a call."""
    from scripts.bench.memory_trace import slope

    ph = [r for r in rows if r["phase"] == phase]
    late = ph[skip:]
    return {"calls": len(ph), "first_to_last_mb": ph[-1]["rss_mb"] - ph[0]["rss_mb"] if ph else float("nan"),
            "slope_mb_per_call": slope([float(r["call"]) for r in late], [r["rss_mb"] for r in late]),
            "median_call_s": sorted(r["call_s"] for r in ph)[len(ph) // 2] if ph else float("nan")}


def reachable() -> tuple[float, int]:
    """(MB of the distinct tensor storages reachable from the objects the garbage collector
    tracks, the count of those objects). Storages are told apart by their data pointer. Objects a
    library froze out of the collector's sight (vLLM calls ``gc.freeze()`` once its engine is up)
    are counted too: unfrozen for the reading, frozen again after it."""
    import torch

    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
    objs = gc.get_objects()
    if frozen:
        gc.freeze()
    seen: dict[int, int] = {}
    for o in objs:
        try:
            if isinstance(o, torch.Tensor) and not o.is_meta and o.device.type == "cpu":
                st = o.untyped_storage()
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        except (RuntimeError, NotImplementedError, ReferenceError):  # a fake or functional tensor without storage
            continue
    return sum(seen.values()) / 2**20, len(objs)


def markdown(res: dict[str, Any]) -> str:
    la = res["load_average"]
    lines = [f"# A vLLM rollout's resident set, by part: {res['name']}", "",
             f"Written by `{res['command']}` (`scripts/bench/vllm_push.py`) at commit `{res['commit']}` ({res['date']}), "
             f"torch {res['machine']['torch']}, {res['machine']['cpus']} CPUs; load average (1, 5, 15 min) {la} at the start.", "",
             f"The session's resident set {res['start_mb']:.0f} MB before the first call; each phase's calls in a row, "
             "the resident set read after each (after `gc.collect()`). Slopes leave out each phase's first two calls.", "",
             "| phase | calls | growth, first call to last (MB) | slope after warm-up (MB a call) | median call (s) |",
             "|---|---|---|---|---|"]
    for p, g in res["growth"].items():
        lines.append(f"| {p} | {g['calls']} | {g['first_to_last_mb']:+.1f} | {g['slope_mb_per_call']:+.1f} | {g['median_call_s']:.1f} |")
    acc = "tensor_mb" in (res["rows"] or [{}])[0]
    if res.get("trim"):
        lines += ["", "Each reading after `malloc_trim(0)` (the heap's free pages returned to the OS)."]
    if acc:
        lines += ["", "Tensors: the distinct storages reachable from the objects the garbage collector tracks; "
                  "objects: their count."]
        for p in res["growth"]:
            ph = [r for r in res["rows"] if r["phase"] == p]
            lines.append(f"- {p}: tensors {ph[0]['tensor_mb']:.1f} -> {ph[-1]['tensor_mb']:.1f} MB, objects "
                         f"{ph[0]['objects']} -> {ph[-1]['objects']} (first call to last)")
    head = "| phase | call | RSS (MB) | high-water mark (MB) | call (s) |" + (" tensors (MB) | objects |" if acc else "")
    lines += ["", head, "|---|---|---|---|---|" + ("---|---|" if acc else "")]
    lines += [f"| {r['phase']} | {r['call']} | {r['rss_mb']:.1f} | {r['hwm_mb']:.1f} | {r['call_s']:.1f} |"
              + (f" {r['tensor_mb']:.1f} | {r['objects']} |" if acc else "") for r in res["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.vllm_push", description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True, help="the result's name: results/bench/vllm_push_<name>.md")
    ap.add_argument("--calls", type=int, default=10, help="calls per phase")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    ap.add_argument("--account", action="store_true", help="also read the reachable tensors' MB and the Python objects")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) before each reading")
    ap.add_argument("--out", default=str(ROOT / "results/bench"))
    ap.add_argument("overrides", nargs="*", help="hydra overrides of the session (rollout=vllm or another engine)")
    a = ap.parse_args(argv)
    if a.calls < 3:
        ap.error("--calls: at least 3 (the slope leaves out two warm-up calls)")
    a.phases = [p for p in a.phases.split(",") if p]
    if not a.phases or (bad := [p for p in a.phases if p not in PHASES]):
        ap.error(f"--phases: {', '.join(bad) if a.phases else 'none given'}: choose from {', '.join(PHASES)}")
    import torch

    from datc.analysis.inputs import session_for
    from datc.run.provenance import provenance
    from datc.step.sample import sampling_args
    from datc.step.stream import batch_for
    from datc.utils import quiet_libraries, resident_mb, trim_heap
    from scripts.bench.render import write_result

    quiet_libraries()
    res: dict[str, Any] = {**provenance(" ".join(["python -m scripts.bench.vllm_push", *(argv if argv is not None else sys.argv[1:])])),
                           "name": a.name, "calls": a.calls, "trim": a.trim}
    s = session_for(list(a.overrides))
    torch.set_num_threads(s.c.trainer.threads)
    args = sampling_args(s, s.plan)
    rows: list[dict[str, Any]] = []
    step = 0

    def sample() -> None:
        nonlocal step
        b = batch_for(s, step)  # a new step's prompts and seeds each call
        step += 1
        with torch.no_grad():
            s.engine.sample(s.m.policy, s.m.tok, b.examples, args, encoder=s.m.encoder, seeds=b.seeds)

    def push() -> None:
        s.engine.sync(s.m.policy)

    calls = {"sample": [sample], "push": [push], "push_then_sample": [push, sample]}
    gc.collect()
    res["start_mb"] = resident_mb()[0]
    for phase in a.phases:
        for i in range(a.calls):
            t0 = time.perf_counter()
            for f in calls[phase]:
                f()
            dt = time.perf_counter() - t0
            gc.collect()
            if a.trim:
                trim_heap()
            now, peak = resident_mb()
            rows.append({"phase": phase, "call": i + 1, "rss_mb": round(now, 1), "hwm_mb": round(peak, 1), "call_s": round(dt, 2)})
            if a.account:
                mb, n = reachable()
                rows[-1].update(tensor_mb=round(mb, 1), objects=n)
            print(rows[-1], flush=True)
    s.engine.close()
    res["rows"] = rows
    res["growth"] = {p: growth(rows, p) for p in a.phases}
    print(write_result(Path(a.out), f"vllm_push_{a.name}", res, markdown(res)).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
