#!/usr/bin/env bash
# Every head / feature family on SmolLM2-135M-Instruct in one `hf-specdec bench` run, each trained by
# scripts/train_smollm2_families.sh on the same data budget (480 self-distilled answers, 300 steps, one feature dump):
# EAGLE-3, Medusa-1, Medusa-2, Hydra, Blockwise and EAGLE-1 (FAMILIES; Medusa-2 runs on its adapted target
# and is checked against that target's own greedy decoding), each as a chain (adaptive length up to its default K)
# and as an EAGLE-2 tree (depth 4, top-k 4, 16 nodes), greedy, batch 1 and 4, Spec-Bench 2 prompts per category,
# 128 new tokens, fp32, 2 threads.
# Outputs: model_cards/results/smollm2-head-families.{json,md,png} (the closing run of the head and tree families).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/smollm2-families}
FAMILIES=${FAMILIES:-eagle3 medusa medusa2 hydra blockwise eagle1}
drafters=()
for family in $FAMILIES; do drafters+=("$RUN/$family"); done
hf-specdec bench --target smollm2 --prompts spec-bench --max-prompts 2 --max-new-tokens 128 --threads 2 --no-peers \
    --drafter "${drafters[@]}" \
    --tree chain eagle2 --tree-depth 4 --tree-top-k 4 --tree-total-tokens 16 --batch-size 1 4 \
    --out "${OUT:-model_cards/results}" --stem smollm2-head-families
