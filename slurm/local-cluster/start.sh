#!/usr/bin/env bash
# A SLURM cluster of emulated nodes (two by default) on this one machine, for tests, CI and curious users.
#
#   sudo slurm/local-cluster/start.sh            # install (Debian 12) if needed, configure, start
#   export SLURM_CONF=/var/lib/nlq-slurm/slurm.conf   # printed at the end; needed if /etc/slurm/slurm.conf is someone else's
#   sbatch / srun / squeue / scancel ...
#   slurm/local-cluster/stop.sh
#
# One slurmd daemon per node (`slurmd -N node1`, `-N node2`, ...) listens on 127.0.0.1 with one port and
# one CPU each, so a job can span two "nodes" (gloo across them) and one-task jobs run side by side.
# Partitions: `batch` (default, preemptable: REQUEUE) and `urgent` (higher priority tier): a job in
# `urgent` preempts a `batch` job, which first gets its --signal (submitit's USR2) right away
# (preempt_send_user_signal), then GraceTime seconds to checkpoint, and is requeued.
#
# Everything lives in NLQ_SLURM_STATE (default /var/lib/nlq-slurm): config, its own munge key and socket,
# pid files, logs, spool. Idempotent: daemons already running from this state dir are left alone.
# stop.sh ends only the daemons whose pid files are there (and the jobs of this cluster).
#
# Environment: NLQ_SLURM_STATE, NLQ_SLURM_NODES (2), NLQ_SLURM_CTLD_PORT (16817), NLQ_SLURM_NODE_PORTS
# (17001-170NN, one per node), NLQ_SLURM_GRACE_S (preemption grace time, 60). A second cluster beside the
# first (benchmarks/chaos.py) takes its own state dir and ports; node names are shared (all 127.0.0.1).
set -euo pipefail
# The daemons start without the caller's preload: slurmd dies at start-up under LD_PRELOAD=libc.so.6
# (`make portability-glibc`), and a preload meant for training processes reaches a job from its
# submitter's environment (sbatch/srun export it), not from slurmd's.
unset LD_PRELOAD

STATE=${NLQ_SLURM_STATE:-/var/lib/nlq-slurm}
NODE_COUNT=${NLQ_SLURM_NODES:-2}
CTLD_PORT=${NLQ_SLURM_CTLD_PORT:-16817}
NODE_PORTS=${NLQ_SLURM_NODE_PORTS:-17001-$((17000 + NODE_COUNT))}
GRACE_S=${NLQ_SLURM_GRACE_S:-60}
CONF=$STATE/slurm.conf
mapfile -t NODES < <(printf 'node%d\n' $(seq 1 "$NODE_COUNT"))
NODE_LIST=node[1-$NODE_COUNT]

log() { echo "start.sh: $*" >&2; }

# shellcheck source=pids.sh
source "$(dirname "${BASH_SOURCE[0]}")/pids.sh"

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null; then
    return
  fi
  [[ $(id -u) == 0 ]] || { log "installing SLURM needs root (apt-get)"; exit 1; }
  log "installing slurmctld slurmd slurm-client munge (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  # The packages' own services (if an init system started them) would use the default config: not ours.
}

resolve_node_names() {
  # submitit passes the first node name of the job as MASTER_ADDR: node1, node2, ... must resolve.
  local node
  for node in "${NODES[@]}"; do
    if ! getent hosts "$node" >/dev/null; then
      log "adding '127.0.0.1 $node' to /etc/hosts"
      echo "127.0.0.1 $node  # nlq-scale local SLURM cluster" >> /etc/hosts
    fi
  done
}

make_dirs() {
  mkdir -p "$STATE"/{ctld,spool,log,munge}
  chmod 755 "$STATE"
  chown munge:munge "$STATE/munge"
  chmod 755 "$STATE/munge"  # munged: clients need to reach the socket
  if [[ ! -s $STATE/munge/munge.key ]]; then
    dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
    chown munge:munge "$STATE/munge/munge.key"
    chmod 400 "$STATE/munge/munge.key"
  fi
}

