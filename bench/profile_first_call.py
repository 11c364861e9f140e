"""Where a warm first call spends its time: cProfile of the first canonical call of every config of an artifact,
in this (fresh) process, after installing the artifact into TORCHINDUCTOR_CACHE_DIR (an empty dir) or using that
dir as it is (native warm).

    TORCHINDUCTOR_CACHE_DIR=/tmp/empty python bench/profile_first_call.py ARTIFACT --install > profile.txt
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time


def main() -> None:
    artifact = sys.argv[1]
    do_install = "--install" in sys.argv
    import torch

    from kernelpack import install
    from kernelpack.artifact import read_manifest
    from kernelpack.masks import block_mask_for
    from kernelpack.workload import run_config

    configs = [c.config for c in read_manifest(artifact).configs]
    device = "cuda:0" if configs[0].device == "cuda" else "cpu"
    if device != "cpu":
        torch.zeros(1, device=device)
    for c in configs:
        block_mask_for(c, device)  # mask creation is not what we profile
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    if do_install:
        r = install(artifact, os.environ["TORCHINDUCTOR_CACHE_DIR"])
        print("install", round(r.seconds, 3), {k: round(v, 3) for k, v in r.timings.items()})
    times = [run_config(c, device, check=False).seconds for c in configs]
    pr.disable()
    print("first calls", [round(t, 2) for t in times], "total", round(time.perf_counter() - t0, 2))
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(40)
        print("\n".join(line[:200] for line in s.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
