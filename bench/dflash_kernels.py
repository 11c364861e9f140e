"""How fast one DFlash-shaped flex call runs (fwd+bwd, q_len 8192, kv_len S + 8192, 32/8 heads, D=128,
bf16, H200) under each way of compiling it, after it is compiled: ``python bench/dflash_kernels.py MODE``.

- ``dynamic``: torch.compile(flex_attention, dynamic=True) under kernelpack's trace settings (what kernelpack built
  before its marks): every size and closure int symbolic, q_len, batch and heads too;
- ``marked``: kernelpack's dynamic entry (``guarded(dynamic=True)``) with the marks kernelpack.canonical.marks gives
  this call's config (what kernelpack builds now): the kv length, its block counts and S symbolic, the rest static;
- ``automatic``: torch.compile(flex_attention) (dynamic=None, what a job ships): the first call static, the second at
  another S recompiles with only what changed symbolic (the kv length, S);
- ``static``: torch.compile(flex_attention, dynamic=False) at one S (a bucket).

Prints one JSON line: the median seconds of 10 synchronized fwd+bwd calls at random S after the compiles.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, "tests/data/record_project")
import drafter

from kernelpack.compiled import marking, trace_settings
from kernelpack.runtime import guarded


def call(fn, s: int) -> float:
    anchors = torch.randint(0, s, (1, 512), device="cuda")
    mask = drafter.anchored_mask(anchors, torch.ones(1, 512, dtype=torch.bool, device="cuda"), s, 16, 2048)
    bm = create_block_mask(mask, 1, None, 8192, s + 8192, device="cuda")
    q = torch.randn(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 8, s + 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(q, k, v, block_mask=bm, enable_gqa=True)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    mode = sys.argv[1]
    rng = random.Random(0)
    if mode == "marked":
        fn = guarded(dynamic=True)
        blocks = ["kv_indices.shape[3]", "full_kv_indices.shape[3]", "q_num_blocks.shape[2]", "q_indices.shape[2]"]
        blocks += ["full_q_num_blocks.shape[2]", "full_q_indices.shape[2]", "seq_lengths[1]"]
        marks = ("key.shape[2]", "value.shape[2]", "block_mask.mask_mod.context", *(f"block_mask.{b}" for b in blocks))
        with marking(marks):
            first = [call(fn, 2048), call(fn, 3001)]
    else:
        fn = torch.compile(flex_attention, dynamic={"dynamic": True, "automatic": None, "static": False}[mode])
        with trace_settings(mode == "dynamic"):
            first = [call(fn, 2048), call(fn, 3001)] if mode != "static" else [call(fn, 2048)]
    lens = [rng.randint(1024, 4096) for _ in range(10)] if mode != "static" else [2048] * 10
    times = [call(fn, s) for s in lens]
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    print(json.dumps({"mode": mode, "first": first, "median": statistics.median(times), "frames": frames}))


if __name__ == "__main__":
    main()
