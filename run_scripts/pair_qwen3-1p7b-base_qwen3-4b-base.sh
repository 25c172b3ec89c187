#!/usr/bin/env bash
# HACPO: Qwen3-1.7B-Base + Qwen3-4B-Base (paper setup, docs/REPRODUCE.md: α 1.0, lower bound 0.8, δ_step 0.025).
#
#   HACPO_MODEL_A=/models/Qwen3-1.7B-Base HACPO_MODEL_B=/models/Qwen3-4B-Base \
#   HACPO_DATA_DIR=data/paper bash run_scripts/pair_qwen3-1p7b-base_qwen3-4b-base.sh [hydra overrides...]
#
# Environment and placement options: run_scripts/_run_pair.sh.
set -euo pipefail

PAIR=qwen3-1p7b-base_qwen3-4b-base
export HACPO_MODEL_A=${HACPO_MODEL_A:-Qwen/Qwen3-1.7B-Base}
export HACPO_MODEL_B=${HACPO_MODEL_B:-Qwen/Qwen3-4B-Base}

# shellcheck source=run_scripts/_run_pair.sh
source "$(dirname "$0")/_run_pair.sh"
