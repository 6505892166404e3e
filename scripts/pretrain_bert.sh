#!/usr/bin/env bash
# Single-machine BERT recipe: one process per CPU core (or per GPU), torchrun --standalone.
# Extra arguments go to scripts/pretrain_bert.py (e.g. --train-iters 2000 --binary-head nsp).
# Environment: NPROC, DATA_PATH, SAVE_DIR, TB_DIR, CONFIG (engine JSON), MODEL_CONFIG.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [ -z "${NPROC:-}" ]; then
  NPROC=$("$PY" -c "import torch; print(torch.cuda.device_count() or __import__('os').cpu_count())")
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" scripts/pretrain_bert.py \
  --model-config "${MODEL_CONFIG:-configs/bert_cpu.json}" --deepspeed_config "${CONFIG:-configs/ds_bert_cpu.json}" \
  --data-path "${DATA_PATH:-data/bert/shakespeare}" --save "${SAVE_DIR:-checkpoints/bert_cpu}" \
  --load "${SAVE_DIR:-checkpoints/bert_cpu}" --tensorboard-dir "${TB_DIR:-runs/bert_cpu}" \
  --train-iters 2000 --train-minutes 10 --eval-interval 200 --save-interval 200 --log-interval 20 "$@"
