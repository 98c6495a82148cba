"""The command (``python -m scripts.bench``): options, the run of each part, the results files."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import scripts.bench
from datc.run.provenance import load_average, provenance
from scripts.bench.datc_side import datc_session
from scripts.bench.measure import measure, memory_child, peak_memory, profile_datc, scaling
from scripts.bench.render import write_markdown
from scripts.bench.same_loss import same_loss_check
from scripts.bench.scales import CONTESTANTS, GRPO_TARGET, OUT, SCALES


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench", description=scripts.bench.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=list(SCALES), default="testbed",
                    help="testbed (tiny GPT-2) or real (experiment=real_smollm2); sets the defaults marked below")
    ap.add_argument("--steps", type=int, help="measured steps per block (testbed 10, real 2)")
    ap.add_argument("--warmup", type=int, help="unmeasured steps at the start of each block (testbed 2, real 1)")
    ap.add_argument("--repeats", type=int, help="interleaved blocks per trainer (testbed 5, real 3)")
    ap.add_argument("--until", type=float, default=None,
                    help="add repeats until both headline ratios' 95%% intervals are within +- this of their medians (relative, e.g. 0.05)")
    ap.add_argument("--max-repeats", type=int, default=60, help="with --until: at most this many repeats")
    ap.add_argument("--max-minutes", type=float, default=15.0, help="with --until: stop adding repeats after about this long")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the testbed machine is shared)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4, help="relative tolerance of the same-loss check")
    ap.add_argument("--max-new-tokens", type=int, help="response budget on both sides (testbed: the config's 16, real 48)")
    ap.add_argument("--natural-length", action="store_true",
                    help="responses end at their EOS (real: forced to the budget with min_new_tokens by default)")
    ap.add_argument("--lengths", type=int, nargs="*", help="scaling: response budgets (testbed 8 16 32)")
    ap.add_argument("--groups", type=int, nargs="*", help="scaling: group sizes (testbed 4 8 16)")
    ap.add_argument("--scaling-steps", type=int, default=4)
    ap.add_argument("--memory-steps", type=int, help="steps of each memory run (testbed 4, real 1)")
    ap.add_argument("--profile-steps", type=int, help="steps of each profile (testbed 5, real 1)")
    ap.add_argument("--scaling", action=argparse.BooleanOptionalAction,
                    help="the length and group sweeps (testbed on, real off: hours at that scale)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=str(OUT), help="directory for the results (testbed: trl.json, trl.md, trl_profile.txt; "
                    "real: trl_real.*)")
    ap.add_argument("--combine", action="store_true",
                    help="measure nothing: re-render both scales' markdown from their JSON files in --out")
    ap.add_argument("--memory-child", choices=CONTESTANTS, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="hydra overrides, e.g. policy=tiny_llama")
    a = ap.parse_args()
    sc = SCALES[a.scale]
    for k, v in sc.defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    overrides = [*sc.overrides, *a.overrides]
    T = a.max_new_tokens or sc.max_new_tokens
    force = sc.force_length and not a.natural_length
    work = {"max_new_tokens": T, "force_length": force}
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    torch.set_num_threads(a.threads)
    from datc.atomic import atomic_write_json, atomic_write_text
    from datc.utils import keep_freed_memory, quiet_libraries

    kept = keep_freed_memory()  # as datc-train does (trainer.keep_freed_memory); process-wide: TRL's blocks get it too
    quiet_libraries()
    out = Path(a.out)
    if a.combine:
        for path in write_markdown(out):
            print(f"wrote {path}")
        return
    if a.memory_child:
        print(json.dumps(memory_child(a.memory_child, overrides, a.memory_steps, **work)))
        return
    import transformers  # noqa: F401 (imported before the clock starts: wall_s leaves their import out)
    import trl  # noqa: F401

    t_start = time.time()
    load_start = load_average()
    sl = same_loss_check(overrides, a.tol, sc.perturb, **work)
    print("same loss:", json.dumps(sl), file=sys.stderr)
    if not sl["ok"]:
        raise SystemExit(f"scripts.bench: the two trainers do not compute the same loss on the same batch: {sl}")
    th = measure(overrides, a.steps, a.warmup, a.repeats, a.seed, **work, until=a.until, max_repeats=a.max_repeats,
                 max_s=60 * a.max_minutes)
    th.update(steps=a.steps, warmup=a.warmup, repeats=th["repeats_run"])
    s = datc_session(overrides, T)
    t = s.c.trainer
    micro = (f" in micro-batches of {t.micro_batch_size} (TRL per_device_train_batch_size {t.micro_batch_size}, "
             f"gradient_accumulation_steps {t.batch_size // t.micro_batch_size})" if t.micro_batch_size < t.batch_size else "")
    tokens = (f"{t.max_new_tokens} tokens each (forced with min_new_tokens on both sides)" if force
              else f"up to {t.max_new_tokens} tokens")
    res: dict[str, Any] = {
        **provenance(" ".join(["python -m scripts.bench", *sys.argv[1:]]), "transformers", "trl"), "threads": a.threads,
        "work": (f"{t.batch_size // t.num_generations} prompts x {t.num_generations} responses, {tokens}, "
                 f"temperature {t.temperature}, top-p {t.top_p}, beta {t.beta}, clip {t.epsilon_low}/{t.epsilon_high}, "
                 f"{t.loss_agg} (TRL dapo), AdamW lr {t.lr}, one optimizer step per rollout{micro}; policy {s.c.policy.name}, "
                 f"data {s.c.data.name}"),
        "work_batch": t.batch_size, "scale": a.scale, "max_new_tokens": t.max_new_tokens, "force_length": force,
        "policy_params": sum(p.numel() for p in s.m.policy.parameters()),
        "targets": {"grpo_over_trl_samples_per_s": GRPO_TARGET, "datc_over_grpo_step_s": sc.datc_target},
        "keep_freed_memory": kept, "same_loss": sl, "throughput": th, "notes": list(sc.notes),
    }
    del s
    if not a.no_memory:
        child = ("--scale", a.scale, *(("--max-new-tokens", str(T)) if T else ()), *(("--natural-length",) if a.natural_length else ()))
        res["memory"] = peak_memory(a.overrides, a.memory_steps, a.threads, child)
    if a.scaling:
        res["scaling"] = scaling(overrides, a.lengths, a.groups, a.scaling_steps, a.warmup, a.seed, **work)
    out.mkdir(parents=True, exist_ok=True)
    if not a.no_profile:
        prof = profile_datc(overrides, a.profile_steps, warm=a.warmup, **work)
        res["profile_file"] = f"{sc.stem}_profile.txt"
        atomic_write_text(out / res["profile_file"], f"# Profile of datc credit={prof['credit']}, {prof['steps']} steps "
                          f"(`{res['command']}`)\n\n## cProfile, cumulative\n\n{prof['cprofile_cumulative']}\n\n"
                          f"## torch ops, self CPU time\n\n{prof['torch_ops']}\n")
    res["wall_s"] = round(time.time() - t_start, 1)
    res["load_average_1_5_15min"] = {"start": load_start, "end": load_average()}
    atomic_write_json(out / f"{sc.stem}.json", res)
    write_markdown(out)  # this scale's markdown, and the other's where it has results (the side-by-side section)
    print((out / f"{sc.stem}.md").read_text())
