#!/usr/bin/env bash
# GPU check of the scale-out path: short DATC runs on one GPU without DeepSpeed, under ZeRO-2 and
# under ZeRO-3, each printing its mean step time, tokens per second and peak GPU memory.
#
#   bash scripts/gpu_check.sh                       # the tiny testbed (prepare step included)
#   bash scripts/gpu_check.sh policy=tiny_llama     # extra Hydra overrides go to every run
#
# Runs go to runs/gpu_check/<stage> (delete it to measure again). On a machine without a GPU the
# same runs happen on CPU (a smoke test of the script, not a measurement).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=${OUT:-runs/gpu_check}
STEPS=${STEPS:-20}
for ds in none zero2 zero3; do
  "$BIN/datc-launch" deepspeed=$ds credit=datc trainer.steps="$STEPS" trainer.eval_every="$STEPS" \
    trainer.checkpoint_every="$STEPS" trainer.progress=false run_dir="$OUT/$ds" "$@" >/dev/null
done
"$BIN/python" - "$OUT" <<'PY'
import json, sys, torch
from pathlib import Path
out = Path(sys.argv[1])
dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (no GPU: smoke test only)"
print(f"device: {dev}")
print(f"{'deepspeed':<10} {'step s':>8} {'tokens/s':>10} {'samples/s':>10} {'peak GiB':>9} {'final gold':>10}")
for ds in ("none", "zero2", "zero3"):
    rows = [json.loads(x) for x in (out / ds / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_s" in r][2:] or [r for r in rows if "perf/step_s" in r]  # skip warm-up
    mean = lambda k: sum(r[k] for r in steps) / len(steps)
    peak = max(r["perf/peak_mem_gb"] for r in steps)
    gold = json.loads((out / ds / "summary.json").read_text())["eval"]["final"].get("eval/gold")
    print(f"{ds:<10} {mean('perf/step_s'):>8.3f} {mean('perf/tokens_per_s'):>10.0f} {mean('perf/samples_per_s'):>10.1f} "
          f"{peak:>9.2f} {gold if gold is None else round(gold, 3)!s:>10}")
PY
