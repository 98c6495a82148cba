#!/usr/bin/env bash
# GPU check of the paper presets: a few steps of each family's preset (UltraFeedback prompts)
# with credit=grpo and credit=datc on one GPU (ZeRO-2, 32 responses per step, full 512-token
# budget), reported with step time, tokens per second and peak memory. Needs the checkpoints
# (downloaded once, or local copies: pass policy.path=... reward.path=... data.path=...).
#
#   bash scripts/gpu_check_presets.sh
#   STEPS=10 bash scripts/gpu_check_presets.sh trainer.max_new_tokens=256
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=${OUT:-runs/gpu_check_presets}
STEPS=${STEPS:-5}
runs=()
for fam in qwen3 llama32; do
  for credit in grpo datc; do
    "$BIN/datc-launch" experiment=paper/${fam}_ultrafeedback credit=$credit trainer.steps="$STEPS" \
      trainer.batch_size=32 trainer.mini_batch_size=32 trainer.micro_batch_size=4 trainer.eval_size=32 \
      trainer.eval_every="$STEPS" trainer.checkpoint_every="$STEPS" trainer.progress=false \
      run_dir="$OUT/${fam}-${credit}" "$@" >/dev/null
    runs+=("$OUT/${fam}-${credit}")
  done
done
"$BIN/python" scripts/gpu_report.py "${runs[@]}"
