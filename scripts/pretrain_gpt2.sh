#!/usr/bin/env bash
# GPT-2 recipe on one machine or in a Slurm allocation:
#   bash scripts/pretrain_gpt2.sh [flags]     torchrun --standalone, up to 2 processes (GPUs, else CPU cores)
#   sbatch scripts/pretrain_gpt2.sh [flags]   one rank per Slurm task (srun); e.g. sbatch --ntasks=2
# Run both from the repository root; sbatch writes the log to slurm-<job id>.out there.
# Extra flags go to scripts/pretrain_gpt.py (e.g. --train-iters 1000 --bf16).
# Environment: NPROC (processes without Slurm), DATA_PATH, SAVE_DIR, TB_DIR, CONFIG (engine JSON),
# MODEL_CONFIG, PYTHON, OMP_NUM_THREADS, MAX_RESTARTS (torchrun's --max-restarts: restart every rank
# when one dies, resuming from SAVE_DIR/latest); under Slurm also LAUNCHER, NPROC_PER_NODE
# (see scripts/launch_lib.bash).
set -euo pipefail
# Under sbatch, $0 is slurmd's spooled copy of this file: the submit directory stands in for its location.
ROOT=${MEGAZERO_DIR:-$(dirname "$0")/..}
[ -n "${MEGAZERO_DIR:-}" ] || [ -f "$ROOT/scripts/launch_lib.bash" ] || ROOT=${SLURM_SUBMIT_DIR:-$ROOT}
if [ ! -f "$ROOT/scripts/launch_lib.bash" ]; then
  echo "error: $ROOT is not the megazero repository (no scripts/launch_lib.bash); run sbatch from the" \
    "repository root (sbatch scripts/pretrain_gpt2.sh) or set MEGAZERO_DIR" >&2
  exit 2
fi
cd "$ROOT"
source scripts/launch_lib.bash

SAVE_DIR=${SAVE_DIR:-checkpoints/gpt2_cpu}
megazero_data_args data/gpt2/shakespeare "$@"
megazero_launch scripts/pretrain_gpt.py \
  --model-config "${MODEL_CONFIG:-configs/gpt2_cpu.json}" --deepspeed_config "${CONFIG:-configs/ds_gpt2_cpu.json}" \
  "${DATA_ARGS[@]}" --save "$SAVE_DIR" --load "$SAVE_DIR" \
  --tensorboard-dir "${TB_DIR:-runs/gpt2_cpu}" \
  --train-iters 500 --train-minutes 10 --eval-interval 100 --save-interval 100 --log-interval 10 "$@"
