#!/usr/bin/env bash
# The DFlash-shaped drafter job (tests/data/record_project/drafter_job.py) at real size, three
# drafter threads on one GPU, reentrant checkpointing, a random context length S in [1024, 4096] every step (not
# rounded), 20 steps. Writes JSON lines and logs under $OUT.
#   bash bench/dflash_h200.sh a   # record (no option), build --jobs 8, kernelpack x3, cold x1 (saves a mega-cache)
#   bash bench/dflash_h200.sh b   # cold x2 more, native warm x3 (the cold runs' cache dirs), mega-cache x3
#   bash bench/dflash_h200.sh e   # the background start as the default: record, build, cold x1, then
#                                 # kernelpack, kernelpack --foreground and native warm alternated, RUNS (3) each
#   bash bench/dflash_h200.sh f   # the DFlash job's four arms side by side, then the floor: record, build, cold x1 (saves a
#                                 # mega-cache), then alternated RUNS (3) of kernelpack, native warm, mega-cache and
#                                 # sdpa (the job with nothing compiled: its own floor), STEPS (40) steps each; then
#                                 # bench/start_floor.py (torch's import and load floors, each alone)
#   bash bench/dflash_h200.sh t   # the steady step by tier: kernelpack (tier 2), kernelpack tier 1, native warm
#   bash bench/dflash_h200.sh d   # record, build, kernelpack x3 with KERNELPACK_LOAD=lazy and x2 as
#                                 # the default (eager), cold x1, native warm x2 (its cache dir): one run
# Each arm runs in fresh processes; the clock starts where the job would call activate() (kernelpack) and stops
# when every thread's first step is done (drafter_job.py's first_step_seconds).
set -uo pipefail
EXTRA_PATH=tests/data/record_project source bench/device_env.sh
D=/tmp/df; mkdir -p $D
SIZE=4096,32,8,128,512,16,2048
JOB="python3 tests/data/record_project/drafter_job.py --device cuda --train --threads 3 --size $SIZE --context 1024:4096"
arm() {  # arm NAME RUN EXTRA...: one fresh process, its JSON line tagged
  local name=$1 run=$2; shift 2
  local line; line=$($JOB --steps ${STEPS:-20} --seed $run "$@" 2> "$OUT/$name-$run.log" | tail -1)
  echo "{\"arm\": \"$name\", \"run\": $run, \"result\": ${line:-null}}" | tee -a "$OUT/arms.jsonl"
}
record_build() {  # record the job (3 steps) and build its recipe into $D/out, from an empty $D
  rm -rf $D/*
  python3 -m kernelpack.cli record -o $D/drafter.toml -- $JOB --steps 3 --seed 100 > "$OUT/record.log" 2>&1
  echo "record exit $?" | tee -a "$OUT/record.log"
  local s; s=$(date +%s.%N)
  python3 -m kernelpack.cli build $D/drafter.toml -o $D/out --jobs 8 > "$OUT/build.log" 2>&1
  echo "build exit $? wall $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s" | tee -a "$OUT/build.log"
  tail -1 "$OUT/build.log"
}
if [[ ${1:-a} == a || ${1:-a} == c ]]; then
  rm -rf $D/*
  s=$(date +%s.%N)
  python3 -m kernelpack.cli record -o $D/drafter.toml -- $JOB --steps 3 --seed 100 > "$OUT/record.log" 2>&1
  echo "record exit $? wall $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s" | tee -a "$OUT/record.log"
  cp $D/drafter.toml "$OUT/"
  s=$(date +%s.%N)
  python3 -m kernelpack.cli build $D/drafter.toml -o $D/out --jobs 8 > "$OUT/build.log" 2>&1
  echo "build exit $? wall $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s" | tee -a "$OUT/build.log"
  tail -5 "$OUT/build.log"
  python3 -m kernelpack.cli inspect --json $D/out/*.kpack > "$OUT/manifest.json" 2>&1
  for r in 1 2 3; do arm kernelpack $r --artifact $D/out/*.kpack --cache $D/kp-cache-$r; [[ $1 == c ]] && break; done
  [[ $1 == a ]] && TORCHINDUCTOR_CACHE_DIR=$D/cold-1 arm cold 1 --flex torch --mega-save $D/mega.bin
fi
# c: one kernelpack run (activate's phases), then one flex call's speed per way of compiling (bench/dflash_kernels.py)
if [[ ${1:-a} == c || -n ${KERNEL_MODES:-} ]]; then
  for m in ${KERNEL_MODES:-marked automatic dynamic static}; do
    TORCHINDUCTOR_CACHE_DIR=$D/kernels-$m python3 bench/dflash_kernels.py $m 2> "$OUT/kernels-$m.log" | tee -a "$OUT/kernels.jsonl"
  done
fi
if [[ ${1:-a} == b ]]; then
  for r in 2 3; do TORCHINDUCTOR_CACHE_DIR=$D/cold-$r arm cold $r --flex torch --mega-save $D/mega-$r.bin; done
  [[ -f $D/mega.bin ]] || cp $D/mega-2.bin $D/mega.bin
  for r in 1 2 3; do c=$D/cold-$r; [[ -d $c ]] || c=$D/cold-2; TORCHINDUCTOR_CACHE_DIR=$c arm warm $r --flex torch; done
  for r in 1 2 3; do TORCHINDUCTOR_CACHE_DIR=$D/mega-cache-$r arm mega $r --flex torch --mega-load $D/mega.bin; done
fi
if [[ ${1:-a} == d ]]; then
  record_build
  for r in 1 2 3; do KERNELPACK_LOAD=lazy arm kernelpack-lazy $r --artifact $D/out/*.kpack --cache $D/kp-cache-$r; done
  for r in 1 2; do arm kernelpack $r --artifact $D/out/*.kpack --cache $D/kpe-cache-$r; done
  TORCHINDUCTOR_CACHE_DIR=$D/cold-1 arm cold 1 --flex torch
  for r in 1 2; do TORCHINDUCTOR_CACHE_DIR=$D/cold-1 arm warm $r --flex torch; done
fi
# floor: the job's start, phase by phase (bench/start_floor.py), on the artifact that record + build write; then
# the GPU tests that the lazy default re-expressed (TESTS, a pytest -k expression)
if [[ ${1:-a} == floor ]]; then
  record_build
  python3 bench/start_floor.py --artifact $D/out/*.kpack --runs ${RUNS:-3} --profile 45 --out "$OUT/floor.jsonl" \
    2> "$OUT/floor-profile.txt"
  cut -c1-9000 "$OUT/floor-profile.txt" | head -80
  KERNELPACK_LOAD=eager python3 bench/start_floor.py --artifact $D/out/*.kpack --runs 1 --mode job | tee -a "$OUT/floor.jsonl"
  if [[ -n ${TESTS:-} ]]; then
    timeout 300 python3 -m pytest -q -x tests/test_gpu.py -k "$TESTS" -p no:cacheprovider 2>&1 | tail -15
  fi
fi
# bg: the background start against the default and native warm, with bytecode as a pip install has it:
# record, build, then alternated fresh processes: kernelpack with activate(warmup="background") (--background),
# kernelpack as the default, native warm (after one cold run fills its cache); then start_floor.py, and the GPU tests
# TESTS names
if [[ ${1:-a} == bg ]]; then
  record_build
  TORCHINDUCTOR_CACHE_DIR=$D/cold-1 arm cold 1 --flex torch
  for r in 1 2 3; do
    arm kernelpack-bg $r --artifact $D/out/*.kpack --cache $D/kpb-cache-$r --background
    [[ $r -le ${DEFAULT_RUNS:-2} ]] && arm kernelpack $r --artifact $D/out/*.kpack --cache $D/kp-cache-$r
    [[ $r -le ${WARM_RUNS:-2} ]] && TORCHINDUCTOR_CACHE_DIR=$D/cold-1 arm warm $r --flex torch
  done
  python3 bench/start_floor.py --artifact $D/out/*.kpack --runs 1 --out "$OUT/floor.jsonl" 2> "$OUT/floor-profile.txt"
  START_BACKGROUND=1 python3 bench/start_floor.py --artifact $D/out/*.kpack --runs 1 --mode job | tee -a "$OUT/floor.jsonl"
  if [[ -n ${TESTS:-} ]]; then
    timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -x tests/test_gpu.py -k "$TESTS" -p no:cacheprovider 2>&1 | tail -15
  fi
fi
# e: the job's start with the background start as activate()'s default: record, build, cold x1, then alternated fresh
# processes: kernelpack as shipped (activate()), kernelpack with activate(warmup=True) (--foreground), native warm
# (the cold run's cache dir); RUNS of each (3), NO_FG=1 without the --foreground arm, THREAD_ARM=1 with a
# KERNELPACK_INSTALL_PROCESS=0 arm, ALL_ARM=1 with a KERNELPACK_INSTALL=all arm; then the GPU tests TESTS names
if [[ ${1:-a} == e ]]; then
  record_build
  TORCHINDUCTOR_CACHE_DIR=$D/cold-1 arm cold 1 --flex torch
  for r in $(seq 1 ${RUNS:-3}); do
    arm kernelpack $r --artifact $D/out/*.kpack --cache $D/kp-cache-$r
    [[ -z ${NO_FG:-} ]] && arm kernelpack-fg $r --artifact $D/out/*.kpack --cache $D/kpf-cache-$r --foreground
    # THREAD_ARM=1: the same start with the install's files written in a thread of the job (not a child process)
    [[ -n ${THREAD_ARM:-} ]] && KERNELPACK_INSTALL_PROCESS=0 arm kernelpack-thread $r --artifact $D/out/*.kpack \
      --cache $D/kpt-cache-$r
    # ALL_ARM=1: the start installs every part of the artifact in the background (KERNELPACK_INSTALL=all), not
    # only the signatures the job calls
    [[ -n ${ALL_ARM:-} ]] && KERNELPACK_INSTALL=all arm kernelpack-install-all $r --artifact $D/out/*.kpack \
      --cache $D/kpa-cache-$r
    TORCHINDUCTOR_CACHE_DIR=$D/cold-1 arm warm $r --flex torch
  done
  if [[ -n ${TESTS:-} ]]; then
    timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -x tests/test_gpu.py -k "$TESTS" -p no:cacheprovider 2>&1 | tail -15
  fi
fi
# f: the DFlash job's targets with the final code: cold, native warm, mega-cache and kernelpack side by side, and the job's
# own floor (sdpa: the same job with nothing to compile or load), STEPS steps each for the steady step
if [[ ${1:-a} == f ]]; then
  record_build
  cp $D/drafter.toml "$OUT/"
  TORCHINDUCTOR_CACHE_DIR=$D/cold-1 arm cold 1 --flex torch --mega-save $D/mega.bin
  for r in $(seq 1 ${RUNS:-3}); do
    arm kernelpack $r --artifact $D/out/*.kpack --cache $D/kp-cache-$r
    TORCHINDUCTOR_CACHE_DIR=$D/cold-1 arm warm $r --flex torch
    TORCHINDUCTOR_CACHE_DIR=$D/mega-cache-$r arm mega $r --flex torch --mega-load $D/mega.bin
    arm sdpa $r --flex sdpa
  done
  python3 bench/start_floor.py --artifact $D/out/*.kpack --runs 1 --out "$OUT/floor.jsonl" 2> "$OUT/floor-profile.txt"
fi
# g: where the steady step's gap to native warm comes from: one flex call's speed per way of compiling
# (bench/dflash_kernels.py: marked, kernelpack's graph; automatic, the job's own), then the job with ONE thread
# (no GIL shared between drafter threads), kernelpack and native warm alternated, STEPS steps each
if [[ ${1:-a} == g ]]; then
  for m in marked automatic; do
    TORCHINDUCTOR_CACHE_DIR=$D/kernels-$m python3 bench/dflash_kernels.py $m 2> "$OUT/kernels-$m.log" | tee -a "$OUT/kernels.jsonl"
  done
  record_build
  JOB="${JOB/--threads 3/--threads 1}"
  TORCHINDUCTOR_CACHE_DIR=$D/cold-1 arm cold1t 1 --flex torch
  for r in $(seq 1 ${RUNS:-2}); do
    arm kernelpack1t $r --artifact $D/out/*.kpack --cache $D/kp1-cache-$r
    TORCHINDUCTOR_CACHE_DIR=$D/cold-1 arm warm1t $r --flex torch
  done
fi
# s: the steady step alone, with more samples: record, build, cold x1, then RUNS (5) of kernelpack and native warm
# alternated, STEPS steps each (three threads)
if [[ ${1:-a} == s ]]; then
  record_build
  TORCHINDUCTOR_CACHE_DIR=$D/cold-1 arm cold 1 --flex torch
  for r in $(seq 1 ${RUNS:-5}); do
    arm kernelpack $r --artifact $D/out/*.kpack --cache $D/kp-cache-$r
    TORCHINDUCTOR_CACHE_DIR=$D/cold-1 arm warm $r --flex torch
  done
fi
# t: which tier the steady step's gap comes with: record, build, cold x1, then RUNS (3) of kernelpack (tier 2, its
# precompiled functions), kernelpack with KERNELPACK_PRECOMPILED=0 (tier 1: Dynamo's own cache entries, warmed at
# activate()) and native warm alternated, STEPS steps each (three threads)
if [[ ${1:-a} == t ]]; then
  record_build
  TORCHINDUCTOR_CACHE_DIR=$D/cold-1 arm cold 1 --flex torch
  for r in $(seq 1 ${RUNS:-3}); do
    arm kernelpack $r --artifact $D/out/*.kpack --cache $D/kp-cache-$r
    KERNELPACK_PRECOMPILED=0 arm kernelpack-tier1 $r --artifact $D/out/*.kpack --cache $D/kp1-cache-$r
    TORCHINDUCTOR_CACHE_DIR=$D/cold-1 arm warm $r --flex torch
  done
fi
