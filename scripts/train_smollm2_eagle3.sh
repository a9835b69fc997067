#!/usr/bin/env bash
# The shipped EAGLE-3 drafter for SmolLM2-135M-Instruct (src/hf_specdec/assets/smollm2-drafter), rebuilt from the
# committed self-distillation data (data/smollm2-distill) in eight resumable stages, about 9 h 40 min on 2 CPU cores:
#   1. the 1.5M-token point of the scaling curve: features from the bf16 target (dumped once, about 27 minutes;
#      skipped when runs/smollm2-scaling holds them) and one epoch, batch 4, lr 1e-3, bf16 autocast
#      (runs/smollm2-scaling/size-1500000; skipped when done);
#   2. two more epochs from that drafter on the same features, a fresh cosine schedule from lr 1e-3, scored on the
#      same held-out records (runs/smollm2-eagle3-ep3). Rerun the script after an interruption: stage 2 resumes from
#      its last checkpoint;
#   3. one epoch from that drafter on the training records of shards 15-29 (1.53M answer tokens it has not seen), a
#      fresh cosine schedule from lr 2e-3, scored before and after on the held-out records of all 30 shards
#      (scripts/train_smollm2_grown.py: features dumped once, about 45 minutes; training about 48 minutes;
#      runs/smollm2-grown30/drafter, its scores in runs/smollm2-grown30/results.json), shipped before;
#   4. one more epoch from it on the training records of shards 15-33 (1.95M answer tokens: 15-29 for the second
#      time), a fresh cosine schedule from lr 2e-3, scored on the held-out records of all 34 shards (features
#      about 30 minutes, training about 66 minutes; runs/smollm2-grown34/drafter), shipped before, kept
#      as model_cards/candidates/smollm2-eagle3-grown34;
#   5. three quarters of an epoch more on the training records of shards 15-37 (2.37M answer tokens), a fresh cosine
#      from lr 1e-3, scored on the held-out records of all 38 shards (features of shards 34-37 about 5 minutes when
#      runs/smollm2-grown34's dumps are copied in, training about 42 minutes; runs/smollm2-grown38/drafter), shipped
#      before, kept as model_cards/candidates/smollm2-eagle3-grown38;
#   6. and 7. one epoch more each on the same records, a fresh cosine from lr 1e-3 (the stage-5 dumps hard-linked in,
#      training about 55 minutes each; runs/smollm2-grown38b/drafter, then runs/smollm2-grown38c/drafter), kept as
#      model_cards/candidates/smollm2-eagle3-grown38b and -grown38c (shipped before);
#   8. one epoch on the training records of shards 15-40 (2.68M answer tokens: shards 38-40 new), a fresh cosine from
#      lr 1e-3, scored on the held-out records of all 41 shards (the stage-5 dumps hard-linked in, features of shards
#      38-40 about 8 minutes, training about 66 minutes; runs/smollm2-grown41/drafter), kept as
#      model_cards/candidates/smollm2-eagle3-grown41; the shipped drafter.
# Ship a rebuilt drafter (then rerun scripts/bench_smollm2.sh, the demo and the card, README's figures table):
#   cp runs/smollm2-grown41/drafter/{config.json,model.safetensors,training_record.json} src/hf_specdec/assets/smollm2-drafter/
set -euo pipefail
cd "$(dirname "$0")/.."
SCALING=runs/smollm2-scaling
OUT=${OUT:-runs/smollm2-eagle3-ep3}

# stage 1 (its results file goes to runs/, leaving the committed three-size curve as it is)
python scripts/train_smollm2_scaling.py --sizes 1500000 --batch-size 4 --mixed-precision bf16 --threads 2 \
    --results "$SCALING/stage1"

# stage 2: skipped once it wrote its training record; resumed when it has a checkpoint
if [ ! -f "$OUT/training_record.json" ]; then
    RESUME=()
    if [ -f "$OUT/latest_checkpoint" ]; then RESUME=(--resume); fi
    hf-specdec train --target smollm2 --dtype bfloat16 --drafter "$SCALING/size-1500000" \
        --features "$SCALING/features-train" --eval-features "$SCALING/features-eval" --output-dir "$OUT" \
        --epochs 2 --batch-size 4 --mixed-precision bf16 --lr 1e-3 --save-steps 200 --eval-steps 400 \
        --logging-steps 50 --report-to none "${RESUME[@]}"
fi

# stage 3 (resumable: the feature dumps keep what they hold, training resumes from its last checkpoint)
python scripts/train_smollm2_grown.py --shards 30 --from-shard 15 --lr 2e-3 --drafter "$OUT" \
    --out runs/smollm2-grown30 --results runs/smollm2-grown30/results

# stage 4 (resumable as stage 3)
python scripts/train_smollm2_grown.py --shards 34 --from-shard 15 --lr 2e-3 --drafter runs/smollm2-grown30/drafter \
    --out runs/smollm2-grown34 --results runs/smollm2-grown34/results

# stage 5 (resumable as stage 3; copy runs/smollm2-grown34/features-* into runs/smollm2-grown38/ first to dump only
# the new shards)
python scripts/train_smollm2_grown.py --shards 38 --from-shard 15 --lr 1e-3 --epochs 0.75 \
    --drafter runs/smollm2-grown34/drafter --out runs/smollm2-grown38 --results runs/smollm2-grown38/results

# stages 6 and 7: the same records again, reading the stage-5 dumps (hard links: no copy, no second dump)
# link_dumps SRC DST: hard-links SRC's feature dumps into DST (no copy; a resumed dump extends DST's own index)
link_dumps() {
    mkdir -p "$2"
    for dump in features-train features-eval; do
        [ -e "$2/$dump" ] || cp -al "$1/$dump" "$2/"
    done
}
for stage in 38b:38 38c:38b; do
    out=runs/smollm2-grown${stage%%:*} from=runs/smollm2-grown${stage##*:}
    link_dumps runs/smollm2-grown38 "$out"
    python scripts/train_smollm2_grown.py --shards 38 --from-shard 15 --lr 1e-3 --epochs 1.0 \
        --drafter "$from/drafter" --out "$out" --results "$out/results"
done

# stage 8: the records of shards 38-40 added; only their features are dumped (the stage-5 dumps hard-linked in first)
link_dumps runs/smollm2-grown38 runs/smollm2-grown41
python scripts/train_smollm2_grown.py --shards 41 --from-shard 15 --lr 1e-3 --epochs 1.0 \
    --drafter runs/smollm2-grown38c/drafter --out runs/smollm2-grown41 --results runs/smollm2-grown41/results