write_conf() {
  local host tmp
  host=$(hostname -s)
  tmp=$(mktemp "$STATE/slurm.conf.XXXX")
  cat > "$tmp" <<CONF
# Written by slurm/local-cluster/start.sh (nlq-scale); regenerated on every start.
ClusterName=nlqlocal
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Short credential lifetime: a requeued job may start again after seconds instead of ~2 minutes.
AuthInfo=cred_expire=5,socket=$STATE/munge/munge.socket
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in containers: track processes through /proc, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
LaunchParameters=use_interactive_step
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
MinJobAge=300
KillWait=10
InactiveLimit=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# Send the job's --signal (submitit: USR2) at preemption, so it checkpoints within GraceTime.
SlurmctldParameters=preempt_send_user_signal
NodeName=$NODE_LIST NodeAddr=127.0.0.1 Port=[$NODE_PORTS] CPUs=1 RealMemory=4000 State=UNKNOWN
PartitionName=batch Nodes=$NODE_LIST Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE_S
PartitionName=urgent Nodes=$NODE_LIST MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
CONF
  mv "$tmp" "$CONF"
  chmod 644 "$CONF"
  link_default_conf
}

link_default_conf() {
  # Commands find the cluster without SLURM_CONF when /etc/slurm/slurm.conf is free or already ours.
  local etc=/etc/slurm/slurm.conf
  mkdir -p /etc/slurm
  if [[ ! -e $etc && ! -L $etc ]] || [[ $(readlink "$etc" || true) == "$CONF" ]]; then
    ln -sfn "$CONF" "$etc"
  else
    log "$etc exists and is not ours: export SLURM_CONF=$CONF"
  fi
}

start_munge() {
  local pidfile=$STATE/munge/munged.pid
  alive "$pidfile" && return
  runuser -u munge -- munged --socket="$STATE/munge/munge.socket" --key-file="$STATE/munge/munge.key" \
    --pid-file="$pidfile" --log-file="$STATE/munge/munged.log" --seed-file="$STATE/munge/munged.seed"
}

cold_start() {  # nothing of this cluster runs: no job process can have survived (stop.sh or a reboot)
  local pidfile
  for pidfile in "$STATE/slurmctld.pid" "$STATE"/slurmd-*.pid; do
    alive "$pidfile" && return 1
  done
  return 0
}

start_slurmctld() {
  alive "$STATE/slurmctld.pid" && return
  SLURM_CONF=$CONF slurmctld -f "$CONF"
}

drop_recovered_jobs() {
  # The controller reloads its saved jobs; after a cold start their processes are gone, yet a job it
  # recovers as RUNNING would hold its nodes until SLURM gives up on it. Job ids keep counting.
  local jobs
  jobs=$(SLURM_CONF=$CONF squeue -h -o '%F' 2>/dev/null | sort -u | tr '\n' ' ')
  [[ -z ${jobs// } ]] && return
  log "cancelling jobs left from before the cluster was stopped: $jobs"
  # shellcheck disable=SC2086
  SLURM_CONF=$CONF scancel $jobs 2>/dev/null || true
  for _ in $(seq 1 60); do
    [[ -z $(SLURM_CONF=$CONF squeue -h 2>/dev/null) ]] && return
    sleep 0.5
  done
}

start_slurmd() {
  local node
  for node in "${NODES[@]}"; do
    mkdir -p "$STATE/spool/$node"
    alive "$STATE/slurmd-$node.pid" && continue
    SLURM_CONF=$CONF slurmd -f "$CONF" -N "$node"
  done
}

wait_ready() {
  # Nodes come up "unknown"/"down" after a restart; resume them, then wait until all accept jobs.
  local i state
  for i in $(seq 1 60); do
    state=$(SLURM_CONF=$CONF sinfo -h -N -p batch -o '%N %t' 2>/dev/null || true)
    if [[ $(grep -cE ' (idle|mix|alloc)$' <<<"$state") == "${#NODES[@]}" ]]; then
      return
    fi
    if grep -qE ' (down|drain|drng|fail)' <<<"$state"; then
      SLURM_CONF=$CONF scontrol update NodeName="$NODE_LIST" State=RESUME 2>/dev/null || true
    fi
    sleep 1
  done
  log "nodes not ready after 60 s: $state (logs: $STATE/log/)"
  exit 1
}

install_packages
resolve_node_names
make_dirs
write_conf
start_munge
cold=false
cold_start && cold=true
start_slurmctld
start_slurmd
wait_ready
$cold && drop_recovered_jobs
log "cluster up: $(SLURM_CONF=$CONF sinfo -h -o '%P %D %t' | tr '\n' ' ')"
echo "export SLURM_CONF=$CONF"
