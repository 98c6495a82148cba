"""``credit=datc`` step time over ``credit=grpo`` for any preset, paired: both sessions start
every step from the same weights and random stream (so they sample the same responses), steps
interleaved (grpo, datc, datc, grpo, ...); the measurement is ``datc.analysis.credit_cost.paired_steps``
(``python -m scripts.bench.credit``'s testbed figure), here with the preset's overrides and a JSON +
Markdown report in ``--out``. Also the phase breakdown (rollout / reward (+ RM gradient) /
credit / update) and this process's peak RSS.

    python -m scripts.results.paired_cost [--steps 6] [--out results/real_model] [hydra overrides ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m scripts.results.paired_cost", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "real_model")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(args)
    from datc.analysis.credit_cost import paired_steps
    from datc.atomic import atomic_write_json, atomic_write_text
    from datc.run.provenance import load_average, provenance
    from datc.utils import peak_rss_mb, quiet_libraries

    quiet_libraries()
    load_before = load_average()
    tb = paired_steps(a.steps, a.overrides)
    c = tb.pop("sessions")["datc"].c
    med = tb["median_seconds"]
    result = {**provenance("python -m scripts.results.paired_cost " + " ".join(args)), "setting": f"{c.data.name}-{c.policy.name}",
              "batch": f"{c.trainer.batch_size} responses x {c.trainer.max_new_tokens} tokens",
              "threads": torch.get_num_threads(), "load_average_before_after": [load_before, load_average()],
              "peak_rss_mb": peak_rss_mb(), **tb}
    before, after = result["load_average_before_after"]
    atomic_write_json(a.out / f"cost-{result['setting']}.json", result)
    lines = [f"# DATC cost on {result['setting']} ({result['batch']})", "",
             f"Command: `{result['command']}`; {a.steps} paired steps after 2 warm-up pairs, torch {result['machine']['torch']}, "
             f"{result['threads']} threads, load average {before[0]:.1f} before / {after[0]:.1f} after "
             "(a shared 2-core machine: absolute times are inflated, the paired ratio less so).", "",
             "| phase | grpo (s) | datc (s) |", "|---|---|---|",
             *[f"| {k.split('/')[1][:-2]} | {med['grpo'][k]:.2f} | {med['datc'][k]:.2f} |" for k in med["grpo"]], "",
             f"**datc / grpo step time: {tb['datc_over_grpo_step']:.3f}** (quartiles of the paired ratios: "
             + ", ".join(f"{q:.3f}" for q in tb["paired_ratio_quartiles"]) + f"); the reward model's gradient adds "
             f"{tb['rm_gradient_extra_s']:.2f} s to the reward phase. Peak RSS of the process (both sessions: two "
             f"policies, two references, two reward models): {result['peak_rss_mb']:.0f} MB."]
    atomic_write_text(a.out / f"cost-{result['setting']}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
