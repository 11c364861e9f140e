"""A CPU job's start with and without the vector-ISA check ahead (kernelpack._torch.inductor.prefetch_vec_isa), in
alternated fresh processes: activate() of ARTIFACT into a fresh cache dir, to the end of its background start, with
the start's timeline; then the medians per arm.

    python bench/cpu_start_vec_isa.py START-2.kpack [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

ONE = """
import json, sys, tempfile, time, torch
from kernelpack import runtime
from kernelpack.runtime import warmup
if sys.argv[2] == "off":
    warmup.prefetch_vec_isa = lambda after, wanted: None
torch.set_num_threads(2)
with tempfile.TemporaryDirectory() as cache:
    t = time.perf_counter()
    activation = runtime.activate(sys.argv[1], cache_dir=cache)
    activation.wait()
    seconds = time.perf_counter() - t
    print(json.dumps({"arm": sys.argv[2], "seconds": round(seconds, 3),
                      "timeline": {k: round(v - t, 3) for k, v in activation.warmup.timeline.items()}}))
"""

ap = argparse.ArgumentParser()
ap.add_argument("artifact")
ap.add_argument("--runs", type=int, default=5)
args = ap.parse_args()
rows: dict[str, list[dict]] = {"off": [], "on": []}
for _ in range(args.runs):
    for arm in rows:
        cmd = [sys.executable, "-c", ONE, args.artifact, arm]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows[arm].append(row)
        print(json.dumps(row), flush=True)
for arm, rs in rows.items():
    seconds = [r["seconds"] for r in rs]
    print(json.dumps({"arm": arm, "runs": len(rs), "seconds": seconds, "median_s": statistics.median(seconds)}))
