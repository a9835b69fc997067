#!/usr/bin/env bash
# Every family trained on the self-distillation data (data/smollm2-distill), compared on SmolLM2-135M-Instruct:
# the drafters of `EXAMPLES=2513 bash scripts/train_smollm2_families.sh` (the first 2,513 training records, about
# 500K answer tokens, one epoch, batch 8, lr 1e-3, 4096-token draft vocabulary, features of the bf16 target dumped
# once; EAGLE-3 too, the same-budget row; Medusa-2 online on the same records, with a LoRA adapter on the target,
# benchmarked on its adapted target against that target's own plain decoding) and the shipped EAGLE-3 drafter (the
# full 1.5M tokens, three epochs), in four `hf-specdec bench` runs:
#   1. what users get: adaptive length with prompt-lookup copies, greedy, batch 1, fp32, Spec-Bench 1 prompt per
#      category, 64 new tokens, 2 threads, 3 interleaved repeats (speedups with intervals and verdicts):
#      model_cards/results/smollm2-families-distill.{json,md,png};
#   2. what each drafter can do: the fixed default K, no copies, one repeat (τ, α and the draft cost c of each
#      family's own drafting): model_cards/results/smollm2-families-distill-fixed.{json,md,png};
#   3. sampling at T = 0.7, otherwise as 1: model_cards/results/smollm2-families-distill-t07.{json,md,png};
#   4. batch 4: the adaptive length as in 1, B4_PROMPTS (4) prompts per category, one full batch each, 3 repeats:
#      model_cards/results/smollm2-families-distill-b4.{json,md,png}.
# About 80 minutes on 2 cores for eleven drafters. Families without a finished training run are skipped.
# FAMILIES=... STEM=... measures some of them (next to the shipped EAGLE-3) into model_cards/results/$STEM*;
# MAX_PROMPTS=... NEW_TOKENS=... THREADS=... change the prompts per category (batch 1), new tokens and torch threads.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/smollm2-families}
OUT=${OUT:-model_cards/results}
STEM=${STEM:-smollm2-families-distill}
FAMILIES=${FAMILIES:-eagle3 medusa medusa2 hydra blockwise eagle1 mtp dflash dspark specblock}
drafters=(src/hf_specdec/assets/smollm2-drafter)
for family in $FAMILIES; do  # the families whose training finished
    if [ -f "$RUN/$family/training_record.json" ]; then drafters+=("$RUN/$family"); else echo "$family: not trained, skipped"; fi
done
common=(--target smollm2 --prompts spec-bench --max-new-tokens "${NEW_TOKENS:-64}" --threads "${THREADS:-2}" --no-peers
        --drafter "${drafters[@]}" --out "$OUT")
hf-specdec bench "${common[@]}" --max-prompts "${MAX_PROMPTS:-1}" --repeats 3 --stem "$STEM"
hf-specdec bench "${common[@]}" --max-prompts "${MAX_PROMPTS:-1}" --repeats 1 --warmup 0 --draft-length fixed \
    --lookup-tokens 0 --stem "$STEM-fixed"
hf-specdec bench "${common[@]}" --max-prompts "${MAX_PROMPTS:-1}" --temperature 0.7 --repeats 3 --stem "$STEM-t07"
hf-specdec bench "${common[@]}" --max-prompts "${B4_PROMPTS:-4}" --batch-size 4 --repeats 3 --stem "$STEM-b4"
# Then each family's training record next to the results, and its card from the four runs
# (model_cards/smollm2-<family>.md; the shipped EAGLE-3's card, model_cards/smollm2-eagle3.md, comes from
# smollm2-bench, and the same-budget EAGLE-3 has its record only).
for family in $FAMILIES; do
    if [ ! -f "$RUN/$family/training_record.json" ]; then continue; fi
    cp "$RUN/$family/training_record.json" "$OUT/smollm2-$family-distill-training_record.json"
    if [ "$family" = eagle3 ]; then continue; fi
    hf-specdec push "$RUN/$family" "hf-specdec/smollm2-$family" --bench "$OUT/$STEM.json" "$OUT/$STEM-fixed.json" \
        "$OUT/$STEM-t07.json" "$OUT/$STEM-b4.json" \
        --base-model HuggingFaceTB/SmolLM2-135M-Instruct --card-only "${CARDS:-model_cards}/smollm2-$family.md"
done
