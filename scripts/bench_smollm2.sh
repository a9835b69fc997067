#!/usr/bin/env bash
# The SmolLM2-135M-Instruct benchmark behind README.md's results table and model_cards/smollm2-eagle3.md.
#
# Spec-Bench, all six categories, 3 prompts each, on a 2-core CPU. Four `hf-specdec bench` runs in two lanes, one
# torch thread each (each run compares against plain `generate` measured in the same run, interleaved):
#   lane 1: smollm2-bench      fp32, greedy, batch 1, 128 new tokens: plain, EAGLE-3 chain, EAGLE-2 tree,
#                              transformers' assisted generation (the shipped smollm2-assistant) and prompt lookup
#           smollm2-bench-b4   fp32, greedy, batch 4 (4 prompts per category: one full batch each), 128 new tokens
#   lane 2: smollm2-bench-t07  fp32, sampling at T = 0.7, batch 1, 128 new tokens: EAGLE-3 chain, adaptive and fixed K
#           smollm2-bench-copies fp32, greedy, batch 1, 2 prompts per category: the EAGLE-3 chain without and with the
#                              n-gram copies (--copy-threshold 0 0.7), adaptive and fixed K, in one run
#           smollm2-bench-bf16 the target in bf16 (the dtype users run), greedy and T = 0.7, batch 1, 128 new tokens:
#                              bf16 plain and the EAGLE-3 chain, 1 prompt per category (at batch 1 on this CPU a bf16
#                              step is about 3x slower than an fp32 one: with 3 prompts and the peers the lane took over
#                              2 hours); greedy outputs that differ from bf16 plain are classified as near-ties or real
#                              differences
# Every run repeats 3 times (the bench default) and reports each speedup's median, 95 % interval and verdict.
# `bench` packs the fp32 target's linear weights for oneDNN (the default, --linear-kernels packed; the reports'
# config says so). The runs with MKL-packed weights before it are kept as smollm2-bench*-mkl, earlier runs under
# other stems (smollm2-bench*-grown30, *-stock; README's figures table).
# About 30-70 minutes on a 2-core VM (30 on the last, faster VM; lane 1 37-56 minutes, lane 2 25-38 at the runs before the copies row). Outputs: model_cards/results/smollm2-bench*.{json,md,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-model_cards/results}
COMMON=(--target smollm2 --prompts spec-bench --max-prompts 3 --max-new-tokens 128 --threads 1 --out "$OUT")

lane1() {
    hf-specdec bench "${COMMON[@]}" --tree chain eagle2 --tree-depth 6 --tree-top-k 4 --tree-total-tokens 16 \
        --stem smollm2-bench
    hf-specdec bench "${COMMON[@]}" --max-prompts 4 --batch-size 4 --no-peers --stem smollm2-bench-b4
}
lane2() {
    hf-specdec bench "${COMMON[@]}" --temperature 0.7 --no-peers --draft-length adaptive fixed --stem smollm2-bench-t07
    hf-specdec bench "${COMMON[@]}" --max-prompts 2 --no-peers --draft-length adaptive fixed --copy-threshold 0 0.7 \
        --stem smollm2-bench-copies
    hf-specdec bench "${COMMON[@]}" --max-prompts 1 --dtype bfloat16 --temperature 0 0.7 --no-peers \
        --stem smollm2-bench-bf16
}
lane1 &
lane2 &
wait
