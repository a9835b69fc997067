#!/usr/bin/env bash
# The SmolLM2-135M-Instruct benchmark behind README.md's results table and model_cards/smollm2-eagle3.md.
#
# Spec-Bench, all six categories, 5 prompts each, fp32, on a 2-core CPU. Four `hf-specdec bench` runs, two at a time
# with one torch thread each (each run compares against plain `generate` measured in the same run, interleaved):
#   smollm2-bench      greedy, batch 1, 128 new tokens: plain, EAGLE-3 chain, EAGLE-2 tree, transformers' assisted
#                      generation (the shipped smollm2-assistant) and prompt lookup
#   smollm2-bench-t07  sampling at T = 0.7, batch 1, 128 new tokens: plain, EAGLE-3 chain (adaptive and fixed K)
#   smollm2-bench-b4   greedy, batch 4, 128 new tokens: plain, EAGLE-3 chain
#   smollm2-bench-b8   greedy, batch 8, 384 new tokens (3 prompts per category): plain, EAGLE-3 chain
#   smollm2-bench-bf16 the target in bf16 (the dtype users run), greedy and T = 0.7, batch 1, 128 new tokens: bf16
#                      plain, EAGLE-3 chain, transformers' assisted generation and prompt lookup; greedy outputs that
#                      differ from bf16 plain are classified as near-ties or real differences
# Every run repeats 3 times (the bench default) and reports each speedup's median, 95 % interval and verdict.
# Outputs: model_cards/results/smollm2-bench*.{json,md,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-model_cards/results}
COMMON=(--target smollm2 --prompts spec-bench --threads 1 --out "$OUT")

hf-specdec bench "${COMMON[@]}" --max-prompts 5 --max-new-tokens 128 --tree chain eagle2 --tree-depth 6 \
    --tree-top-k 4 --tree-total-tokens 16 --stem smollm2-bench &
hf-specdec bench "${COMMON[@]}" --max-prompts 5 --max-new-tokens 128 --temperature 0.7 --no-peers \
    --draft-length adaptive fixed --stem smollm2-bench-t07 &
wait
hf-specdec bench "${COMMON[@]}" --max-prompts 5 --max-new-tokens 128 --batch-size 4 --no-peers \
    --stem smollm2-bench-b4 &
hf-specdec bench "${COMMON[@]}" --max-prompts 3 --max-new-tokens 384 --batch-size 8 --no-peers --stem smollm2-bench-b8 &
wait
hf-specdec bench "${COMMON[@]}" --dtype bfloat16 --max-prompts 5 --max-new-tokens 128 --temperature 0 0.7 \
    --stem smollm2-bench-bf16
