#!/usr/bin/env bash
# Issue 35 on the H200: a transformers family through record -> build -> replay (bench/tf_train_step.py, a training
# step with reentrant checkpointing at each length), the replay in fresh processes after activate().
#   FAMILY=gemma3 LENGTHS=2048,4096 bash bench/family_h200.sh
# REPLAY_FLAGS (e.g. --import-after: the model classes imported after activate()) go to the replays only.
set -uo pipefail
source bench/device_env.sh
FAMILY=${FAMILY:-gemma3} LENGTHS=${LENGTHS:-2048,4096}
D=/tmp/fam; rm -rf $D; mkdir -p $D
JOB="python3 bench/tf_train_step.py --family $FAMILY --lengths $LENGTHS"
s=$(date +%s)
python3 -m kernelpack.cli record -o $D/r.toml -- $JOB > "$OUT/record.log" 2>&1; echo "record exit $? in $(( $(date +%s) - s )) s"
grep -E "layout|kv_heads|seq_len|mask =" $D/r.toml | sort | uniq -c | tee "$OUT/recipe-lines.txt"
cp $D/r.toml "$OUT/$FAMILY.toml"
s=$(date +%s)
python3 -m kernelpack.cli build $D/r.toml -o $D/out --jobs 8 > "$OUT/build.log" 2>&1; echo "build exit $? in $(( $(date +%s) - s )) s"
tail -2 "$OUT/build.log"
art=$(ls $D/out/*.kpack | head -1)
for run in 1 2 3; do
  $JOB ${REPLAY_FLAGS:-} --artifact "$art" --cache $D/cache-$run 2> "$OUT/replay-$run.log" | tail -1 | tee -a "$OUT/replay.txt"
done
# native: transformers' own flex_attention, cold (an empty inductor cache dir) then warm (the same dir) x2
for run in cold warm1 warm2; do
  TORCHINDUCTOR_CACHE_DIR=$D/native $JOB --attn flex_attention 2> "$OUT/native-$run.log" | tail -1 \
    | sed "s/^/{\"arm\": \"native-$run\", \"line\": /; s/\$/}/" | tee -a "$OUT/native.txt"
done
