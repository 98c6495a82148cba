#!/usr/bin/env bash
# GPU check of the scale-out path: short DATC runs on one GPU without DeepSpeed, under ZeRO-2 and
# under ZeRO-3, each reported with its mean step time, tokens per second and peak GPU memory.
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
"$BIN/python" scripts/gpu_report.py "$OUT/none" "$OUT/zero2" "$OUT/zero3"
