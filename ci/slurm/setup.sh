#!/usr/bin/env bash
# Start a single-machine Slurm with two emulated nodes (n1, n2) for the sbatch tests.
# Usage: source <(bash ci/slurm/setup.sh)   -- prints the `export SLURM_CONF=...` to use.
# Needs root (apt-get, /etc/hosts). State, logs and pid files live in $SLURM_STATE_DIR.
set -euo pipefail
STATE=${SLURM_STATE_DIR:-/tmp/megazero-slurm}
CONF="$STATE/slurm.conf"

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null; then
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >&2
fi

mkdir -p "$STATE"/{ctld,spool,log,pids}
for node in n1 n2; do
  grep -qE "^127\.0\.0\.1[[:space:]].*\b$node\b" /etc/hosts || echo "127.0.0.1 $node" >> /etc/hosts
done
CPUS=$(nproc)
MEM_MB=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9 / 2}' /proc/meminfo)
# proctrack/pgid: cgroup needs a freezer hierarchy slurmd can use (not so in containers), and
# linuxproc leaks processes that ignore SIGTERM after scancel
PROCTRACK=${SLURM_PROCTRACK:-proctrack/pgid}

cat > "$CONF" <<CONF
ClusterName=megazero
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=$PROCTRACK
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# the test job queue is tiny, so the schedulers can look every second: by default a job that became
# eligible (a requeued one) waits up to sched_interval=60 s for the main loop or bf_interval=30 s
SchedulerParameters=sched_interval=1,bf_interval=1
# a requeued job may start only once its old credentials expire (cred_expire + 1 s; 120 s by
# default, 5 at least); 10 s still covers a step launch on a loaded 2-core machine
AuthInfo=cred_expire=10
ReturnToService=2
EnforcePartLimits=ALL
MinJobAge=3600
KillWait=10
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/log/jobcomp.txt
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/slurmd.%n
SlurmctldPidFile=$STATE/pids/slurmctld.pid
SlurmdPidFile=$STATE/pids/slurmd.%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.%n.log
NodeName=n1 NodeAddr=127.0.0.1 Port=17001 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port=17002 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF

export SLURM_CONF="$CONF"
slurmctld -f "$CONF" -i >&2
for node in n1 n2; do slurmd -f "$CONF" -N "$node" >&2; done

for _ in $(seq 1 60); do
  if [ "$(sinfo -h -o '%T' 2>/dev/null | sort -u | tr '\n' ' ')" = "idle " ]; then
    echo "export SLURM_CONF=$CONF"
    exit 0
  fi
  sleep 0.5
done
echo "Slurm did not come up; sinfo says:" >&2
sinfo >&2 || true
tail -n 20 "$STATE"/log/*.log >&2 || true
exit 1
