"""Markdown tables of finished runs for results/lora/: held-out gold at the first and last
evaluation, per-step time and peak memory from each run's ``metrics.jsonl``.

    python -m scripts.results.lora_table testbed runs/lora_testbed/full runs/lora_testbed/lora
    python -m scripts.results.lora_table real runs/lora_real/full runs/lora_real/lora
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _runs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob("summary.json"))


def _label(run: Path) -> str:
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run / "config.yaml")
    r = OmegaConf.select(cfg, "policy.lora.r", default=0)
    scale = OmegaConf.select(cfg, "policy.lora.lr_scale", default=1.0) if r else 1.0  # runs before the option: 1
    return f"{f'LoRA r={r}' if r else 'full'}, lr {cfg.trainer.lr * scale:g}"


def testbed(roots: list[Path]) -> str:
    """One line per (policy kind, credit): mean ± sd over seeds of the first and last gold."""
    groups: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for root in roots:
        for run in _runs(root):
            s = json.loads((run / "summary.json").read_text())
            groups.setdefault((_label(run), s["credit"]), []).append(
                (s["eval"]["initial"]["eval/gold"], s["eval"]["final"]["eval/gold"], s["eval"]["final"]["eval/response_len"]))
    lines = ["| policy | credit | seeds | gold at step 0 | final gold | rise | final response length (each seed) |",
             "|---|---|---|---|---|---|---|"]
    for (kind, credit), vals in sorted(groups.items()):
        first, last = [v[0] for v in vals], [v[1] for v in vals]
        rise = [b - a for a, b, _ in vals]
        sd = statistics.stdev(last) if len(last) > 1 else 0.0
        lines.append(f"| {kind} | {credit} | {len(vals)} | {statistics.mean(first):.3f} | "
                     f"{statistics.mean(last):.3f} ± {sd:.3f} | {statistics.mean(rise):+.3f} (min {min(rise):+.3f}) | "
                     f"{', '.join(f'{v[2]:.1f}' for v in vals)} |")
    return "\n".join(lines)


def real(roots: list[Path]) -> str:
    """One line per run: each step's time, the median, peak memory, gold at the evaluations."""
    lines = ["| policy | steps | step s (each) | median step s | update s (median) | peak memory GiB | gold (evals) |",
             "|---|---|---|---|---|---|---|"]
    for root in roots:
        for run in _runs(root):
            rows = _rows(run)
            steps = [r for r in rows if "perf/step_s" in r]
            golds = [f"{r['eval/gold']:.3f}" for r in rows if "eval/gold" in r]
            times = [r["perf/step_s"] for r in steps]
            lines.append(f"| {_label(run)} | {len(steps)} | {', '.join(f'{t:.1f}' for t in times)} | "
                         f"{statistics.median(times):.1f} | {statistics.median(r['perf/update_s'] for r in steps):.1f} | "
                         f"{max(r['perf/peak_mem_gb'] for r in steps):.2f} | {' → '.join(golds)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    kind, *paths = sys.argv[1:]
    print({"testbed": testbed, "real": real}[kind]([Path(p) for p in paths]))
