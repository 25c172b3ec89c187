#!/usr/bin/env bash
# HACPO: Qwen3-4B-Base + Qwen3-8B-Base (paper setup, docs/REPRODUCE.md: α 3.0, lower bound 0.8, δ_step 0.025).
#
#   HACPO_MODEL_A=/models/Qwen3-4B-Base HACPO_MODEL_B=/models/Qwen3-8B-Base \
#   HACPO_DATA_DIR=data/paper bash run_scripts/pair_qwen3-4b-base_qwen3-8b-base.sh [hydra overrides...]
#
# Environment and placement options: run_scripts/_run_pair.sh.
set -euo pipefail

PAIR=qwen3-4b-base_qwen3-8b-base
export HACPO_MODEL_A=${HACPO_MODEL_A:-Qwen/Qwen3-4B-Base}
export HACPO_MODEL_B=${HACPO_MODEL_B:-Qwen/Qwen3-8B-Base}

# shellcheck source=run_scripts/_run_pair.sh
source "$(dirname "$0")/_run_pair.sh"
