#!/usr/bin/env bash
# Job-start diagnostics on the H200: bytecode caching of this image, the checkpoint-threads child's error, and a
# profile of the first precompiled load. Writes under $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -c 'import sys, torch; print("pycache_prefix", sys.pycache_prefix, "dont_write", sys.dont_write_bytecode, torch.__file__)'
ls -ld /opt/torch/.venv/lib/python3.12/site-packages/torch/__pycache__ 2>&1 | head -2
for i in 1 2 3; do python3 -c 'import time; t=time.perf_counter(); import torch; a=time.perf_counter(); import torch._dynamo, torch._inductor.codecache; print("import torch %.2f s, dynamo+inductor %.2f s" % (a-t, time.perf_counter()-a))'; done
du -sh /tmp/pycache 2>/dev/null
python3 -m kernelpack.cli build ${RECIPE:-tests/data/gpu-small.toml} -o /tmp/g --jobs 2 2>&1 | tail -1
python3 bench/checkpoint_threads.py --artifact /tmp/g/*.kpack --modes reentrant --runs 1 --threads 3 --timeout 120 \
  --out /tmp/c.json > /tmp/c.log 2>&1; tail -3 /tmp/c.log
python3 -c "import json; print(json.dumps(json.load(open('/tmp/c.json'))['runs'])[:5000])"
python3 bench/start_floor.py --artifact /tmp/g/*.kpack --runs 1 --mode phases --profile 60 2> "$OUT/load-profile.txt"
cut -c1-200 "$OUT/load-profile.txt" | grep -v '^$' | head -150
