#!/usr/bin/env bash
# Every trained family on SmolLM2-135M-Instruct in one `hf-specdec bench` run: the shipped EAGLE-3 drafter and the
# drafters of scripts/train_smollm2_families.sh (Medusa-1, Hydra, Blockwise, EAGLE-1; same data, 300 steps each),
# each as a chain (adaptive length up to its default K) and as an EAGLE-2 tree (depth 4, top-k 4, 16 nodes),
# greedy, batch 1, Spec-Bench 3 prompts per category, 128 new tokens, fp32, 2 threads.
# Outputs: model_cards/results/smollm2-families.{json,md,png}, then the batch-4 run below.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/smollm2-families}
hf-specdec bench --target smollm2 --prompts spec-bench --max-prompts 3 --max-new-tokens 128 --threads 2 --no-peers \
    --drafter src/hf_specdec/assets/smollm2-drafter "$RUN/medusa" "$RUN/hydra" "$RUN/blockwise" "$RUN/eagle1" \
    --tree chain eagle2 --tree-depth 4 --tree-top-k 4 --tree-total-tokens 16 \
    --out "${OUT:-model_cards/results}" --stem smollm2-families
# Batch 4, chains only (trees lost at batch 1): model_cards/results/smollm2-families-b4.{json,md,png}.
hf-specdec bench --target smollm2 --prompts spec-bench --max-prompts 3 --max-new-tokens 128 --threads 2 --no-peers \
    --drafter src/hf_specdec/assets/smollm2-drafter "$RUN/medusa" "$RUN/hydra" "$RUN/blockwise" "$RUN/eagle1" \
    --batch-size 4 --out "${OUT:-model_cards/results}" --stem smollm2-families-b4
