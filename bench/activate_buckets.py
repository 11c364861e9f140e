"""activate() of artifacts of one call with different bucket counts, in alternated fresh processes.

    python bench/activate_buckets.py A.kpack B.kpack [--runs 3]   # KERNELPACK_LOAD=lazy|eager from the environment

Each process activates into an empty cache dir (a fresh node: the install is part of it) and prints one JSON line:
the artifact, the seconds to the end of activate()'s start (``activate_s``, its background thread included) and to
its return (``returned_s``), the install's and the warm-up's, and how many precompiled functions were loaded
and left for their first call. The medians per artifact come last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import json, sys, tempfile, time, torch
from kernelpack import runtime
torch.set_num_threads(2)
with tempfile.TemporaryDirectory() as cache:
    t = time.perf_counter()
    a = runtime.activate(sys.argv[1], cache_dir=cache)
    returned = time.perf_counter() - t
    a.wait()  # the background start: install, imports, warm-up
    s = time.perf_counter() - t
    print(json.dumps({"artifact": sys.argv[1], "activate_s": s, "returned_s": returned, "install_s": a.install.seconds,
                      "warmup_s": a.warmup.seconds, "loaded": len(a.warmup.precompiled), "lazy": len(a.warmup.lazy)}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifacts", nargs="+")
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    seconds: dict[str, list[float]] = {x: [] for x in a.artifacts}
    for _ in range(a.runs):
        for artifact in a.artifacts:
            out = subprocess.run([sys.executable, "-c", CHILD, artifact], capture_output=True, text=True, check=True)
            line = json.loads(out.stdout.strip().splitlines()[-1])
            seconds[artifact].append(line["activate_s"])
            print(json.dumps(line), flush=True)
    print(json.dumps({"medians": {x: statistics.median(s) for x, s in seconds.items()}}))


if __name__ == "__main__":
    main()
