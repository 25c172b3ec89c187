#!/usr/bin/env bash
# HACPO: Llama-3.2-1B-Instruct + Llama-3.2-3B-Instruct (paper setup, docs/REPRODUCE.md: α 1.0, lower bound 0.9, δ_step 0.01).
#
#   HACPO_MODEL_A=/models/Llama-3.2-1B-Instruct HACPO_MODEL_B=/models/Llama-3.2-3B-Instruct \
#   HACPO_DATA_DIR=data/paper bash run_scripts/pair_llama3p2-1b-instruct_llama3p2-3b-instruct.sh [hydra overrides...]
#
# Environment and placement options: run_scripts/_run_pair.sh.
set -euo pipefail

PAIR=llama3p2-1b-instruct_llama3p2-3b-instruct
export HACPO_MODEL_A=${HACPO_MODEL_A:-meta-llama/Llama-3.2-1B-Instruct}
export HACPO_MODEL_B=${HACPO_MODEL_B:-meta-llama/Llama-3.2-3B-Instruct}

# shellcheck source=run_scripts/_run_pair.sh
source "$(dirname "$0")/_run_pair.sh"
