#!/usr/bin/env bash
# The paper's comparison: the four presets x credit schemes x seeds, one run after another on
# this machine's GPUs through datc-launch. Finished runs are skipped and interrupted ones resume
# (trainer.resume=auto), so re-running the script completes the sweep.
#
#   bash scripts/paper_sweep.sh                                  # 4 presets x 4 schemes x 3 seeds, 4 GPUs
#   NPROC=8 SCHEMES="grpo datc" SEEDS="0" bash scripts/paper_sweep.sh trainer.steps=200
#   DRY_RUN=1 bash scripts/paper_sweep.sh                        # print the commands only
#
# On a Slurm cluster the same sweep is one command, each point a job (see README, Scaling out):
#   datc-train -m hydra/launcher=slurm hydra.launcher.gpus_per_node=4 deepspeed=zero2 \
#     experiment=paper/qwen3_ultrafeedback,paper/qwen3_hh_rlhf,paper/llama32_ultrafeedback,paper/llama32_hh_rlhf \
#     credit=grpo,datc,gcpo,delta seed=0,1,2
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
NPROC=${NPROC:-4}
PRESETS=${PRESETS:-"qwen3_ultrafeedback qwen3_hh_rlhf llama32_ultrafeedback llama32_hh_rlhf"}
SCHEMES=${SCHEMES:-"grpo datc gcpo delta"}
SEEDS=${SEEDS:-"0 1 2"}
# gcpo's negative guidance prompt for instruction-following models (the public code's wording;
# the scheme's default is for the testbed's word-level vocabulary)
GCPO_TEMPLATE=${GCPO_TEMPLATE:-"{prompt} Note: Intentionally generate an incorrect answer."}
for preset in $PRESETS; do
  for credit in $SCHEMES; do
    extra=()
    [[ $credit == gcpo ]] && extra=("credit.template='$GCPO_TEMPLATE'")
    for seed in $SEEDS; do
      "$BIN/datc-launch" ${DRY_RUN:+--dry-run} --nproc "$NPROC" experiment=paper/$preset credit=$credit seed=$seed \
        results_dir=results/paper "${extra[@]}" "$@"
    done
  done
done
