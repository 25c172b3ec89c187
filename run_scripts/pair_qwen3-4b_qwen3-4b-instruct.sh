#!/usr/bin/env bash
# HACPO: Qwen3-4B + Qwen3-4B-Instruct (paper setup, docs/REPRODUCE.md: α 3.0, lower bound 0.8, δ_step 0.01).
#
#   HACPO_MODEL_A=/models/Qwen3-4B HACPO_MODEL_B=/models/Qwen3-4B-Instruct-2507 \
#   HACPO_DATA_DIR=data/paper bash run_scripts/pair_qwen3-4b_qwen3-4b-instruct.sh [hydra overrides...]
#
# Environment and placement options: run_scripts/_run_pair.sh.
set -euo pipefail

PAIR=qwen3-4b_qwen3-4b-instruct
export HACPO_MODEL_A=${HACPO_MODEL_A:-Qwen/Qwen3-4B}
export HACPO_MODEL_B=${HACPO_MODEL_B:-Qwen/Qwen3-4B-Instruct-2507}

# shellcheck source=run_scripts/_run_pair.sh
source "$(dirname "$0")/_run_pair.sh"
