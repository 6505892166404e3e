# Shared by the launchers in scripts/ (sourced from the repository root, never run on its own).
# megazero_launch RECIPE ARGS... starts RECIPE on the resources it finds:
#   - in a Slurm allocation (an sbatch job or an salloc shell, not inside an srun step):
#       LAUNCHER=srun (default): one rank per Slurm task; each rank reads SLURM_PROCID/NTASKS/LOCALID
#       LAUNCHER=torchrun: one task per node running torchrun, c10d rendezvous on the first node,
#                          NPROC_PER_NODE processes per node (default SLURM_NTASKS_PER_NODE, else 1)
#     with OMP_NUM_THREADS = --cpus-per-task, MASTER_ADDR the first host, MASTER_PORT from the job id;
#   - anywhere else: torchrun --standalone with NPROC processes (default: the GPUs, else the CPU
#     cores this process may run on, at most 2) and OMP_NUM_THREADS=1 (default NPROC on a CPU: the
#     cores shared among the processes).
# MAX_RESTARTS (default 0) is torchrun's --max-restarts: when a worker dies, torchrun stops the
# others and starts them all again, up to that many times; the same command runs again, so the
# recipe resumes from --load's `latest` (the launchers pass --save and --load the same directory).
# With LAUNCHER=srun no torchrun runs: a dead rank ends the step (srun --kill-on-bad-exit) and a
# node failure is survived by Slurm requeueing the job (sbatch --requeue; see pretrain_gpt2.sbatch).
# PYTHON (default .venv/bin/python of the repository) runs the recipe; SAVE_DIR, when set and
# holding a `latest`, is announced as the checkpoint the run resumes from.

megazero_in_allocation() {
  # srun steps set SLURM_STEP_ID; the batch script and an salloc shell do not
  [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${SLURM_STEP_ID:-}" ]
}

megazero_launch() {
  local recipe=$1
  shift
  PYTHON=${PYTHON:-$(pwd)/.venv/bin/python}
  MAX_RESTARTS=${MAX_RESTARTS:-0}
  if ! [[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]]; then
    echo "error: MAX_RESTARTS=$MAX_RESTARTS is not a whole number of restarts (e.g. MAX_RESTARTS=3)" >&2
    exit 2
  fi
  if [ ! -x "$PYTHON" ]; then
    echo "error: no Python interpreter at $PYTHON; run \`make install\` in $(pwd) or set PYTHON" >&2
    exit 2
  fi
  if [ "$MAX_RESTARTS" != 0 ]; then
    # torchrun (torch >= 2.5) hands every attempt of the workers the same agent-hosted TCPStore, keys
    # and all: a restarted rank can read a killed rank's gloo/NCCL address from the attempt before and
    # fail to connect (pytorch issue 135712). Its opt-out gives each attempt a fresh store (on rank 0).
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
  fi
  if [ -n "${SAVE_DIR:-}" ] && [ -f "$SAVE_DIR/latest" ]; then
    # only a plain tag naming a directory is announced; the recipe checks the rest (and says why)
    local latest_tag
    latest_tag=$(LC_ALL=C tr -d '\000' < "$SAVE_DIR/latest" | head -c 256)
    if [ -n "$latest_tag" ] && [[ "$latest_tag" != */* ]] && [ -d "$SAVE_DIR/$latest_tag" ]; then
      echo "resuming from $SAVE_DIR/$latest_tag"
    else
      echo "$SAVE_DIR/latest does not name a checkpoint directory: the recipe checks it"
    fi
  fi
  if megazero_in_allocation; then
    megazero_launch_slurm "$recipe" "$@"
  else
    megazero_launch_standalone "$recipe" "$@"
  fi
}

megazero_launch_standalone() {
  local recipe=$1
  shift
  if [ -z "${NPROC:-}" ]; then
    # the GPUs, else the CPUs this process may use (a cgroup or taskset may allow fewer than the machine
    # has), at most 2: the recipes' configs (a global batch of 2 micro-batches) fit 1 or 2 data-parallel
    # ranks; on a CPU the cores beyond them become each process's threads
    local devices cores
    read -r devices cores < <("$PYTHON" -c "import os, torch; print(torch.cuda.device_count(), len(os.sched_getaffinity(0)))")
    local available=$(( devices > 0 ? devices : cores ))
    NPROC=$(( available < 2 ? available : 2 ))
    [ "$devices" -gt 0 ] || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / NPROC ))}
  fi
  # otherwise one compute thread per process: the processes share the cores
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  echo "launcher torchrun --standalone, $NPROC process(es) on $(hostname), max restarts $MAX_RESTARTS"
  exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" --max-restarts="$MAX_RESTARTS" \
    "$recipe" "$@"
}

megazero_launch_slurm() {
  local recipe=$1
  shift
  local launcher=${LAUNCHER:-srun}
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  # a fixed port collides between jobs sharing a node
  MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
  export MASTER_ADDR MASTER_PORT
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
  # SLURM_RESTART_COUNT: how often Slurm requeued this job (node failure, scontrol requeue)
  echo "job $SLURM_JOB_ID: $SLURM_JOB_NUM_NODES node(s) [$SLURM_JOB_NODELIST], ${SLURM_NTASKS:-1} task(s)," \
    "launcher $launcher, master $MASTER_ADDR:$MASTER_PORT, requeued ${SLURM_RESTART_COUNT:-0} time(s)"
  case "$launcher" in
    srun)
      if [ "$MAX_RESTARTS" != 0 ]; then
        echo "warning: MAX_RESTARTS=$MAX_RESTARTS is for torchrun; with LAUNCHER=srun a dead rank ends the job" \
          "step (submit with --requeue to survive node failures, or use LAUNCHER=torchrun)" >&2
      fi
      # srun forwards --signal and scancel's signals to every task; each rank catches them
      exec srun --kill-on-bad-exit=1 "$PYTHON" "$recipe" "$@"
      ;;
    torchrun)
      local per_node=${NPROC_PER_NODE:-${SLURM_NTASKS_PER_NODE:-1}}
      # torchrun itself ignores USR1 (its default action would kill it); its workers catch it
      exec srun --kill-on-bad-exit=1 --ntasks-per-node=1 --ntasks="$SLURM_JOB_NUM_NODES" \
        bash -c 'trap "" USR1; exec "$@"' torchrun \
        "$PYTHON" -m torch.distributed.run --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$per_node" \
        --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$SLURM_JOB_ID" \
        --max-restarts="$MAX_RESTARTS" \
        "$recipe" "$@"
      ;;
    *)
      echo "error: unknown LAUNCHER=$launcher (use srun or torchrun)" >&2
      exit 2
      ;;
  esac
}

# DATA_ARGS: `--data-path` from DATA_PATH (one prefix, or "W1 P1 W2 P2 ..." to blend: split into
# words) or the recipe's default ($1), unless the flags after it name the data themselves
# (--data-path, or --train-data-path with --valid-data-path).
megazero_data_args() {
  local default=$1 arg
  shift
  DATA_ARGS=()
  for arg in "$@"; do
    case "$arg" in --data-path|--train-data-path) return 0 ;; esac
  done
  read -r -a DATA_ARGS <<< "${DATA_PATH:-$default}"
  DATA_ARGS=(--data-path "${DATA_ARGS[@]}")
}
