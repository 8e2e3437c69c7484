#!/usr/bin/env bash
# Stop what slurm/local-cluster/start.sh started: this cluster's jobs, its slurmd/slurmctld and its munged,
# found through the pid files in NLQ_SLURM_STATE (default /var/lib/nlq-slurm). Other processes, another
# SLURM or a system munged are not touched. State (job ids, logs, munge key) stays for the next start,
# whose start.sh cancels any job the controller still lists (its processes ended with the cluster).
set -euo pipefail

STATE=${NLQ_SLURM_STATE:-/var/lib/nlq-slurm}
CONF=$STATE/slurm.conf

# shellcheck source=pids.sh
source "$(dirname "${BASH_SOURCE[0]}")/pids.sh"

stop_pidfile() {  # stop_pidfile FILE: TERM its daemon, wait up to 20 s, then KILL; a stale file only goes
  local pidfile=$1 pid i
  if pid=$(daemon_pid "$pidfile"); then
    kill -TERM "$pid"
    for i in $(seq 1 40); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.5
    done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  rm -f "$pidfile"
}

if alive "$STATE/slurmctld.pid"; then
  # Jobs' step daemons outlive slurmd: cancel this cluster's jobs while the controller still runs.
  SLURM_CONF=$CONF scancel --quiet --full --state=RUNNING 2>/dev/null || true
  SLURM_CONF=$CONF scancel --quiet --state=PENDING 2>/dev/null || true
  for i in $(seq 1 20); do
    [[ -z $(SLURM_CONF=$CONF squeue -h -t RUNNING,COMPLETING 2>/dev/null) ]] && break
    sleep 0.5
  done
fi
for pidfile in "$STATE"/slurmd-*.pid "$STATE/slurmctld.pid" "$STATE/munge/munged.pid"; do
  [[ -e $pidfile ]] && stop_pidfile "$pidfile"
done
echo "stop.sh: stopped the local SLURM cluster ($STATE)" >&2
