#!/usr/bin/env bash
# Trains every head / feature family for SmolLM2-135M-Instruct on the same data budget, with hf_specdec's own CLI:
#   data      the committed self-distillation data set data/smollm2-distill (scripts/build_smollm2_distill.py:
#             Magpie prompts written by SmolLM2 and templated ones, disjoint from the benchmarks; SmolLM2's greedy
#             answers, at most 256 tokens; see its README.md); DATA=... takes another JSONL file or shard folder;
#   features  dumped once for every family and for the EAGLE-3 scaling curve, by scripts/train_smollm2_scaling.py
#             (--dump-only when missing): the bf16 target over the training records and, apart, over the fixed
#             held-out set every family is scored on (another DATA: its own fp32 dump in $RUN/features); the layers EAGLE-3 reads, [2, 15, 27], plus the final state
#             every other family reads, which the dump always stores; EXAMPLES=N trains on the first N records;
#   training  `hf-specdec train --features ...` per family, same steps, batch, learning rate and 4096-token draft
#             vocabulary (EAGLE-3 included, so it meets the others on an equal budget); MIXED=bf16 trains under
#             bf16 autocast; Medusa-2 trains a LoRA adapter
#             on the target with its heads, which changes the target's features, so it reads the same answers with
#             online features (`--data`: the dumps' training records, the same EXAMPLES, scored on the same held-out
#             records, written by train_smollm2_scaling.py --write-split); resumable (rerun the script: finished
#             families are skipped, a killed one resumes); SpecBlock three times: with and without its layer-wise shift (the ablation), and with the
#             reference's all-slot draft cache (context_slots=all, `specblock-allslots`; not in the default list).
# Outputs: runs/smollm2-families/<family>/ (drafter folders with training_record.json).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/smollm2-families}
DATA=${DATA:-data/smollm2-distill}
STEPS=${STEPS:--1}  # -1: EPOCHS epochs over the data
EPOCHS=${EPOCHS:-1}
MIXED=${MIXED:-no}  # bf16: bf16 autocast (CPUs with bf16; the target's soft labels are most of a step's work)
FAMILIES=${FAMILIES:-medusa hydra blockwise eagle1 eagle3 medusa2 mtp dflash dspark specblock specblock-noshift}
if [ ! -e "$DATA" ]; then  # write the data first
    case "$DATA" in
        data/smollm2-distill) python scripts/build_smollm2_distill.py ;;
        runs/smollm2-assistant/*) python scripts/train_smollm2_assistant.py --out runs/smollm2-assistant ;;  # the old 480
        *) echo "no training data at $DATA" >&2; exit 1 ;;
    esac
fi
if [ "$DATA" = data/smollm2-distill ]; then  # the dumps of the EAGLE-3 scaling curve, bf16 target
    FEATURES=${FEATURES:-runs/smollm2-scaling/features-train}
    EVAL_FEATURES=${EVAL_FEATURES:-runs/smollm2-scaling/features-eval}
    DTYPE=${DTYPE:-bfloat16}  # the target's dtype the features were dumped in (its soft labels)
    test -f "$FEATURES/index.json" || python scripts/train_smollm2_scaling.py --target-dtype "$DTYPE" --dump-only
else  # another data file (the old 480 answers): its own dump, fp32 target, a held-out share of it
    FEATURES=${FEATURES:-$RUN/features}
    EVAL_FEATURES=${EVAL_FEATURES:-}
    DTYPE=${DTYPE:-float32}
    test -f "$FEATURES/index.json" || hf-specdec dump-features --target smollm2 --dtype "$DTYPE" --data "$DATA" \
        --output-dir "$FEATURES" --layer-ids 2 15 27 --max-length 512 --batch-size 8
fi
online_source() {  # Medusa-2's records: on the committed data, the training and held-out records of the dumps
    if [ "$DATA" != data/smollm2-distill ]; then echo --data "$DATA"; return; fi
    test -f "$RUN/split/held-out.jsonl" || python scripts/train_smollm2_scaling.py --write-split "$RUN/split" >&2
    echo --data "$RUN/split/train.jsonl" --eval-data "$RUN/split/held-out.jsonl"
}
budget=()
if [ -n "${EXAMPLES:-}" ]; then budget=(--max-train-examples "$EXAMPLES"); fi
for family in $FAMILIES; do
    out="$RUN/$family"
    if [ -f "$out/training_record.json" ]; then echo "$family: done"; continue; fi
    resume=()
    if ls -d "$out"/checkpoint-* >/dev/null 2>&1; then resume=(--resume); fi
    source=(--features "$FEATURES" ${EVAL_FEATURES:+--eval-features "$EVAL_FEATURES"} "${budget[@]}")
    if [ "$family" = medusa2 ]; then source=($(online_source) --max-length 512 "${budget[@]}"); fi
    extra=()  # MTP: two chained modules, the second reused for longer drafts and trained for it (4 unrolled steps)
    if [ "$family" = mtp ]; then extra=(--config num_mtp_modules=2 --ttt-steps 4); fi
    # DFlash: blocks of 8 (7 drafts per pass) on the dumped layers (its own default would be [2, 15, 28])
    if [ "$family" = dflash ]; then extra=(--layer-ids 2 15 27 --config block_size=8); fi
    if [ "$family" = dspark ]; then extra=(--layer-ids 2 15 27 --config block_size=7); fi  # 7 drafts, as DFlash's 8
    drafter=$family  # SpecBlock without the layer-wise shift: the ablation, same budget
    if [ "$family" = specblock-noshift ]; then drafter=specblock; extra=(--config layer_shift=false); fi
    if [ "$family" = specblock-allslots ]; then drafter=specblock; extra=(--config context_slots=all); fi
    hf-specdec train --target smollm2 --dtype "$DTYPE" --drafter "$drafter" "${source[@]}" --output-dir "$out" \
        --draft-vocab-size 4096 --max-steps "$STEPS" --epochs "$EPOCHS" --batch-size 8 --lr 1e-3 --mixed-precision "$MIXED" --save-steps 100 --eval-steps 100 \
        --logging-steps 20 --report-to none "${extra[@]}" "${resume[@]}"
done
