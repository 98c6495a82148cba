#!/usr/bin/env bash
# The GPU check on a lent device, in one command from the repository root, with the kit (.whl/,
# `make gpu-kit`) carried along: the device query, the kit installed into /tmp/site, then the
# default matrix (about 9 minutes; its verdicts printed case by case). Extra arguments go to
# `python -m scripts.gpu_check` (e.g. --full --budget-s 900).
#   bash scripts/gpu_check/on_device.sh "$OUT"
set -u
out=${1:?usage: bash scripts/gpu_check/on_device.sh OUT_DIR [gpu_check arguments]}
shift
mkdir -p "$out"
nvidia-smi > "$out/nvidia_smi.txt" 2>&1 || echo "no nvidia-smi" > "$out/nvidia_smi.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "on_device.sh: the kit did not install (is .whl/ carried?)"; exit 2; }
PYTHONPATH=/tmp/site:. python3 -m scripts.gpu_check --out "$out" "$@"
