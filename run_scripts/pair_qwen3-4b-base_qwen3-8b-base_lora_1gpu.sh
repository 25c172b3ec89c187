#!/usr/bin/env bash
# HACPO on one 80 GiB GPU with LoRA agents: Qwen3-4B-Base + Qwen3-8B-Base, the paper's α 3.0,
# lower bound 0.8, δ_step 0.025, each agent a rank-64 adapter (configs/pair_qwen3-4b-base_qwen3-8b-base_lora_1gpu.yaml).
#
#   HACPO_MODEL_A=/models/Qwen3-4B-Base HACPO_MODEL_B=/models/Qwen3-8B-Base \
#   HACPO_DATA_DIR=data/paper bash run_scripts/pair_qwen3-4b-base_qwen3-8b-base_lora_1gpu.sh [hydra overrides...]
#
# The preset already shares its one GPU between the agents (PLACEMENT=shared is not needed).
# Environment options: run_scripts/_run_pair.sh.
set -euo pipefail

PAIR=qwen3-4b-base_qwen3-8b-base_lora_1gpu
export HACPO_MODEL_A=${HACPO_MODEL_A:-Qwen/Qwen3-4B-Base}
export HACPO_MODEL_B=${HACPO_MODEL_B:-Qwen/Qwen3-8B-Base}

# shellcheck source=run_scripts/_run_pair.sh
source "$(dirname "$0")/_run_pair.sh"
