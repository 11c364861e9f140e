"""One process per GPU under torchrun: does every rank's first step compile nothing? (issue 7, items 1, 2 and 4)

Modes, each a separate ``torchrun --standalone --nproc-per-node N`` job over one shared, empty node cache dir:

  cold            no artifact: each rank ``torch.compile(flex_attention)`` from scratch (what jobs do today)
  pinned          ``runtime.pin_local_gpu()`` (each rank sees its GPU as cuda:0), then ``activate(ARTIFACT)``
  unpinned        rank r runs on cuda:r, ``activate(ARTIFACT, strict=False)``: ranks != 0 miss (pytorch#170123)
  unpinned-strict rank r on cuda:r, ``activate(ARTIFACT)``: ranks != 0 must raise NotPrecompiledError

The first step runs every config of the artifact once (forward + backward), like bench/warm_start.py. Time to first
step (``ttfs``) runs from just before activate() (the install is included) to the last synchronize; all ranks leave a
gloo barrier together before it. Each rank writes ``rank<r>.json``; the driver prints a table and writes --out.

    python bench/torchrun_first_step.py --artifact a.kpack --nproc 8 --out torchrun.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("cold", "pinned", "unpinned", "unpinned-strict")


def worker(mode: str, artifact: str, result_dir: str) -> None:
    t_start = time.perf_counter()
    local_rank = int(os.environ["LOCAL_RANK"])
    from kernelpack import runtime

    if mode == "pinned":
        runtime.pin_local_gpu()  # before CUDA initializes: this rank's GPU becomes cuda:0
    import torch
    import torch.distributed as dist
    from torch.nn.attention.flex_attention import flex_attention

    from kernelpack import evidence
    from kernelpack.artifact import read_manifest
    from kernelpack.canonical import make_inputs
    from kernelpack.masks import block_mask_for

    device = "cuda:0" if mode == "pinned" else f"cuda:{local_rank}"
    torch.cuda.set_device(device)
    configs = [c.config for c in read_manifest(artifact).configs]
    work = []
    for c in configs:
        q, k, v = make_inputs(c, device)
        work.append((c, q, k, v, torch.randn_like(q), block_mask_for(c, device)))
    torch.cuda.synchronize(device)
    import_s = time.perf_counter() - t_start
    dist.init_process_group("gloo")
    dist.barrier()
    out: dict[str, object] = {
        "mode": mode,
        "rank": dist.get_rank(),
        "local_rank": local_rank,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device": device,
        "gpu_uuid": str(torch.cuda.get_device_properties(device).uuid),
        "setup_s": import_s,
    }
    t0 = time.perf_counter()
    try:
        if mode == "cold":
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
            torch.autograd.grad(o, (q, k, v), dout)
        torch.cuda.synchronize(device)
        out["ttfs"] = time.perf_counter() - t0
        out["ok"] = True
        out["counters"] = {k: v for k, v in evidence.delta(before, evidence.snapshot()).items() if v}
    except Exception as e:  # the benchmark records what the rank raised (strict mode is expected to)
        out["ok"] = False
        out["ttfs"] = time.perf_counter() - t0
        out["error"] = f"{type(e).__name__}: {e}"
    if mode != "cold":
        out["report"] = runtime.report().summary()
    Path(result_dir, f"rank{out['rank']}.json").write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


def run(mode: str, args: argparse.Namespace) -> dict[str, object]:
    tmp = tempfile.mkdtemp(prefix=f"kp-torchrun-{mode}-")
    try:
        results = Path(tmp, "results")
        results.mkdir()
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp, "cache")), PYTHONUNBUFFERED="1")
        env.pop("TRITON_CACHE_DIR", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
        cmd += [__file__, "--worker", mode, args.artifact, str(results)]
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
            outcome = f"exit {proc.returncode}"
            log = proc.stdout[-3000:] + proc.stderr[-3000:]
        except subprocess.TimeoutExpired:
            outcome, log = f"no result within {args.timeout:.0f} s", ""
        ranks = [json.loads(p.read_text()) for p in sorted(results.glob("rank*.json"))]
        return {"mode": mode, "outcome": outcome, "wall": time.perf_counter() - t, "ranks": ranks, "log_tail": log}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", required=True, help="built on one GPU (cuda:0)")
    ap.add_argument("--nproc", type=int, default=None, help="default: every visible GPU")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default="torchrun_first_step.json")
    args = ap.parse_args()
    if args.nproc is None:
        import torch

        args.nproc = torch.cuda.device_count()
    results = [run(m, args) for m in args.modes.split(",")]
    Path(args.out).write_text(json.dumps({"nproc": args.nproc, "results": results}, indent=1))
    for r in results:
        print(f"{r['mode']}: {r['outcome']}, {len(r['ranks'])}/{args.nproc} ranks reported, wall {r['wall']:.1f} s")
        for k in r["ranks"]:
            c = k.get("counters", {})
            what = (
                f"triton compiled {c.get('triton_compiled', 0)}, FX miss {c.get('inductor.fxgraph_cache_miss', 0)}"
                f" hit {c.get('inductor.fxgraph_cache_hit', 0)}"
                if k["ok"]
                else k["error"][:400]
            )
            where = f"{k['device']} (visible {k['cuda_visible_devices']})"
            print(f"  rank {k['rank']} {where}: ttfs {k['ttfs']:.2f} s; {what}")
        if not r["ranks"]:
            print(r["log_tail"])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main()
