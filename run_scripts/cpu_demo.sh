#!/usr/bin/env bash
# A real HACPO job on CPU, no download: two tiny heterogeneous agents (Qwen2-style with a
# character tokenizer, Llama-style with a digit-pair tokenizer, different sizes), briefly
# warm-started to a ~20 % success rate, learn single-digit addition from data/ through Ray,
# verl's FSDP2 engine and the hf rollout backend.
#
#   bash run_scripts/cpu_demo.sh [hydra overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."

AGENTS_DIR=${HACPO_AGENTS_DIR:-/tmp/hacpo_agents}
export HACPO_OUTPUT_DIR=${HACPO_OUTPUT_DIR:-outputs/cpu_demo}

for kind in qwen2-char-small llama-pair-medium; do
    python -m recipe_hacpo.warm_start --kind "$kind" --task add1 --steps 40 --n-train 2000 \
        --n-eval 200 --batch-size 64 --out "$AGENTS_DIR/$kind"
done

python -m recipe_hacpo.main --config-name hacpo_cpu_demo \
    agents.0.model_path="$AGENTS_DIR/qwen2-char-small" \
    agents.1.model_path="$AGENTS_DIR/llama-pair-medium" \
    trainer.resume_mode=disable \
    hydra.run.dir="$HACPO_OUTPUT_DIR/hydra" \
    "$@"
