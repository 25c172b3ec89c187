#!/usr/bin/env bash
# HACPO: Qwen3-4B-Base + Llama-3.2-3B-Instruct (paper setup, docs/REPRODUCE.md: α 1.0, lower bound 0.8, δ_step 0.025).
#
#   HACPO_MODEL_A=/models/Qwen3-4B-Base HACPO_MODEL_B=/models/Llama-3.2-3B-Instruct \
#   HACPO_DATA_DIR=data/paper bash run_scripts/pair_qwen3-4b-base_llama3p2-3b-instruct.sh [hydra overrides...]
#
# Environment and placement options: run_scripts/_run_pair.sh.
set -euo pipefail

PAIR=qwen3-4b-base_llama3p2-3b-instruct
export HACPO_MODEL_A=${HACPO_MODEL_A:-Qwen/Qwen3-4B-Base}
export HACPO_MODEL_B=${HACPO_MODEL_B:-meta-llama/Llama-3.2-3B-Instruct}

# shellcheck source=run_scripts/_run_pair.sh
source "$(dirname "$0")/_run_pair.sh"
