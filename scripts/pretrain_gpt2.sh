#!/usr/bin/env bash
# Single-machine GPT-2 recipe: one process per CPU core (or per GPU), torchrun --standalone.
# Extra arguments go to scripts/pretrain_gpt.py (e.g. --train-iters 1000 --bf16).
# Environment: NPROC (processes), DATA_PATH, SAVE_DIR, TB_DIR, CONFIG (engine JSON), MODEL_CONFIG.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [ -z "${NPROC:-}" ]; then
  NPROC=$("$PY" -c "import torch; print(torch.cuda.device_count() or __import__('os').cpu_count())")
fi
DATA_PATH=${DATA_PATH:-data/gpt2/shakespeare}
SAVE_DIR=${SAVE_DIR:-checkpoints/gpt2_cpu}
TB_DIR=${TB_DIR:-runs/gpt2_cpu}
CONFIG=${CONFIG:-configs/ds_gpt2_cpu.json}
MODEL_CONFIG=${MODEL_CONFIG:-configs/gpt2_cpu.json}
# one compute thread per process: the processes share the cores
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" scripts/pretrain_gpt.py \
  --model-config "$MODEL_CONFIG" --deepspeed_config "$CONFIG" \
  --data-path "$DATA_PATH" --save "$SAVE_DIR" --load "$SAVE_DIR" --tensorboard-dir "$TB_DIR" \
  --train-iters 500 --train-minutes 10 --eval-interval 100 --save-interval 100 --log-interval 10 "$@"
