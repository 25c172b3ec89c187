#!/usr/bin/env bash
# HACPO: Llama-3.2-1B-Instruct + Llama-3.2-3B-Instruct (paper setup, HACPO_SPEC §9: α 1.0, lower bound 0.9, δ_step 0.01).
#
#   HACPO_MODEL_A=/models/Llama-3.2-1B-Instruct HACPO_MODEL_B=/models/Llama-3.2-3B-Instruct \
#   HACPO_DATA_DIR=data/paper bash run_scripts/pair_llama3p2-1b-instruct_llama3p2-3b-instruct.sh [hydra overrides...]
#
# Environment (all optional):
#   HACPO_MODEL_A, HACPO_MODEL_B  model dirs or cached hub ids [meta-llama/Llama-3.2-1B-Instruct, meta-llama/Llama-3.2-3B-Instruct]
#   HACPO_DATA_DIR                prepared parquet files [data/paper]
#   HACPO_OUTPUT_DIR              checkpoints and Hydra logs [outputs]
#   PRESET                        config name [pair_llama3p2-1b-instruct_llama3p2-3b-instruct]; pair_llama3p2-1b-instruct_llama3p2-3b-instruct_4gpu: 4 GPUs
#   PLACEMENT                     preset: the preset's pools | shared: both agents on one shared
#                                 pool of trainer.n_gpus_per_node x trainer.nnodes GPUs, taking turns
set -euo pipefail
cd "$(dirname "$0")/.."

PRESET=${PRESET:-pair_llama3p2-1b-instruct_llama3p2-3b-instruct}
PLACEMENT=${PLACEMENT:-preset}
export HACPO_MODEL_A=${HACPO_MODEL_A:-meta-llama/Llama-3.2-1B-Instruct}
export HACPO_MODEL_B=${HACPO_MODEL_B:-meta-llama/Llama-3.2-3B-Instruct}
export HACPO_DATA_DIR=${HACPO_DATA_DIR:-data/paper}
export HACPO_OUTPUT_DIR=${HACPO_OUTPUT_DIR:-outputs}

case $PLACEMENT in
    preset) placement=() ;;
    shared)
        placement=(
            agents.0.n_gpus_per_node=0
            agents.1.n_gpus_per_node=0
            actor_rollout_ref.actor.fsdp_config.param_offload=true
            actor_rollout_ref.actor.fsdp_config.optimizer_offload=true
            actor_rollout_ref.rollout.gpu_memory_utilization=0.35
        ) ;;
    *)
        echo "error: PLACEMENT=$PLACEMENT: expected preset or shared" >&2
        exit 2 ;;
esac

exec python -m recipe_hacpo.main --config-name "$PRESET" \
    hydra.run.dir="$HACPO_OUTPUT_DIR/llama3p2-1b-instruct_llama3p2-3b-instruct/hydra/$(date +%Y%m%d-%H%M%S)" \
    "${placement[@]}" \
    "$@"
