"""What ``trainer.deterministic`` costs on this machine: training steps of two sessions, one with
the mode off and one with it on, interleaved in one process (so both see the same machine load),
written to results/bench/deterministic_cpu.{json,md}. On a GPU the check measures it
(``python -m scripts.gpu_check``'s ``determinism/<family>`` case).

    python -m scripts.bench.deterministic [--steps 20] [hydra overrides ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("step_s", "rollout_s", "update_s")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.deterministic", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench" / "deterministic_cpu"), help="path without suffix")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from datc.analysis.inputs import session_for
    from datc.atomic import atomic_write_json, atomic_write_text
    from datc.run.provenance import provenance
    from datc.step import train_step
    from datc.utils import deterministic_mode, quiet_libraries

    quiet_libraries()
    sessions = {mode: session_for([*a.overrides, f"trainer.deterministic={str(mode == 'on').lower()}"]) for mode in ("off", "on")}
    times: dict[str, dict[str, list[float]]] = {m: {p: [] for p in PHASES} for m in sessions}
    for it in range(a.steps + 1):
        for mode in ("off", "on") if it % 2 == 0 else ("on", "off"):
            with deterministic_mode(mode == "on"):
                m = train_step(sessions[mode], it).metrics
            if it > 0:  # the first round warms up
                for p in PHASES:
                    times[mode][p].append(m[f"perf/{p}"])
    med = {mode: {p: statistics.median(v) for p, v in ph.items()} for mode, ph in times.items()}
    ratio = {p: med["on"][p] / med["off"][p] for p in PHASES}
    cmd = "python -m scripts.bench.deterministic " + " ".join(sys.argv[1:])
    info = provenance(cmd)
    out = Path(a.out)
    atomic_write_json(out.with_suffix(".json"), {**info, "steps": a.steps, "torch_threads": torch.get_num_threads(),
                                                 "median_s": med, "on_over_off": ratio, "all": times})
    lines = ["# trainer.deterministic: its cost on CPU", "",
             f"Command: `{cmd}` (commit {info['commit']}, {info['machine']['cpus']} CPUs; load average at the end "
             f"{info['load_average'][0]}). Medians over {a.steps} steps of each session, interleaved.", "",
             "| phase | off s | on s | on / off |", "|---|---|---|---|",
             *[f"| {p} | {med['off'][p]:.4f} | {med['on'][p]:.4f} | {ratio[p]:.3f} |" for p in PHASES]]
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
