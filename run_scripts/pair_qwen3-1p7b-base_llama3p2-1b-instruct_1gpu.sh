#!/usr/bin/env bash
# HACPO on one 80 GiB GPU: Qwen3-1.7B-Base + Llama-3.2-1B-Instruct, the paper's setup (α 1.0,
# lower bound 0.8, δ_step 0.025; configs/pair_qwen3-1p7b-base_llama3p2-1b-instruct_1gpu.yaml).
#
#   HACPO_MODEL_A=/models/Qwen3-1.7B-Base HACPO_MODEL_B=/models/Llama-3.2-1B-Instruct \
#   HACPO_DATA_DIR=data/paper bash run_scripts/pair_qwen3-1p7b-base_llama3p2-1b-instruct_1gpu.sh [hydra overrides...]
#
# The preset already shares its one GPU between the agents (PLACEMENT=shared is not needed).
# Environment options: run_scripts/_run_pair.sh.
set -euo pipefail

PAIR=qwen3-1p7b-base_llama3p2-1b-instruct_1gpu
export HACPO_MODEL_A=${HACPO_MODEL_A:-Qwen/Qwen3-1.7B-Base}
export HACPO_MODEL_B=${HACPO_MODEL_B:-meta-llama/Llama-3.2-1B-Instruct}

# shellcheck source=run_scripts/_run_pair.sh
source "$(dirname "$0")/_run_pair.sh"
