#!/usr/bin/env bash
# Everything issue #2 measures on the H200, in one device call. Writes logs and JSON under $OUT (or ./out).
#   bash bench/h200.sh [tests|tests-bg|tests-collect|build|profile|bench|threads|torchrun|spread|multi|keep|bench-bg|collect|ckpt-bg|
#                       ckpt-collect|user-bg|user-collect|tf|tf-ckpt-bg|tf-ckpt-collect|record|all]
# RECIPE (default recipes/dflash-drafter.toml) is what build builds; user-bg needs recipes/dflash-drafter-bshd.toml.
# ART_DIR (default /tmp/kp-art) holds the artifact that build writes and the other modes use.
# Needs: torch with CUDA, and kernelpack's deps (the device image lacks zstandard: carried as a wheel in .whl/).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
# The device's torch venv ships no usable .pyc files: every fresh process re-compiled ~600 torch modules' bytecode
# (builtins.compile, 2.1 s of each first call in bench/profile_first_call.py). A normal install has them; a
# writable bytecode cache restores that for every mode alike (the first run of this script fills it).
export PYTHONPYCACHEPREFIX=/tmp/pycache
what=${1:-all}
python3 -c 'import torch, triton; print("torch", torch.__version__, torch.version.git_version, "triton", triton.__version__, torch.cuda.get_device_name(0))' | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv >> "$OUT/env.txt"
ART_DIR=${ART_DIR:-/tmp/kp-art}
# collect DIR MARKER LOG...: wait (up to COLLECT_POLLS x 5 s) for a detached run's DIR/MARKER, copy DIR to $OUT, show
# the end of its logs
collect() {
  local dir=$1 marker=$2; shift 2
  if [[ ! -d $dir ]]; then echo "no background run in $dir on this machine (it went cold)"; exit 3; fi
  for _ in $(seq 1 ${COLLECT_POLLS:-110}); do [[ -f $dir/$marker ]] && break; sleep 5; done
  cp "$dir"/* "$OUT/" 2>/dev/null; for log in "$@"; do tail -40 "$OUT/$log"; done
}
# Which dynamic flex graphs a fresh process reuses, with and without duck sizing; static for the ratio.
if [[ $what == dyn-probe ]]; then
  P="python3 bench/dynamic_probe.py"
  rm -rf /tmp/dp-noduck /tmp/dp-duck /tmp/dp-static
  TORCHINDUCTOR_CACHE_DIR=/tmp/dp-noduck $P --lens 4100,8192 --no-duck | tee "$OUT/probe-noduck-A.jsonl"
  for L in 6144 1500 16000 12288 3001; do TORCHINDUCTOR_CACHE_DIR=/tmp/dp-noduck $P --lens $L --no-duck; done \
    | tee "$OUT/probe-noduck-B.jsonl"
  TORCHINDUCTOR_CACHE_DIR=/tmp/dp-duck $P --lens 4096,8192 | tee "$OUT/probe-duck-A.jsonl"
  TORCHINDUCTOR_CACHE_DIR=/tmp/dp-duck $P --lens 6144 | tee "$OUT/probe-duck-B.jsonl"
  TORCHINDUCTOR_CACHE_DIR=/tmp/dp-static $P --static --lens 6144,12288 | tee "$OUT/probe-static.jsonl"
fi
# A 50-step training loop at random lengths in [1024, 16384] (bench/varlen_train.py): buckets of
# ${VL_MULTIPLE:-512} vs one dynamic graph vs cold; build time and size of each; the three-thread checkpointing proof at
# random lengths. Detached (over 10 minutes in all); varlen-collect waits for it and copies the results.
if [[ $what == varlen-bg ]]; then
  rm -rf /tmp/vl; mkdir -p /tmp/vl
  setsid nohup bash -c '
    set -x
    V="python3 bench/varlen_train.py"
    $V --write-recipe /tmp/vl/buckets.toml --multiple '"${VL_MULTIPLE:-512}"' --graphs fwd+bwd > /dev/null
    $V --write-recipe /tmp/vl/dynamic.toml --graphs fwd,fwd+bwd > /dev/null
    for k in buckets dynamic; do
      s=$(date +%s.%N); python3 -m kernelpack.cli build /tmp/vl/$k.toml -o /tmp/vl/$k --jobs 8 > /tmp/vl/build-$k.log 2>&1
      echo "build $k wall $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s" >> /tmp/vl/build-$k.log
      python3 -m kernelpack.cli inspect --json /tmp/vl/$k/*.kpack > /tmp/vl/manifest-$k.json
      python3 -m kernelpack.cli verify --json /tmp/vl/$k/*.kpack > /tmp/vl/verify-$k.json 2>&1; echo "verify $k exit $?" >> /tmp/vl/build-$k.log
    done
    for r in 1 2; do for k in buckets dynamic; do
      $V --artifact /tmp/vl/$k/*.kpack --steps 50 >> /tmp/vl/varlen.jsonl 2>> /tmp/vl/varlen.err
    done; done
    TORCHINDUCTOR_CACHE_DIR=/tmp/vl/cold-cache $V --mode cold --steps 50 --time-limit 100 >> /tmp/vl/varlen.jsonl 2>> /tmp/vl/varlen.err
    touch /tmp/vl/arms-done
    python3 bench/checkpoint_threads.py --artifact /tmp/vl/dynamic/*.kpack --block tf --threads 3 --timeout 200 \
      --modes reentrant,nonreentrant --runs 1 --random-steps 4 --out /tmp/vl/ckpt-dynamic.json > /tmp/vl/ckpt.log 2>&1
    python3 bench/checkpoint_threads.py --artifact /tmp/vl/buckets/*.kpack --block tf --threads 3 --timeout 200 \
      --modes nonreentrant --runs 1 --random-steps 4 --out /tmp/vl/ckpt-buckets.json >> /tmp/vl/ckpt.log 2>&1
    touch /tmp/vl/done' > /tmp/vl/driver.log 2>&1 < /dev/null &
  echo "varlen benchmark started in the background"
  for _ in $(seq 1 ${COLLECT_POLLS:-105}); do [[ -f /tmp/vl/arms-done ]] && break; sleep 5; done
  tail -4 /tmp/vl/build-*.log; tail -c 1500 /tmp/vl/varlen.jsonl
fi
if [[ $what == varlen-ckpt ]]; then  # the checkpointing proof alone: dynamic recipe built, 3 threads, random lengths
  rm -rf /tmp/vlc; mkdir -p /tmp/vlc
  python3 bench/varlen_train.py --write-recipe /tmp/vlc/dynamic.toml --graphs fwd,fwd+bwd > /dev/null
  python3 -m kernelpack.cli build /tmp/vlc/dynamic.toml -o /tmp/vlc --jobs 2 2>&1 | tail -1
  python3 bench/checkpoint_threads.py --artifact /tmp/vlc/*.kpack --block tf --threads 3 --timeout 100 \
    --modes ${CKPT_MODES:-reentrant,nonreentrant} --runs 1 --random-steps 4 --out "$OUT/ckpt-dynamic.json" 2>&1 | tail -4
fi
# The varying-lengths H200 proof's rest, detached (over 10 minutes): the cold arm alone on an idle GPU (stopped by
# `timeout`; varlen_train.py still prints what it ran), the three-thread checkpointing proof with a bucketed artifact
# (lengths 1024..4096, buckets of 512), then the GPU test suite. varlen-finish-collect tars the results.
if [[ $what == varlen-finish-bg ]]; then
  rm -rf /tmp/vf; mkdir -p /tmp/vf
  setsid nohup bash -c '
    set -x
    V="python3 bench/varlen_train.py"
    TORCHINDUCTOR_CACHE_DIR=/tmp/vf/cold-cache timeout -k 20 '"${COLD_TIMEOUT:-300}"' $V --mode cold --steps 50 \
      --time-limit '"${COLD_LIMIT:-200}"' > /tmp/vf/cold.jsonl 2> /tmp/vf/cold.err; echo "cold exit $?" >> /tmp/vf/cold.err
    $V --write-recipe /tmp/vf/buckets.toml --min 1024 --max 4096 --multiple 512 --graphs fwd,fwd+bwd > /dev/null
    python3 -m kernelpack.cli build /tmp/vf/buckets.toml -o /tmp/vf/buckets --jobs 8 > /tmp/vf/build-buckets.log 2>&1
    python3 bench/checkpoint_threads.py --artifact /tmp/vf/buckets/*.kpack --block tf --threads 3 --timeout 200 \
      --modes reentrant,nonreentrant --runs 1 --random-steps 4 --out /tmp/vf/ckpt-buckets.json > /tmp/vf/ckpt.log 2>&1
    touch /tmp/vf/proof-done
    python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider > /tmp/vf/pytest-gpu.log 2>&1
    touch /tmp/vf/done' > /tmp/vf/driver.log 2>&1 < /dev/null &
  echo "varlen-finish started in the background"
  for _ in $(seq 1 ${COLLECT_POLLS:-105}); do [[ -f /tmp/vf/proof-done ]] && break; sleep 5; done
  tail -3 /tmp/vf/cold.err /tmp/vf/build-buckets.log /tmp/vf/ckpt.log; tail -c 1500 /tmp/vf/cold.jsonl
fi
if [[ $what == varlen-finish-collect ]]; then
  [[ -d /tmp/vf ]] || { echo "no background run in /tmp/vf on this machine (it went cold)"; exit 3; }
  for _ in $(seq 1 ${COLLECT_POLLS:-110}); do [[ -f /tmp/vf/done ]] && break; sleep 5; done
  tar czf "$OUT/varlen-finish.tgz" -C /tmp/vf --exclude='*.kpack' --exclude=cold-cache .
  tail -5 /tmp/vf/pytest-gpu.log /tmp/vf/driver.log
fi
if [[ $what == varlen-collect ]]; then  # every small file of the run, in one tarball (8 files come back at most)
  [[ -d /tmp/vl ]] || { echo "no background run in /tmp/vl on this machine (it went cold)"; exit 3; }
  for _ in $(seq 1 ${COLLECT_POLLS:-110}); do [[ -f /tmp/vl/done ]] && break; sleep 5; done
  tar czf "$OUT/varlen.tgz" -C /tmp/vl --exclude='*.kpack' --exclude=cold-cache .
  tail -5 /tmp/vl/ckpt.log /tmp/vl/driver.log; tail -c 600 /tmp/vl/varlen.err
fi
# Build time with both tiers (median of 3 builds of RECIPE, --jobs 6), then time-to-first-step side by side:
# cold, native warm, mega-cache, tier 1 (install only), activate() with tier 1 only, activate() with tier 2.
# Detached (over 10 minutes); tiers-collect waits for it.
if [[ $what == tiers-bg ]]; then
  rm -rf /tmp/t18; mkdir -p /tmp/t18
  setsid nohup bash -c '
    for i in 1 2 3; do
      s=$(date +%s.%N); python3 -m kernelpack.cli build '"${RECIPE:-recipes/dflash-drafter.toml}"' -o /tmp/t18/b$i --jobs 6 \
        > /tmp/t18/build-$i.log 2>&1
      echo "build $i wall $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s" | tee -a /tmp/t18/builds.txt
    done
    python3 -m kernelpack.cli inspect --json /tmp/t18/b1/*.kpack > /tmp/t18/manifest.json
    python3 -m kernelpack.cli verify --json /tmp/t18/b1/*.kpack > /tmp/t18/verify.json 2>&1; echo "verify exit $?" >> /tmp/t18/builds.txt
    python3 bench/warm_start.py --artifact /tmp/t18/b1/*.kpack --repeats 3 --cold-repeats 3 --tiers \
      --out /tmp/t18/tiers.json > /tmp/t18/tiers.log 2>&1
    touch /tmp/t18/done' > /tmp/t18/driver.log 2>&1 < /dev/null &
  echo "tiers benchmark started in the background"
fi
if [[ $what == tiers-collect ]]; then
  [[ -d /tmp/t18 ]] || { echo "no background run in /tmp/t18 on this machine (it went cold)"; exit 3; }
  for _ in $(seq 1 ${COLLECT_POLLS:-110}); do [[ -f /tmp/t18/done ]] && break; sleep 5; done
  tar czf "$OUT/tiers.tgz" -C /tmp/t18 --exclude='*.kpack' .
  cat /tmp/t18/builds.txt; tail -20 /tmp/t18/tiers.log
fi
# The tiers' proof in the foreground, most important first (a call cut short by its limit keeps what it wrote under $OUT):
# build 1 (timed), verify, warm_start --tiers (cold once, the rest TIERS_REPEATS times), then builds 2 and 3 (timed).
if [[ $what == tiers-fg ]]; then
  rm -rf /tmp/t18; mkdir -p /tmp/t18
  build() {
    local s; s=$(date +%s.%N)
    python3 -m kernelpack.cli build recipes/dflash-drafter.toml -o /tmp/t18/b$1 --jobs 6 >> "$OUT/build.log" 2>&1
    echo "build $1 wall $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s" | tee -a "$OUT/builds.txt"
  }
  build 1
  python3 -m kernelpack.cli inspect --json /tmp/t18/b1/*.kpack > "$OUT/manifest.json"
  python3 -m kernelpack.cli verify --json /tmp/t18/b1/*.kpack > "$OUT/verify.json" 2>&1; echo "verify exit $?" | tee -a "$OUT/builds.txt"
  python3 bench/warm_start.py --artifact /tmp/t18/b1/*.kpack --repeats ${TIERS_REPEATS:-3} --cold-repeats 1 --tiers \
    --out "$OUT/tiers.json" 2>&1 | tee "$OUT/tiers.log"
  build 2; build 3
fi
# The tiers' whole H200 proof in one detached run (about 25 minutes; i18-collect waits for it, tars the results):
# 3 timed builds with --jobs 6 (pinned to 16 cores, the one-GPU H200's count, where taskset exists), the tiers
# benchmark (skipped with SKIP_TIERS=1), the GPU tests new since the last device run (NEW_TESTS), the transformers model
# side by side (cold once, then warm, mega, kernelpack = tier 2, tier1, background = tier 2 loading while the model is
# built; TF_REPEATS fresh processes each), then the rest of the GPU suite with per-test durations (PYTEST_RESTARGS, e.g.
# "-n 2" with pytest-xdist). Markers: tiers-done, new-tests-done, tf-done, done. i18-bg waits for tiers-done.
if [[ $what == i18-bg ]]; then
  rm -rf /tmp/t18 /tmp/kp-tf; mkdir -p /tmp/t18 /tmp/kp-tf
  TS=""; command -v taskset > /dev/null && [[ $(nproc) -gt 16 ]] && TS="taskset -c 0-15"
  NEW=${NEW_TESTS:-"precompiled_functions or tier_2 or multi_device or not_visible"}
  setsid nohup bash -c '
    set -x
    for i in 1 2 3; do
      s=$(date +%s.%N); '"$TS"' python3 -m kernelpack.cli build recipes/dflash-drafter.toml -o /tmp/t18/b$i --jobs 6 \
        > /tmp/t18/build-$i.log 2>&1
      echo "build $i wall $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s ('"${TS:-all cores}"')" >> /tmp/t18/builds.txt
    done
    python3 -m kernelpack.cli inspect --json /tmp/t18/b1/*.kpack > /tmp/t18/manifest.json
    if [[ '"${SKIP_TIERS:-0}"' != 1 ]]; then
      python3 -m kernelpack.cli verify --json /tmp/t18/b1/*.kpack > /tmp/t18/verify.json 2>&1; echo "verify exit $?" >> /tmp/t18/builds.txt
      python3 bench/warm_start.py --artifact /tmp/t18/b1/*.kpack --repeats 3 --cold-repeats 3 --tiers \
        --out /tmp/t18/tiers.json > /tmp/t18/tiers.log 2>&1
    fi
    touch /tmp/t18/tiers-done
    python3 -m pytest -v -m gpu tests/test_gpu.py -p no:cacheprovider --durations=0 -k "'"$NEW"'" \
      > /tmp/t18/pytest-new.log 2>&1
    touch /tmp/t18/new-tests-done
    python3 bench/transformers_step.py --write-recipe /tmp/kp-tf/mistral.toml --lengths 4096,8192 > /tmp/t18/tf-recipe.toml
    python3 -m kernelpack.cli build /tmp/kp-tf/mistral.toml -o /tmp/kp-tf --jobs 4 > /tmp/t18/build-tf.log 2>&1
    timeout 600 python3 bench/transformers_step.py --artifact /tmp/kp-tf/*.kpack --repeats '"${TF_REPEATS:-3}"' \
      --cold-repeats 1 --out /tmp/t18/transformers_step.json > /tmp/t18/transformers_step.log 2>&1
    touch /tmp/t18/tf-done
    python3 -m pytest -v -m gpu tests/test_gpu.py -p no:cacheprovider --durations=0 -k "not ('"$NEW"')" \
      '"${PYTEST_RESTARGS:-}"' > /tmp/t18/pytest-gpu.log 2>&1
    touch /tmp/t18/done' > /tmp/t18/driver.log 2>&1 < /dev/null &
  echo "tiers run started in the background"
  for _ in $(seq 1 ${COLLECT_POLLS:-110}); do [[ -f /tmp/t18/tiers-done ]] && break; sleep 5; done
  cat /tmp/t18/builds.txt; tail -25 /tmp/t18/tiers.log 2>/dev/null
fi
# i18-collect: waits (COLLECT_POLLS x 5 s) for the marker I18_WAIT (default done), tars what there is so far
if [[ $what == i18-collect ]]; then
  [[ -d /tmp/t18 ]] || { echo "no background run in /tmp/t18 on this machine (it went cold)"; exit 3; }
  for _ in $(seq 1 ${COLLECT_POLLS:-110}); do [[ -f /tmp/t18/${I18_WAIT:-done} ]] && break; sleep 5; done
  tar czf "$OUT/i18.tgz" -C /tmp/t18 --exclude='*.kpack' --exclude='b[123]' .
  cat /tmp/t18/builds.txt; tail -25 /tmp/t18/tiers.log; tail -15 /tmp/t18/transformers_step.log
  grep -hE "PASSED|FAILED|ERROR|passed|failed" /tmp/t18/pytest-new.log /tmp/t18/pytest-gpu.log | tail -24
fi
# Every run on 2+ GPUs in one detached run (about 20 minutes on 2 H200s; i20-collect waits for a marker and
# tars the results). KP_COMMIT names the commit in the JSON (the device's .git need not be it).
# (1) bench/torchrun_first_step.py on the single-GPU dflash artifact, 3 rounds of cold, warm, pinned (tier 2), one
# of unpinned-strict; (2) bench/torchrun_train.py, the transformers model under torchrun: 3 rounds of pinned, one of
# cold, warm, unpinned-strict; (3) the same model at a random length per rank and step, on a bucketed and on a
# dynamic artifact; (4) a drafter job's layout: one process, a thread per GPU, on a --devices artifact: threads_first_step
# (raw vs kernelpack) and checkpoint_threads --spread (reentrant and non-reentrant checkpointing); then the multi-GPU
# tests. Markers: dflash-done, tf-done, varlen-done, spread-done, done.
if [[ $what == i20-bg ]]; then
  NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  rm -rf /tmp/t20; mkdir -p /tmp/t20/a /tmp/t20/tf /tmp/t20/vb /tmp/t20/vd /tmp/t20/spread
  setsid nohup bash -c '
    set -x
    N='"$NGPU"'
    echo "${KP_COMMIT:-unknown}" > /tmp/t20/commit.txt
    python3 -m kernelpack.cli build recipes/dflash-drafter.toml -o /tmp/t20/a --jobs 6 > /tmp/t20/build-dflash.log 2>&1
    python3 bench/torchrun_first_step.py --artifact /tmp/t20/a/*.kpack --nproc $N --repeats 3 \
      --modes cold,warm,pinned,unpinned-strict --repeats-for unpinned-strict=1 \
      --timeout 300 --out /tmp/t20/torchrun_first_step.json > /tmp/t20/torchrun_first_step.log 2>&1
    touch /tmp/t20/dflash-done
    python3 bench/transformers_step.py --write-recipe /tmp/t20/tf/mistral.toml --lengths 4096,8192 > /dev/null
    python3 -m kernelpack.cli build /tmp/t20/tf/mistral.toml -o /tmp/t20/tf --jobs 4 > /tmp/t20/build-tf.log 2>&1
    python3 bench/torchrun_train.py --artifact /tmp/t20/tf/*.kpack --nproc $N --repeats 3 \
      --modes cold,warm,pinned,unpinned-strict --repeats-for cold=1,warm=1,unpinned-strict=1 \
      --timeout 300 --out /tmp/t20/torchrun_train.json > /tmp/t20/torchrun_train.log 2>&1
    touch /tmp/t20/tf-done
    V="python3 bench/varlen_train.py"
    $V --write-recipe /tmp/t20/vb/buckets.toml --min 1024 --max 4096 --multiple 512 > /dev/null
    python3 -m kernelpack.cli build /tmp/t20/vb/buckets.toml -o /tmp/t20/vb --jobs 8 > /tmp/t20/build-buckets.log 2>&1
    python3 bench/torchrun_train.py --artifact /tmp/t20/vb/*.kpack --nproc $N --modes pinned --steps 8 \
      --random 1024:4096 --timeout 300 --out /tmp/t20/torchrun_varlen_buckets.json > /tmp/t20/torchrun_varlen_buckets.log 2>&1
    $V --write-recipe /tmp/t20/vd/dynamic.toml --min 1024 --max 4096 > /dev/null
    python3 -m kernelpack.cli build /tmp/t20/vd/dynamic.toml -o /tmp/t20/vd --jobs 2 > /tmp/t20/build-dynamic.log 2>&1
    python3 bench/torchrun_train.py --artifact /tmp/t20/vd/*.kpack --nproc $N --modes pinned --steps 8 \
      --random 1024:4096 --timeout 300 --out /tmp/t20/torchrun_varlen_dynamic.json > /tmp/t20/torchrun_varlen_dynamic.log 2>&1
    touch /tmp/t20/varlen-done
    D=$(python3 -c "print(\",\".join(map(str, range($N))))")
    python3 -m kernelpack.cli build recipes/dflash-drafter.toml -o /tmp/t20/spread --jobs 6 --devices $D \
      > /tmp/t20/build-spread.log 2>&1
    python3 -m kernelpack.cli verify --json /tmp/t20/spread/*.kpack > /tmp/t20/verify-spread.json 2> /tmp/t20/verify-spread.err
    python3 bench/threads_first_step.py --artifact /tmp/t20/spread/*.kpack --threads $N --spread --timeout 240 \
      --modes raw,kernelpack --out /tmp/t20/threads_spread.json > /tmp/t20/threads_spread.log 2>&1
    python3 bench/checkpoint_threads.py --artifact /tmp/t20/spread/*.kpack --threads $N --spread --timeout 200 \
      --modes reentrant,nonreentrant --runs 2 --out /tmp/t20/checkpoint_spread.json > /tmp/t20/checkpoint_spread.log 2>&1
    touch /tmp/t20/spread-done
    python3 -m pytest -v -m gpu tests/test_gpu.py -p no:cacheprovider --durations=0 -k "tier_2 or multi_device or torchrun" \
      > /tmp/t20/pytest-multi.log 2>&1
    touch /tmp/t20/done' > /tmp/t20/driver.log 2>&1 < /dev/null &
  echo "multi-GPU run started in the background on $NGPU GPUs"
fi
# The rest of the multi-GPU runs after the i20-bg run at 7de78cf (which ran out of device time after item 4's bucketed run), most
# needed first: (4b) a drafter job's layout, checkpoint_threads --spread on a --devices artifact; (5) the multi-GPU tests;
# (4) the dynamic artifact under torchrun at random lengths; then threads_first_step --spread (raw vs kernelpack).
# About 13 minutes on 2 H200s by that run's timings, then 4 more for a probe of the torchrun tier-2 time (below).
# The GPU tests are bounded at 900 s: collect with I20_WAIT=ckpt-done, then tests-done, then the rest.
# Markers: ckpt-done, tests-done, varlen-done, done, probe-done; the driver's
# process group id is in driver.pid (i20-stop kills it: a pkill -f pattern would also match the calling shell's own
# command line).
if [[ $what == i20-rest-bg ]]; then
  if [[ -f /tmp/t20/driver.pid ]] && kill -0 -- -"$(cat /tmp/t20/driver.pid)" 2>/dev/null; then
    echo "a multi-GPU run is still going (process group $(cat /tmp/t20/driver.pid)): i20-stop first"; exit 3
  fi
  NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  rm -rf /tmp/t20; mkdir -p /tmp/t20/spread /tmp/t20/vd
  setsid nohup bash -c '
    set -x
    N='"$NGPU"'
    echo "${KP_COMMIT:-unknown}" > /tmp/t20/commit.txt
    D=$(python3 -c "print(\",\".join(map(str, range($N))))")
    python3 -m kernelpack.cli build recipes/dflash-drafter.toml -o /tmp/t20/spread --jobs 6 --devices $D \
      > /tmp/t20/build-spread.log 2>&1
    python3 bench/checkpoint_threads.py --artifact /tmp/t20/spread/*.kpack --threads $N --spread --timeout 120 \
      --modes reentrant,nonreentrant --runs 2 --out /tmp/t20/checkpoint_spread.json > /tmp/t20/checkpoint_spread.log 2>&1
    touch /tmp/t20/ckpt-done
    # bounded: the torchrun test allows its jobs 2400 s; timeout signals its whole process group (torchrun included)
    timeout -k 30 900 python3 -m pytest -v -m gpu tests/test_gpu.py -p no:cacheprovider --durations=0 \
      -k "tier_2 or multi_device or torchrun" > /tmp/t20/pytest-multi.log 2>&1
    touch /tmp/t20/tests-done
    V="python3 bench/varlen_train.py"
    $V --write-recipe /tmp/t20/vd/dynamic.toml --min 1024 --max 4096 > /dev/null
    python3 -m kernelpack.cli build /tmp/t20/vd/dynamic.toml -o /tmp/t20/vd --jobs 2 > /tmp/t20/build-dynamic.log 2>&1
    python3 bench/torchrun_train.py --artifact /tmp/t20/vd/*.kpack --nproc $N --modes pinned --steps 8 \
      --random 1024:4096 --timeout 300 --out /tmp/t20/torchrun_varlen_dynamic.json > /tmp/t20/torchrun_varlen_dynamic.log 2>&1
    touch /tmp/t20/varlen-done
    python3 -m kernelpack.cli verify --json /tmp/t20/spread/*.kpack > /tmp/t20/verify-spread.json 2> /tmp/t20/verify-spread.err
    python3 bench/threads_first_step.py --artifact /tmp/t20/spread/*.kpack --threads $N --spread --timeout 240 \
      --modes raw,kernelpack --out /tmp/t20/threads_spread.json > /tmp/t20/threads_spread.log 2>&1
    touch /tmp/t20/done
    # Why tier 2 under torchrun took 5.4-6.0 s at 7de78cf (0.93-0.98x native warm) against 4.1 s at f4dc3f8 on the
    # same kind of host: pinned as it ran then (the control, in this same session), with 16 CPU threads per rank
    # (torchrun keeps an OMP_NUM_THREADS it is given), and with one rank (at 1 thread: torchrun sets it only for 2+)
    mkdir -p /tmp/t20/a
    python3 -m kernelpack.cli build recipes/dflash-drafter.toml -o /tmp/t20/a --jobs 6 > /tmp/t20/build-dflash.log 2>&1
    P="python3 bench/torchrun_first_step.py --artifact $(ls /tmp/t20/a/*.kpack) --repeats 2 --modes pinned --timeout 300"
    $P --nproc $N --out /tmp/t20/torchrun_control.json > /tmp/t20/torchrun_control.log 2>&1
    OMP_NUM_THREADS=16 $P --nproc $N --out /tmp/t20/torchrun_omp16.json > /tmp/t20/torchrun_omp16.log 2>&1
    OMP_NUM_THREADS=1 $P --nproc 1 --out /tmp/t20/torchrun_1rank.json > /tmp/t20/torchrun_1rank.log 2>&1
    touch /tmp/t20/probe-done' > /tmp/t20/driver.log 2>&1 < /dev/null &
  echo $! > /tmp/t20/driver.pid
  echo "multi-GPU (rest) started in the background on $NGPU GPUs"
fi
# Where activate()'s seconds go in one process over every GPU (a --devices artifact): fresh processes,
# without and with Dynamo's imports and the CUDA contexts paid before it (bench/activate_phases.py)
if [[ $what == activate-phases ]]; then
  NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  D=$(python3 -c "print(','.join(map(str, range($NGPU))))")
  rm -rf /tmp/ap; mkdir -p /tmp/ap
  python3 -m kernelpack.cli build recipes/dflash-drafter.toml -o /tmp/ap --jobs 6 --devices $D > "$OUT/build-ap.log" 2>&1
  tail -1 "$OUT/build-ap.log"
  for p in "" --prepared "" --prepared; do
    python3 bench/activate_phases.py --artifact /tmp/ap/*.kpack --runs 1 $p --out "$OUT/activate_phases.jsonl"
  done
fi
if [[ $what == i20-stop ]]; then
  [[ -f /tmp/t20/driver.pid ]] || { echo "no multi-GPU run on this machine"; exit 3; }
  kill -TERM -- -"$(cat /tmp/t20/driver.pid)" 2>/dev/null
  # the GPU tests' timeout runs in a process group of its own: it passes the TERM on to pytest and torchrun
  pkill -TERM -f '^timeout -k 30 900 python3 -m pytest'
  sleep 3; kill -KILL -- -"$(cat /tmp/t20/driver.pid)" 2>/dev/null
  # torchrun starts its workers in sessions of their own: they stop through torchrun's SIGTERM handler, not this kill
  echo "stopped the multi-GPU run; processes left on the GPUs:"
  nvidia-smi --query-compute-apps=pid,name --format=csv
fi
if [[ $what == i20-collect ]]; then
  [[ -d /tmp/t20 ]] || { echo "no background run in /tmp/t20 on this machine (it went cold)"; exit 3; }
  for _ in $(seq 1 ${COLLECT_POLLS:-110}); do [[ -f /tmp/t20/${I20_WAIT:-done} ]] && break; sleep 5; done
  tar czf "$OUT/i20.tgz" -C /tmp/t20 --exclude='*.kpack' --exclude=a --exclude=tf --exclude=vb --exclude=vd \
    --exclude=spread --exclude=driver.pid .
  ls /tmp/t20; tail -n 3 /tmp/t20/build-*.log
  for f in /tmp/t20/torchrun_*.log; do  # the table from its JSON; a job that wrote none shows its log
    if [[ -f ${f%.log}.json ]]; then python3 bench/torchrun_summary.py "${f%.log}.json"; else echo "== $f"; tail -12 "$f"; fi
  done
  for f in /tmp/t20/threads_spread.log /tmp/t20/checkpoint_spread.log; do
    [[ -f $f ]] && { echo "== $f"; tail -12 "$f"; }
  done
  grep -hE "PASSED|FAILED|ERROR|passed|failed" /tmp/t20/pytest-multi.log 2>/dev/null | tail -8
fi
# tests-bg: the GPU suite detached (it outlasts one device call); tests-collect waits for it and brings its log back
if [[ $what == tests-bg ]]; then
  rm -rf /tmp/gt; mkdir -p /tmp/gt
  setsid nohup bash -c 'python3 -m pytest -v -m gpu tests/test_gpu.py -p no:cacheprovider --durations=0 \
    > /tmp/gt/pytest-gpu.log 2>&1; touch /tmp/gt/done' > /dev/null 2>&1 < /dev/null &
  echo "GPU suite started in the background"
fi
if [[ $what == tests-collect ]]; then
  collect /tmp/gt done
  grep -hE "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/pytest-gpu.log" | tail -24
fi
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest-gpu.log"
fi
if [[ $what == build || $what == all ]]; then
  rm -rf $ART_DIR; mkdir -p $ART_DIR
  python3 -m kernelpack.cli build ${RECIPE:-recipes/dflash-drafter.toml} -o $ART_DIR --jobs 6 2>&1 | tee "$OUT/build.log"
  python3 -m kernelpack.cli inspect --json $ART_DIR/*.kpack > "$OUT/manifest.json"
  python3 -m kernelpack.cli verify --json $ART_DIR/*.kpack > "$OUT/verify.json"; echo "verify exit $?" | tee -a "$OUT/build.log"
fi
if [[ $what == profile || $what == all ]]; then
  rm -rf /tmp/kp-prof && mkdir -p /tmp/kp-prof
  TORCHINDUCTOR_CACHE_DIR=/tmp/kp-prof/kp python3 bench/profile_first_call.py $ART_DIR/*.kpack --install > "$OUT/profile-kernelpack.txt" 2>&1
  TORCHINDUCTOR_CACHE_DIR=/tmp/kp-prof/kp python3 bench/profile_first_call.py $ART_DIR/*.kpack > "$OUT/profile-warm.txt" 2>&1
  TORCHINDUCTOR_COMPILE_THREADS=1 TORCHINDUCTOR_CACHE_DIR=/tmp/kp-prof/kp python3 bench/profile_first_call.py $ART_DIR/*.kpack > "$OUT/profile-warm-1thread.txt" 2>&1
  grep -h "first calls\|^install" "$OUT"/profile-*.txt
fi
if [[ $what == bench || $what == all ]]; then
  python3 bench/warm_start.py --artifact $ART_DIR/*.kpack --repeats ${REPEATS:-5} --cold-repeats ${COLD_REPEATS:-2} --out "$OUT/warm_start.json" 2>&1 | tee "$OUT/warm_start.log"
  touch "$OUT/done"
fi
if [[ $what == threads ]]; then
  # A drafter job's 3 threads reaching their first flex call at once, cold torch.compile vs kernelpack.
  python3 bench/threads_first_step.py --artifact $ART_DIR/*.kpack --threads 3 --timeout ${THREADS_TIMEOUT:-240} \
    --steady ${STEADY:-20} --out "$OUT/threads_first_step.json" 2>&1 | tee "$OUT/threads_first_step.log"
fi
# Every GPU of the machine; on a one-GPU kind these are dry runs of the same scripts).
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [[ $what == torchrun || $what == multi ]]; then
  python3 bench/torchrun_first_step.py --artifact $ART_DIR/*.kpack --nproc "$NGPU" --timeout ${TORCHRUN_TIMEOUT:-300} \
    --out "$OUT/torchrun_first_step.json" 2>&1 | tee "$OUT/torchrun_first_step.log"
fi
if [[ $what == spread || $what == multi ]]; then
  # A drafter job's layout: one process, thread i on cuda:i, from an artifact built for every device index.
  rm -rf /tmp/kp-spread; mkdir -p /tmp/kp-spread
  DEVICES=$(python3 -c "print(','.join(map(str, range($NGPU))))")
  python3 -m kernelpack.cli build recipes/dflash-drafter.toml -o /tmp/kp-spread --jobs 6 --devices "$DEVICES" 2>&1 \
    | tail -3 | tee "$OUT/spread-build.log"
  python3 -m kernelpack.cli verify --json /tmp/kp-spread/*.kpack > "$OUT/spread-verify.json"; echo "verify exit $?" | tee -a "$OUT/spread-build.log"
  python3 bench/threads_first_step.py --artifact /tmp/kp-spread/*.kpack --threads "$NGPU" --spread \
    --timeout ${THREADS_TIMEOUT:-240} --modes ${SPREAD_MODES:-raw,kernelpack} --out "$OUT/threads_spread.json" 2>&1 | tee "$OUT/threads_spread.log"
fi
# Threads x gradient checkpointing after activate(), fresh processes bounded by 120 s each; detached.
if [[ $what == ckpt-bg ]]; then
  rm -rf /tmp/ckpt-out; mkdir -p /tmp/ckpt-out
  setsid nohup python3 bench/checkpoint_threads.py --artifact $ART_DIR/*.kpack --threads 3 --timeout 120 \
    --block ${CKPT_BLOCK:-canonical} \
    --modes ${CKPT_MODES:-reentrant,nonreentrant,none,none-nowarm,both} --runs ${CKPT_RUNS:-10} \
    --runs-for "${CKPT_RUNS_FOR:-none=3,none-nowarm=3,both=3}" --out /tmp/ckpt-out/checkpoint_threads.json \
    > /tmp/ckpt-out/checkpoint_threads.log 2>&1 < /dev/null &
  echo "checkpoint benchmark started in the background"
fi
if [[ $what == ckpt-collect ]]; then collect /tmp/ckpt-out checkpoint_threads.json checkpoint_threads.log; fi
# An HF-style block (bench/hf_block.py) served by a bshd artifact, then the checkpoint proof with that block;
# detached, one after the other (they share the GPU), collected by user-collect.
if [[ $what == user-bg ]]; then
  rm -rf /tmp/user-out; mkdir -p /tmp/user-out
  setsid nohup bash -c "python3 bench/user_block.py --artifact $ART_DIR/*.kpack --repeats ${USER_REPEATS:-3} \
      --out /tmp/user-out/user_block.json > /tmp/user-out/user_block.log 2>&1; \
    python3 bench/checkpoint_threads.py --artifact $ART_DIR/*.kpack --threads 3 --timeout 120 --block hf \
      --modes ${CKPT_MODES:-reentrant,nonreentrant} --runs ${CKPT_RUNS:-5} \
      --out /tmp/user-out/checkpoint_threads_hf.json > /tmp/user-out/checkpoint_threads_hf.log 2>&1; \
    touch /tmp/user-out/done" > /dev/null 2>&1 < /dev/null &
  echo "user-block benchmarks started in the background"
fi
if [[ $what == user-collect ]]; then collect /tmp/user-out done user_block.log checkpoint_threads_hf.log; fi
# A transformers causal LM through attn_implementation="kernelpack" (bench/transformers_step.py), and the
# bounded BlockMask builder (bench/mask_builder.py); tf-ckpt-bg: the three-thread checkpointing proof with that model
# (bench/checkpoint_threads.py --block tf), detached, collected by tf-ckpt-collect. TF_REPEATS=3 takes over 9 minutes:
# more than one device call allows in the foreground.
if [[ $what == tf || $what == tf-ckpt-bg ]]; then
  rm -rf /tmp/kp-tf; mkdir -p /tmp/kp-tf
  python3 bench/transformers_step.py --write-recipe /tmp/kp-tf/mistral.toml --lengths ${TF_LENGTHS:-4096,8192} \
    > "$OUT/transformers-recipe.toml"
  python3 -m kernelpack.cli build /tmp/kp-tf/mistral.toml -o /tmp/kp-tf --jobs 4 2>&1 | tee "$OUT/build-transformers.log"
fi
if [[ $what == tf-ckpt-bg ]]; then
  rm -rf /tmp/tfck-out; mkdir -p /tmp/tfck-out
  setsid nohup bash -c "python3 bench/checkpoint_threads.py --artifact /tmp/kp-tf/*.kpack --threads 3 --timeout 120 \
      --block tf --modes ${CKPT_MODES:-reentrant,nonreentrant,none} --runs ${CKPT_RUNS:-5} \
      --out /tmp/tfck-out/checkpoint_threads_tf.json > /tmp/tfck-out/checkpoint_threads_tf.log 2>&1; \
    touch /tmp/tfck-out/done" > /dev/null 2>&1 < /dev/null &
  echo "transformers checkpoint benchmark started in the background"
fi
if [[ $what == tf-ckpt-collect ]]; then collect /tmp/tfck-out done checkpoint_threads_tf.log; fi
if [[ $what == tf ]]; then
  timeout ${TF_TIMEOUT:-420} python3 bench/transformers_step.py --artifact /tmp/kp-tf/*.kpack \
    --repeats ${TF_REPEATS:-2} --out "$OUT/transformers_step.json" 2>&1 | tee "$OUT/transformers_step.log"
  python3 bench/mask_builder.py --device cuda --lengths 4096,16384 > "$OUT/mask_builder.jsonl" 2>&1
fi
# Record one training step of the transformers causal LM (bench/tf_train_step.py: reentrant checkpointing),
# build the recorded recipe, replay the step from the artifact.
if [[ $what == record ]]; then
  rm -rf /tmp/kp-rec; mkdir -p /tmp/kp-rec
  export PYTHONPATH=$PYTHONPATH:$PWD/bench
  L=${REC_LENGTHS:-4096,8192}
  t0=$(date +%s.%N)
  python3 -m kernelpack.cli record -o /tmp/kp-rec/recorded.toml -- python3 bench/tf_train_step.py --lengths $L 2>&1 \
    | tee "$OUT/record.log"
  echo "record wall $(python3 -c "print(round($(date +%s.%N) - $t0, 2))") s" | tee -a "$OUT/record.log"
  cp /tmp/kp-rec/recorded.toml "$OUT/recorded.toml"
  python3 -m kernelpack.cli build /tmp/kp-rec/recorded.toml -o /tmp/kp-rec --jobs 4 2>&1 | tee "$OUT/build-recorded.log"
  for i in 1 2; do
    python3 bench/tf_train_step.py --lengths $L --artifact /tmp/kp-rec/*.kpack --cache /tmp/kp-rec/cache$i \
      2>&1 | tail -1 | tee -a "$OUT/replay.jsonl"
  done
fi
if [[ $what == keep ]]; then cp $ART_DIR/*.kpack "$OUT/"; fi
# The device tool gives 10 minutes a call: start the benchmark detached, collect it with a second call.
if [[ $what == bench-bg ]]; then
  rm -rf /tmp/bench-out; mkdir -p /tmp/bench-out
  OUT=/tmp/bench-out setsid nohup bash bench/h200.sh bench > /tmp/bench-out/nohup.log 2>&1 < /dev/null &
  echo "benchmark started in the background"
fi
if [[ $what == collect ]]; then collect /tmp/bench-out done warm_start.log; fi
