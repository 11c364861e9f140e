#!/usr/bin/env bash
# The job-start targets, in parts that fit one device call each, every part's files in one
# tarball (the device returns 8 files). PARTS (space-separated), run in order:
#   dflash    bench/dflash_h200.sh e: record, build, cold x1; kernelpack, kernelpack --foreground, native warm x3
#   qwen3     bench/family_h200.sh, Qwen3 mixed layers at 2048,4096: kernelpack x3, cold x1, native warm x3
#   gemma3    the same for Gemma3 (one kv head, head_dim 256)
#   mistral31 the same for Mistral with bench/varlen_train.py's buckets of 512 (31 configs, 62 signatures)
#   probe     what triton_key() costs in a fresh process (the first precompiled load pays it)
#   small     a 5-config artifact for later (Mistral's buckets of 2048 over 8192..16384, fwd and fwd+bwd), no arms
#   later     bench/later_first_call.py on the artifacts the parts before it built (a later first call through
#             kernelpack against torch's own load and call of the same function), RUNS runs of CALLS (8) calls each;
#             LATER_ARGS more arguments (--profile); OMP1=1 the same again with OMP_NUM_THREADS=1 (torchrun's workers)
#   switch    a 1-config artifact (Mistral at 8192, fwd and fwd+bwd), then bench/tf_train_step.py on it, RUNS (3)
#             rounds of KERNELPACK_START_SWITCH_INTERVAL=0 (Python's 5 ms) and 0.0005 (the default) alternated: the
#             start's timeline and its clock with and without the lowered thread switch interval
#   tests     the GPU tests TESTS selects (a pytest -k expression; all of tests/test_gpu.py without it)
#   bash bench/start_h200.sh                      # PARTS="dflash qwen3"
# Each part's summary lines are printed; $OUT/start.tgz holds every part's files.
set -uo pipefail
W=/tmp/start-out; rm -rf $W; mkdir -p $W
for part in ${PARTS:-dflash qwen3}; do
  mkdir -p $W/$part; s=$(date +%s)
  # PART_TIMEOUT (s) bounds each part: the device's call has 600 s in all
  case $part in
    dflash) OUT=$W/$part RUNS=${RUNS:-3} timeout ${PART_TIMEOUT:-590} bash bench/dflash_h200.sh e > $W/$part/run.log 2>&1 ;;
    qwen3|gemma3) OUT=$W/$part FAMILY=$part LENGTHS=2048,4096 RUNS=${RUNS:-3} COLD_RUNS=1 MEGA=0 \
      timeout ${PART_TIMEOUT:-590} bash bench/family_h200.sh > $W/$part/run.log 2>&1 ;;
    mistral31) OUT=$W/$part FAMILY=mistral BUCKETS=512 LENGTHS=2048,4096 RUNS=${RUNS:-3} COLD_RUNS=1 MEGA=0 \
      timeout ${PART_TIMEOUT:-590} bash bench/family_h200.sh > $W/$part/run.log 2>&1 ;;
    small) (source bench/device_env.sh; rm -rf /tmp/fam; mkdir -p /tmp/fam
      python3 bench/varlen_train.py --write-recipe /tmp/fam/r.toml --multiple 2048 --min 8192 --max 16384 \
        --graphs fwd,fwd+bwd && timeout ${PART_TIMEOUT:-590} python3 -m kernelpack.cli build /tmp/fam/r.toml \
        -o /tmp/fam/out --jobs 5) > $W/$part/run.log 2>&1; tail -2 $W/$part/run.log ;;
    later) (source bench/device_env.sh > /dev/null; for a in /tmp/fam/out/*.kpack /tmp/df/out/*.kpack; do
      [[ -f $a ]] || continue; echo "artifact $a"
      for omp in "" ${OMP1:+1}; do
        [[ -n $omp ]] && echo "OMP_NUM_THREADS=$omp"
        env ${omp:+OMP_NUM_THREADS=$omp} timeout ${PART_TIMEOUT:-290} python3 bench/later_first_call.py "$a" --runs ${RUNS:-3} \
          --calls ${CALLS:-8} ${LATER_ARGS:-}
      done; done) > $W/$part/run.log 2>&1 ;;
    switch) (source bench/device_env.sh > /dev/null; rm -rf /tmp/sw; mkdir -p /tmp/sw
      python3 bench/varlen_train.py --write-recipe /tmp/sw/r.toml --multiple 2048 --min 8192 --max 8192 \
        --graphs fwd,fwd+bwd && python3 -m kernelpack.cli build /tmp/sw/r.toml -o /tmp/sw/out --jobs 2 || exit 1
      art=$(ls /tmp/sw/out/*.kpack)
      for run in $(seq 1 ${RUNS:-3}); do for iv in 0 0.0005; do
        KERNELPACK_START_SWITCH_INTERVAL=$iv python3 bench/tf_train_step.py --family mistral --lengths 8192 \
          --artifact "$art" --cache /tmp/sw/cache-$iv-$run 2> $W/$part/replay-$iv-$run.log | tail -1 \
          | sed "s/^/{\"interval\": \"$iv\", \"line\": /; s/\$/}/"
      done; done) > $W/$part/run.log 2>&1
      python3 bench/switch_summary.py $W/$part/run.log ;;
    tests) (source bench/device_env.sh > /dev/null
      timeout ${PART_TIMEOUT:-400} python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider ${TESTS:+-k "$TESTS"}) \
      > $W/$part/run.log 2>&1; tail -4 $W/$part/run.log ;;
    probe) (source bench/device_env.sh > /dev/null; for i in 1 2 3; do python3 -c '
import time; t = time.perf_counter(); import triton; i = time.perf_counter() - t
try:
    from triton.compiler.compiler import triton_key
except ImportError:
    from triton.runtime.cache import triton_key
t = time.perf_counter(); triton_key(); k = time.perf_counter() - t
t = time.perf_counter(); triton_key(); again = time.perf_counter() - t
print({"import_triton_s": round(i, 3), "triton_key_s": round(k, 3), "again_s": round(again, 6)})'; done) > $W/$part/run.log 2>&1 ;;
  esac
  echo "== $part: exit $? in $(( $(date +%s) - s )) s"
  grep -h '"runs"\|minus\|^artifact\|^OMP\|"arm": "[a-z]*", "profile_shares"' $W/$part/run.log 2>/dev/null; [[ $part == probe ]] && cat $W/$part/run.log
  [[ $part == dflash ]] && tail -n 3 $W/$part/run.log
  tar czf "${OUT:-out}/start.tgz" -C $W .  # after every part: a later part's timeout keeps the earlier ones
done
ls -la "${OUT:-out}/start.tgz"
