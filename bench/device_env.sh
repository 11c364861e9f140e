# Sourced by the H200 bench scripts (dflash_h200.sh, family_h200.sh): the zstandard wheel carried in .whl/, the
# paths, and the bytecode. EXTRA_PATH: more of the repository on PYTHONPATH.
# The device image sets PYTHONDONTWRITEBYTECODE=1 and its venv ships no .pyc: every fresh process compiled the
# bytecode of each module it imported (import torch 4-5 s, Dynamo + inductor 4-5.5 s, 2 s of a first precompiled
# load: bench/start_floor.py, 2026-12-02), so PYTHONPYCACHEPREFIX alone never filled. A pip-installed torch has
# its .pyc: write them once, up front, for every arm alike.
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/${EXTRA_PATH:-bench} PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE
if [[ ! -d /tmp/pycache/opt ]]; then
  s=$(date +%s.%N)
  site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  python3 -m compileall -q -j 16 "$site" /tmp/site > /dev/null 2>&1
  echo "bytecode compiled in $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s ($site)"
fi
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, torch.version.git_version, "triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0))' | tee -a "$OUT/env.txt"
