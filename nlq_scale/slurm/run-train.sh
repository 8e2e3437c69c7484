#!/usr/bin/env bash
# Shared body of the sbatch templates: one `nlq-scale train` rank per SLURM task, then requeue the job
# if training stopped for preemption or the time limit (status.json says "preempted").
#   run-train.sh RUN_DIR [nlq-scale train arguments...]
#
# Signals: the templates ask for `--signal=USR2@<seconds>` (no `B:`), so SLURM sends USR2 to every
# task shortly before the time limit, and at preemption when the cluster sets
# SlurmctldParameters=preempt_send_user_signal. train finishes the step, checkpoints, exits; this
# script then requeues. `scancel` (TERM to the batch script too) ends the job for good.
set -euo pipefail
RUN_DIR=$1
shift
NLQ_SCALE=${NLQ_SCALE:-nlq-scale}
mkdir -p "$RUN_DIR"
# Ranks come from SLURM_PROCID/SLURM_NTASKS; MASTER_ADDR is the first node, the port derives from the job id.
# torchrun-style variables inherited from the submitting shell (sbatch exports it) would override them.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT NLQ_SCALE_STORE_HOSTED
srun --kill-on-bad-exit=1 "$NLQ_SCALE" train --run-dir "$RUN_DIR" "$@" || true
state=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("state", "unknown"))' \
        "$RUN_DIR/status.json" 2>/dev/null || echo unknown)
echo "run-train.sh: $RUN_DIR ended as $state"
case $state in
  preempted) scontrol requeue "$SLURM_JOB_ID" ;;
  completed|diverged) ;;
  *) exit 1 ;;
esac
