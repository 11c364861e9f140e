#!/usr/bin/env bash
# A transformers family through record -> build -> replay (bench/tf_train_step.py, a training
# step with reentrant checkpointing at each length), the replay in fresh processes after activate().
#   FAMILY=gemma3 LENGTHS=2048,4096 bash bench/family_h200.sh
# REPLAY_FLAGS (e.g. --import-after: the model classes imported after activate()) go to the replays only.
# BUCKETS=512 FAMILY=mistral: the recipe is bench/varlen_train.py's buckets of 512 over 1024..16384 (31 configs, fwd
# and fwd+bwd: 62 signatures), not a recording. RUNS (3) fresh processes per arm,
# COLD_RUNS (RUNS) cold ones; MEGA=0 skips the mega-cache arm; ALL_ARM=1 adds a KERNELPACK_INSTALL=all arm; FLOOR=1
# an sdpa arm (the job with nothing to compile or load).
set -uo pipefail
source bench/device_env.sh
FAMILY=${FAMILY:-gemma3} LENGTHS=${LENGTHS:-2048,4096}
D=/tmp/fam; rm -rf $D; mkdir -p $D
JOB="python3 bench/tf_train_step.py --family $FAMILY --lengths $LENGTHS"
s=$(date +%s)
if [[ -n ${BUCKETS:-} ]]; then  # the start targets' (b): not recorded, the bucketed recipe of bench/varlen_train.py (Mistral)
  python3 bench/varlen_train.py --write-recipe $D/r.toml --multiple $BUCKETS --graphs fwd,fwd+bwd > "$OUT/record.log" 2>&1
  echo "recipe (buckets of $BUCKETS) exit $?"
else
  python3 -m kernelpack.cli record -o $D/r.toml -- $JOB > "$OUT/record.log" 2>&1; echo "record exit $? in $(( $(date +%s) - s )) s"
fi
grep -E "layout|kv_heads|seq_len|mask =" $D/r.toml | sort | uniq -c | tee "$OUT/recipe-lines.txt"
cp $D/r.toml "$OUT/$FAMILY.toml"
s=$(date +%s)
python3 -m kernelpack.cli build $D/r.toml -o $D/out --jobs 8 > "$OUT/build.log" 2>&1; echo "build exit $? in $(( $(date +%s) - s )) s"
tail -2 "$OUT/build.log"
art=$(ls $D/out/*.kpack | head -1)
for run in 1 2 3; do
  $JOB ${REPLAY_FLAGS:-} --artifact "$art" --cache $D/cache-$run 2> "$OUT/replay-$run.log" | tail -1 | tee -a "$OUT/replay.txt"
done
# ALL_ARM=1: kernelpack again with KERNELPACK_INSTALL=all (the start installs every part of the artifact in the
# background, not only the signatures the job calls)
if [[ -n ${ALL_ARM:-} ]]; then
  for run in 1 2 3; do
    KERNELPACK_INSTALL=all $JOB ${REPLAY_FLAGS:-} --artifact "$art" --cache $D/cache-all-$run 2> "$OUT/replay-all-$run.log" \
      | tail -1 | sed 's/^/{"arm": "kernelpack-install-all", "line": /; s/$/}/' | tee -a "$OUT/arms.jsonl"
  done
fi
# FLOOR=1: the same job with transformers' sdpa attention (nothing to compile or load): its own floor, RUNS runs
if [[ -n ${FLOOR:-} ]]; then
  for run in $(seq 1 ${RUNS:-3}); do
    $JOB --attn sdpa 2> "$OUT/sdpa-$run.log" | tail -1 | sed 's/^/{"arm": "sdpa", "line": /; s/$/}/' | tee -a "$OUT/arms.jsonl"
  done
fi
# native: transformers' own flex_attention, cold (an empty inductor cache dir each run), warm (the first cold run's
# dir again), mega-cache (torch.compiler's cache artifacts saved by a warm run, loaded into an empty dir)
N=${RUNS:-3}
for run in $(seq 1 ${COLD_RUNS:-$N}); do
  TORCHINDUCTOR_CACHE_DIR=$D/native-$run $JOB --attn flex_attention 2> "$OUT/native-cold-$run.log" | tail -1 \
    | sed "s/^/{\"arm\": \"cold\", \"line\": /; s/\$/}/" | tee -a "$OUT/arms.jsonl"
done
[[ ${MEGA:-1} == 1 ]] && TORCHINDUCTOR_CACHE_DIR=$D/native-1 $JOB --attn flex_attention --mega-save $D/mega.bin \
  > /dev/null 2> "$OUT/mega-save.log"
for run in $(seq 1 $N); do
  TORCHINDUCTOR_CACHE_DIR=$D/native-1 $JOB --attn flex_attention 2> "$OUT/native-warm-$run.log" | tail -1 \
    | sed "s/^/{\"arm\": \"warm\", \"line\": /; s/\$/}/" | tee -a "$OUT/arms.jsonl"
  [[ ${MEGA:-1} == 1 ]] && TORCHINDUCTOR_CACHE_DIR=$D/mega-$run $JOB --attn flex_attention --mega-load $D/mega.bin \
    2> "$OUT/mega-$run.log" | tail -1 | sed "s/^/{\"arm\": \"mega-cache\", \"line\": /; s/\$/}/" | tee -a "$OUT/arms.jsonl"
done
sed 's/^/{"arm": "kernelpack", "line": /; s/$/}/' "$OUT/replay.txt" >> "$OUT/arms.jsonl"
# one line per arm: medians over the fresh processes of activate() (or the mega-cache load) + the first step at
# each length, and what the steps compiled
python3 - "$OUT/arms.jsonl" <<'PY'
import json, statistics, sys
arms = {}
for line in open(sys.argv[1]):
    try:
        row = json.loads(line)
    except ValueError:
        continue
    arms.setdefault(row["arm"], []).append(row["line"])
for arm, runs in arms.items():
    total = statistics.median(r["activate_s"] + sum(r["step_s"]) for r in runs)
    print(json.dumps({"arm": arm, "runs": len(runs), "median_activate_plus_steps_s": round(total, 2),
                      "median_activate_s": round(statistics.median(r["activate_s"] for r in runs), 2),
                      # the start's clock: the activate() line to the end of the first step, model built inside
                      "median_start_to_first_step_s": round(statistics.median(r["start_to_first_step_s"] for r in runs), 2),
                      "later_first_calls_max_s": max((max(r.get("later_first_calls_s") or [0]) for r in runs), default=0),
                      "install_phases": [r.get("install_phases") for r in runs][:1],
                      "install_files_bytes": [(r.get("install_files"), r.get("install_bytes")) for r in runs][:1],
                      "warmup_s": [r.get("warmup_s") for r in runs],
                      "median_steps_s": [round(statistics.median(r["step_s"][i] for r in runs), 2)
                                         for i in range(len(runs[0]["step_s"]))],
                      "compiles_in_steps": [r["compiles_in_steps"] for r in runs],
                      "misses_in_steps": [r["misses_in_steps"] for r in runs],
                      "refused": [r.get("report") and "refused" in (r["report"] or "") for r in runs]}))
PY
