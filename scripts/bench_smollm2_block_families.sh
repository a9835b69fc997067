#!/usr/bin/env bash
# The block and multi-token families on SmolLM2-135M-Instruct, trained by scripts/train_smollm2_families.sh on the
# same data budget as its EAGLE-3 (480 self-distilled answers, 300 steps, one feature dump):
#   1. `hf-specdec profile`: the target's pass times on this machine (batch 1, 4, 16; 1..8 tokens per row), stored in
#      the DSpark drafter for its scheduler;
#   2. `hf-specdec calibrate`: DSpark's confidence head, sequential temperature scaling on the held-out split of the
#      dump, calibration error before and after;
#   3. one `hf-specdec bench` of EAGLE-3, MTP, DFlash and DSpark, chain and EAGLE-2 tree (depth 4, top-k 4, 16 nodes),
#      greedy, batch 1, Spec-Bench 3 prompts per category, 128 new tokens, fp32, 2 threads;
#   4. DSpark's scheduler against fixed draft lengths 2, 4 and 7, greedy, batch 1 (same prompts), then batch 4 and 16
#      on 16 mt_bench prompts (batches are formed within a category);
#   5. the draft cost c of DFlash against EAGLE-3 at the same fixed length (7 drafts per pass, no copies, batch 1,
#      one prompt per category);
# Outputs in model_cards/results/: smollm2-profile.json, smollm2-dspark-calibration.json,
# smollm2-block-families.{json,md,png}, smollm2-dspark-schedule.{json,md,png}, smollm2-dspark-schedule-batched.{json,md,png},
# smollm2-draft-cost.{json,md,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/smollm2-families}
OUT=${OUT:-model_cards/results}
hf-specdec profile --target smollm2 --drafter "$RUN/dspark" --batch-sizes 1 4 16 --widths 1 2 3 4 5 6 7 8 \
    --context 256 --threads 2 --out "$OUT/smollm2-profile.json"
hf-specdec calibrate --target smollm2 --drafter "$RUN/dspark" --features "$RUN/features" \
    --out "$OUT/smollm2-dspark-calibration.json"
hf-specdec bench --target smollm2 --prompts spec-bench --max-prompts 3 --max-new-tokens 128 --threads 2 --no-peers \
    --drafter "$RUN/eagle3" "$RUN/mtp" "$RUN/dflash" "$RUN/dspark" \
    --tree chain eagle2 --tree-depth 4 --tree-top-k 4 --tree-total-tokens 16 \
    --out "$OUT" --stem smollm2-block-families
hf-specdec bench --target smollm2 --prompts spec-bench --max-prompts 3 --max-new-tokens 128 --threads 2 --no-peers \
    --drafter "$RUN/dspark" --num-draft-tokens 2 4 7 --draft-length fixed --lookup-tokens 0 \
    --draft-option confidence_schedule=true --batch-size 1 \
    --out "$OUT" --stem smollm2-dspark-schedule
hf-specdec bench --target smollm2 --prompts spec-bench --categories mt_bench --max-prompts 16 --max-new-tokens 128 \
    --threads 2 --no-peers --drafter "$RUN/dspark" --num-draft-tokens 2 4 7 --draft-length fixed --lookup-tokens 0 \
    --draft-option confidence_schedule=true --batch-size 4 16 --out "$OUT" --stem smollm2-dspark-schedule-batched
hf-specdec bench --target smollm2 --prompts spec-bench --max-prompts 1 --max-new-tokens 128 --threads 2 --no-peers \
    --drafter "$RUN/eagle3" "$RUN/dflash" --num-draft-tokens 7 --draft-length fixed --lookup-tokens 0 \
    --out "$OUT" --stem smollm2-draft-cost
