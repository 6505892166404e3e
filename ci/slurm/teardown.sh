#!/usr/bin/env bash
# Stop the Slurm started by ci/slurm/setup.sh, by the pids in its pid files (never by name).
set -uo pipefail
STATE=${SLURM_STATE_DIR:-/tmp/megazero-slurm}
for pidfile in "$STATE"/pids/*.pid; do
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null
  for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  kill -9 "$pid" 2>/dev/null
  rm -f "$pidfile"
done
rm -rf "$STATE"
exit 0
