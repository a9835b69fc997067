#!/usr/bin/env bash
# SpecBlock's two draft caches on SmolLM2-135M-Instruct, both trained by scripts/train_smollm2_families.sh on the same
# budget (`specblock`: one entry per verified position, the default; `specblock-allslots`: all K slots of every
# verified position's block, the reference's cache, `FAMILIES=specblock-allslots bash scripts/train_smollm2_families.sh`):
# the drafters alone (a fixed 4 drafts per pass, no prompt lookup), Spec-Bench 3 prompts per category, 128 new tokens,
# greedy, batch 1, fp32, 2 threads (run it alone). Then the all-slot drafter is exported to the reference layout.
# Outputs: model_cards/results/smollm2-specblock-cache.{json,md,png}; runs/smollm2-families/specblock-reference/.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/smollm2-families}
OUT=${OUT:-model_cards/results}
hf-specdec bench --target smollm2 --prompts spec-bench --max-prompts 3 --max-new-tokens 128 --threads 2 --no-peers \
    --drafter "$RUN/specblock" "$RUN/specblock-allslots" --draft-length fixed --lookup-tokens 0 \
    --batch-size 1 --out "$OUT" --stem smollm2-specblock-cache
hf-specdec convert "$RUN/specblock-allslots" "$RUN/specblock-reference" --to specblock-reference
