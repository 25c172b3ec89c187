#!/usr/bin/env bash
# One node's Ray for run_scripts/slurm/hacpo.slurm, run by srun as that node's only task:
#
#   ray_node.sh LOG_FILE ray start ... --block
#
# - clears the GPU variables of other vendors first (gpu_env.sh): Ray's workers inherit them
# - Ray's own output (the raylet's and GCS's log lines) goes to LOG_FILE, not to the job log
# - SIGUSR2 (the batch script's clean-up sends it to the step's srun, which hands it to every
#   process of the step) or SIGTERM (scancel) stops Ray with a SIGTERM to `ray start`, and ends
#   the step with status 0: a run that ends normally leaves COMPLETED Ray steps in sacct, where
#   `ray start --block` alone exits 1 on SIGTERM, and a SIGTERM to srun makes Slurm kill the
#   step (CANCELLED). Ray's processes start with SIGUSR1 and SIGUSR2 ignored, so only this
#   script acts on SIGUSR2.
# - SIGUSR1 is the trainer's stop request (`scancel --full --signal=USR1`, `--signal=USR1@<secs>`
#   without B: reach every step): this step and its Ray ignore it and keep serving the trainer
#   while it checkpoints.
#   Ray dying on its own keeps its status and prints the end of LOG_FILE.
set -uo pipefail

log=${1:?usage: ray_node.sh LOG_FILE COMMAND...}
shift
# shellcheck source=run_scripts/slurm/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
clear_foreign_gpu_env || exit 2
node=${SLURMD_NODENAME:-$(hostname -s)}
mkdir -p "$(dirname "$log")" || exit 2

(
    trap '' USR1 USR2 # inherited through exec by ray start and every process it starts
    exec "$@"
) >>"$log" 2>&1 &
pid=$!
stopping=0
trap '' USR1
trap 'stopping=1; kill -TERM "$pid" 2>/dev/null' USR2 TERM INT
status=0
wait "$pid" || status=$?
# a trapped signal ends `wait` early: wait until ray start has stopped its processes
while kill -0 "$pid" 2>/dev/null; do
    status=0
    wait "$pid" || status=$?
done
if ((stopping)); then
    echo "hacpo: ray on $node stopped"
    exit 0
fi
echo "error: ray on $node exited with status $status; the end of $log:" >&2
tail -n 20 "$log" >&2
exit "$status"
