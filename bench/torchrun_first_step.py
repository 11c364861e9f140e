"""One process per GPU under torchrun: does every rank's first step compile nothing?

Modes, each a separate ``torchrun --standalone --nproc-per-node N`` job over one node cache dir shared by its ranks
(bench/torchrun_driver.py: empty, except for warm), ``--repeats`` rounds of them:

  cold            no artifact: rank r ``torch.compile(flex_attention)`` on cuda:r from scratch (what jobs do today)
  warm            the same over a copy of the first cold job's cache: torch's native warm start
  pinned          ``runtime.pin_local_gpu()`` (each rank sees its GPU as cuda:0), then ``activate(ARTIFACT)``: the
                  precompiled tier serves what it covers
  pinned-tier1    the same with KERNELPACK_PRECOMPILED=0: the inductor cache serves every call
  unpinned        rank r runs on cuda:r, ``activate(ARTIFACT, strict=False)``: ranks != 0 are not covered
                  (pytorch#170123); after the warm-up non-strict mode refuses them too (it compiles only with
                  warmup=False)
  unpinned-strict rank r on cuda:r, ``activate(ARTIFACT)``: ranks != 0 must raise NotPrecompiledError

The first step runs every config of the artifact once (forward + backward), like bench/warm_start.py. Time to first
step (``ttfs``) runs from just before activate() (the install is included) to the last synchronize; all ranks leave a
gloo barrier together before it. Each rank writes ``rank<r>.json``; the driver prints each job, then the median
ttfs per (mode, rank), and writes --out with every rank's JSON, the medians, the torch build and the commit.

    python bench/torchrun_first_step.py --artifact a.kpack --nproc 8 --repeats 3 --out torchrun.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torchrun_driver

MODES = ("cold", "warm", "pinned", "pinned-tier1", "unpinned", "unpinned-strict")


def worker(mode: str, result_dir: str, artifact: str) -> None:
    t_start = time.perf_counter()
    local_rank = int(os.environ["LOCAL_RANK"])
    if mode == "pinned-tier1":
        os.environ["KERNELPACK_PRECOMPILED"] = "0"
    from kernelpack import runtime

    pinned = mode.startswith("pinned")
    if pinned:
        runtime.pin_local_gpu()  # before CUDA initializes: this rank's GPU becomes cuda:0
    import torch
    import torch.distributed as dist
    from torch.nn.attention.flex_attention import flex_attention

    from kernelpack import evidence
    from kernelpack.artifact import read_manifest
    from kernelpack.canonical import make_inputs
    from kernelpack.masks import block_mask_for

    configs = [c.config for c in read_manifest(artifact).configs]
    cuda = configs[0].device == "cuda"  # a CPU artifact: a dry run of the script, forward only
    device = ("cuda:0" if pinned else f"cuda:{local_rank}") if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda device: None)
    if cuda:
        torch.cuda.set_device(device)
    work = []
    for c in configs:
        q, k, v = make_inputs(c, device, "fwd+bwd" if cuda else "fwd")
        work.append((c, q, k, v, torch.randn_like(q), block_mask_for(c, device)))
    sync(device)
    import_s = time.perf_counter() - t_start
    dist.init_process_group("gloo")
    dist.barrier()
    out: dict[str, object] = {
        "mode": mode,
        "rank": dist.get_rank(),
        "local_rank": local_rank,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device": device,
        "gpu_uuid": str(torch.cuda.get_device_properties(device).uuid) if cuda else None,
        "setup_s": import_s,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "num_threads": torch.get_num_threads(),
    }
    t0 = time.perf_counter()
    try:
        if mode in ("cold", "warm"):
            evidence.install_hooks()  # observe torch as it is: count, refuse nothing
            fn = torch.compile(flex_attention, dynamic=False)
            out["activate_s"] = 0.0
        else:
            runtime.activate(artifact, strict=mode != "unpinned")
            out["activate_s"] = time.perf_counter() - t0
            fn = runtime.flex_attention
        before = evidence.snapshot()
        for c, q, k, v, dout, bm in work:
            o = fn(q, k, v, block_mask=bm, enable_gqa=c.enable_gqa)
            if cuda:
                torch.autograd.grad(o, (q, k, v), dout)
        sync(device)
        out["ttfs"] = time.perf_counter() - t0
        out["ok"] = True
        out["counters"] = {k: v for k, v in evidence.delta(before, evidence.snapshot()).items() if v}
    except Exception as e:  # the benchmark records what the rank raised (strict mode is expected to)
        out["ok"] = False
        out["ttfs"] = time.perf_counter() - t0
        out["error"] = f"{type(e).__name__}: {e}"
    if mode not in ("cold", "warm"):
        out["report"] = runtime.report().summary()
        out["tiers"] = sorted({s["tier"] for s in runtime.report().to_dict()["served"]})
        # each first call and its seconds, in call order: where a tier-2 warm-up's time goes (the first load's imports)
        out["first_calls"] = [[c.signature.describe(), round(c.seconds, 3)] for c in runtime.report().first_calls]
        out["warmup_s"] = runtime.report().warmup_seconds
        # torch's compile records, whole: the first pinned job over a new artifact counted 1-2 more than its signatures
        # (backward records on the autograd engine's thread, none missed: docs/BENCHMARKS.md)
        out["compiles"] = runtime.report().to_dict()["compiles"]
    Path(result_dir, f"rank{out['rank']}.json").write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


def describe(rank: dict[str, Any]) -> str:
    c = rank.get("counters", {})
    return (
        f"triton compiled {c.get('triton_compiled', 0)}, FX miss {c.get('inductor.fxgraph_cache_miss', 0)}"
        f" hit {c.get('inductor.fxgraph_cache_hit', 0)}, tiers {rank.get('tiers', '-')}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", required=True, help="built on one GPU (cuda:0)")
    torchrun_driver.add_arguments(ap, MODES, "torchrun_first_step.json")
    args = ap.parse_args()
    torchrun_driver.main(__file__, args, [args.artifact], describe)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
    else:
        main()
