#!/usr/bin/env bash
# SpecBlock on SmolLM2-135M-Instruct, trained by scripts/train_smollm2_families.sh on the same budget as the other
# families (480 self-distilled chat answers, 300 steps, one feature dump), with and without its layer-wise shift:
#   1. Spec-Bench, 3 prompts per category, 128 new tokens, greedy, batch 1: each drafter as a chain (adaptive length
#      with prompt lookup, the default) and as its rank tree (2 block passes, branching at most 4 wide, 16 nodes);
#   2. serving-time adaptation on a domain the drafter was not trained on (code: the first 12 HumanEval prompts, 128
#      new tokens): the chain at a fixed 4 drafts per pass, no prompt lookup, without adaptation and with it at the
#      paper's learning rate (1e-5) and at 1e-3; each adapting row runs its own copy of the drafter, which keeps
#      adapting from prompt to prompt (as a server would).
# fp32, 2 threads; run it alone on the machine.
# Outputs: model_cards/results/smollm2-specblock.{json,md,png}, smollm2-specblock-adaptation.{json,md,png},
# smollm2-specblock-fixed.{json,md,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/smollm2-families}
OUT=${OUT:-model_cards/results}
hf-specdec bench --target smollm2 --prompts spec-bench --max-prompts 3 --max-new-tokens 128 --threads 2 --no-peers \
    --drafter "$RUN/specblock" "$RUN/specblock-noshift" \
    --tree chain rank:tree_depth=2,tree_top_k=4,tree_total_tokens=16 --batch-size 1 --out "$OUT" --stem smollm2-specblock
hf-specdec bench --target smollm2 --prompts humaneval --max-prompts 12 --max-new-tokens 128 --threads 2 --no-peers \
    --drafter "$RUN/specblock" --draft-length fixed --lookup-tokens 0 \
    --draft-option "online_adaptation=true;adaptation_lr=1e-5" --draft-option "online_adaptation=true;adaptation_lr=1e-3" \
    --batch-size 1 --out "$OUT" --stem smollm2-specblock-adaptation
# 3. the shift ablation with the drafters alone: both at a fixed 4 drafts per pass, no prompt lookup, same prompts as 1
hf-specdec bench --target smollm2 --prompts spec-bench --max-prompts 3 --max-new-tokens 128 --threads 2 --no-peers \
    --drafter "$RUN/specblock" "$RUN/specblock-noshift" --draft-length fixed --lookup-tokens 0 \
    --batch-size 1 --out "$OUT" --stem smollm2-specblock-fixed
