#!/usr/bin/env bash
# DSpark with ASD on SmolLM2-135M-Instruct (the DSpark paper's headline pairing): the ASD settings frozen by the EAGLE-3
# audit (scripts/asd_audit_smollm2.sh, $TUNE, default model_cards/results/smollm2-asd-tune.json: B = 0.5, g = 0.5,
# M = 2 since the audit of the drafter trained on all 30 shards; the committed DSpark files were made with
# TUNE=model_cards/results/smollm2-asd-tune-before-retraining.json, B = 1), measured on
# the held-out test half of the same arithmetic word problems (`--split test`, exact match, to natural EOS, cap 256
# tokens) with the DSpark drafter of scripts/train_smollm2_families.sh at a fixed 7 drafts per pass and no lookup:
# plain, strict verification and ASD in one run, greedy, batch 1, fp32, 2 threads (run it alone); then the same on
# the held-out HumanEval problems (pass@1, cap 512 tokens), as the EAGLE-3 audit did.
# Outputs: model_cards/results/smollm2-dspark-asd-{arithmetic,humaneval}.{json,md,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/smollm2-families}
OUT=${OUT:-model_cards/results}
TUNE=${TUNE:-$OUT/smollm2-asd-tune.json}
read -r B G M < <(python - "$TUNE" <<'PY'
import json, sys
rec = json.load(open(sys.argv[1]))["recommended"]
print(rec["asd_budget"], rec["asd_gate"], rec["asd_block_cap"])
PY
)
echo "frozen by the EAGLE-3 audit: B=$B g=$G M=$M"
AUDIT=(--target smollm2 --split test --drafter "$RUN/dspark" --verifier asd --asd-budget "$B" --asd-gate "$G"
       --asd-block-cap "$M" --draft-length fixed --lookup-tokens 0 --no-peers --threads 2 --out "$OUT")
hf-specdec bench "${AUDIT[@]}" --task arithmetic --max-prompts 60 --max-new-tokens 256 --stem smollm2-dspark-asd-arithmetic
hf-specdec bench "${AUDIT[@]}" --task humaneval --max-prompts 40 --max-new-tokens 512 --stem smollm2-dspark-asd-humaneval
