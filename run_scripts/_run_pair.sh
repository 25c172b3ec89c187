#!/usr/bin/env bash
# Shared body of the run_scripts/pair_*.sh launchers (sourced, not run): set PAIR and the two
# model defaults, then source this file. Environment (all optional):
#   HACPO_MODEL_A, HACPO_MODEL_B  model dirs or cached hub ids [the pair script's defaults]
#   HACPO_DATA_DIR                prepared parquet files [data/paper]
#   HACPO_OUTPUT_DIR              checkpoints and Hydra logs [outputs]
#   PRESET                        config name [pair_$PAIR]; pair_${PAIR}_4gpu where one exists: 4 GPUs
#   PLACEMENT                     preset: the preset's pools | shared: every agent on one shared
#                                 pool of trainer.n_gpus_per_node x trainer.nnodes GPUs, taking turns
#   BASELINE                      the method [the preset's: hacpo]: hacpo | naive | gspo | gspo2x |
#                                 gspo4x | grpo | grpo2x | grpo4x | graft | sgt
#                                 (configs/baseline/; the same as passing +baseline=NAME)
#   HACPO_DRY_RUN                 set: print the command, one shell-quoted argument a line, and
#                                 run nothing (what tests/test_doc_commands.py composes)
# Extra arguments of the pair script are Hydra overrides.

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

PRESET=${PRESET:-pair_$PAIR}
PLACEMENT=${PLACEMENT:-preset}
export HACPO_DATA_DIR=${HACPO_DATA_DIR:-data/paper}
export HACPO_OUTPUT_DIR=${HACPO_OUTPUT_DIR:-outputs}

case $PLACEMENT in
    preset) placement=() ;;
    shared)
        placement=(
            agents_n_gpus_per_node=0
            actor_rollout_ref.actor.fsdp_config.param_offload=true
            actor_rollout_ref.actor.fsdp_config.optimizer_offload=true
            actor_rollout_ref.rollout.gpu_memory_utilization=0.35
        ) ;;
    *)
        echo "error: PLACEMENT=$PLACEMENT: expected preset or shared" >&2
        exit 2 ;;
esac

# the preset names the run and its folder after the method ($HACPO_OUTPUT_DIR/${PAIR}_<method>):
# a baseline never resumes the HACPO run, and a resume by another run is refused before Ray
method=()
if [[ -n ${BASELINE:-} ]]; then
    method=("+baseline=$BASELINE")
fi

exec ${HACPO_DRY_RUN:+printf %q\\n} python -m recipe_hacpo.main --config-name "$PRESET" \
    hydra.run.dir="$HACPO_OUTPUT_DIR/${PAIR}_${BASELINE:-hacpo}/hydra/$(date +%Y%m%d-%H%M%S)" \
    ${placement[@]+"${placement[@]}"} \
    ${method[@]+"${method[@]}"} \
    "$@"
