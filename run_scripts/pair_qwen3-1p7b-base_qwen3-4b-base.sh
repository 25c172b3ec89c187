#!/usr/bin/env bash
# HACPO: Qwen3-1.7B-Base + Qwen3-4B-Base (paper setup, HACPO_SPEC §9: α 1.0, lower bound 0.8, δ_step 0.025).
#
#   HACPO_MODEL_A=/models/Qwen3-1.7B-Base HACPO_MODEL_B=/models/Qwen3-4B-Base \
#   HACPO_DATA_DIR=data/paper bash run_scripts/pair_qwen3-1p7b-base_qwen3-4b-base.sh [hydra overrides...]
#
# Environment (all optional):
#   HACPO_MODEL_A, HACPO_MODEL_B  model dirs or cached hub ids [Qwen/Qwen3-1.7B-Base, Qwen/Qwen3-4B-Base]
#   HACPO_DATA_DIR                prepared parquet files [data/paper]
#   HACPO_OUTPUT_DIR              checkpoints and Hydra logs [outputs]
#   PRESET                        config name [pair_qwen3-1p7b-base_qwen3-4b-base]; pair_qwen3-1p7b-base_qwen3-4b-base_4gpu: 4 GPUs
#   PLACEMENT                     preset: the preset's pools | shared: both agents on one shared
#                                 pool of trainer.n_gpus_per_node x trainer.nnodes GPUs, taking turns
set -euo pipefail
cd "$(dirname "$0")/.."

PRESET=${PRESET:-pair_qwen3-1p7b-base_qwen3-4b-base}
PLACEMENT=${PLACEMENT:-preset}
export HACPO_MODEL_A=${HACPO_MODEL_A:-Qwen/Qwen3-1.7B-Base}
export HACPO_MODEL_B=${HACPO_MODEL_B:-Qwen/Qwen3-4B-Base}
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
    hydra.run.dir="$HACPO_OUTPUT_DIR/qwen3-1p7b-base_qwen3-4b-base/hydra/$(date +%Y%m%d-%H%M%S)" \
    "${placement[@]}" \
    "$@"
