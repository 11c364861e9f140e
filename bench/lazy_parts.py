"""What a signature's first call costs when its files are installed at that call (KERNELPACK_INSTALL=used, the
default) against when the start installed every part (KERNELPACK_INSTALL=all), in alternated fresh processes.

    python bench/lazy_parts.py ARTIFACT [--runs 3] [--calls 6]

The artifact is one of a CPU recipe's buckets (every config one forward call of the smoke recipe's shape at its own
length, as tests/test_start.py's 16-bucket artifact: `python -m pytest -m manual tests/test_start.py` builds it
under pytest's tmp dir). Each process activates into an empty cache dir, waits for the start (and, with
KERNELPACK_INSTALL=all, for the rest of the install: a later first call then only loads), then makes the first
call of ``--calls`` other configs, one after another, each timed (install of its part + load + the call). Prints a
JSON line per process, and the medians per mode last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, os, sys, tempfile, time, torch
import kernelpack
from kernelpack import masks, runtime
from kernelpack.artifact import read_manifest
torch.set_num_threads(2)
m = read_manifest(sys.argv[1])
calls = int(sys.argv[2])
with tempfile.TemporaryDirectory() as cache:
    t = time.perf_counter()
    a = runtime.activate(sys.argv[1], cache_dir=cache)
    a.wait()
    start_s = time.perf_counter() - t
    mode = os.environ.get("KERNELPACK_INSTALL", "used")
    while mode == "all" and not a.installing.complete:  # the rest, in the background: not timed (a call only loads)
        assert a.installing.error is None, a.installing.error
        time.sleep(0.01)
    warmed = next(iter(a.warmup.precompiled)).kv_len
    times = []
    for built in [b for b in m.configs if b.config.kv_len != warmed][:calls]:
        c = built.config
        q, k, v = (torch.randn(c.batch, c.q_heads, c.q_len, c.head_dim) for _ in range(3))
        bm = masks.block_mask(masks.sliding_window(c.window), c.q_len, c.kv_len, "cpu")
        t = time.perf_counter()
        kernelpack.flex_attention(q, k, v, block_mask=bm)
        times.append(time.perf_counter() - t)
    inst = a.install
    print(json.dumps({"mode": mode, "start_s": start_s,
                      "first_calls_s": times, "parts_installed": inst.parts_installed, "parts": inst.parts,
                      "bytes_written": inst.bytes_written, "compiled": len(runtime.report().compiled)}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--calls", type=int, default=6)
    args = p.parse_args()
    rows: dict[str, list[dict]] = {"used": [], "all": []}
    for _ in range(args.runs):
        for mode in rows:
            env = {**os.environ, "KERNELPACK_INSTALL": mode}
            child = [sys.executable, "-c", CHILD, args.artifact, str(args.calls)]
            out = subprocess.run(child, env=env, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                sys.exit(out.stderr[-3000:])
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows[mode].append(row)
            print(json.dumps(row))
    for mode, rs in rows.items():
        calls = [s for r in rs for s in r["first_calls_s"]]
        summary = {
            "mode": mode,
            "runs": len(rs),
            "median_start_s": round(statistics.median(r["start_s"] for r in rs), 3),
            "median_later_first_call_s": round(statistics.median(calls), 4),
            "max_later_first_call_s": round(max(calls), 4),
            "parts_installed": [r["parts_installed"] for r in rs],
            "mib_written": [round(r["bytes_written"] / 2**20, 1) for r in rs],
            "compiled": [r["compiled"] for r in rs],
        }
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
