"""Which dynamic-shape flex graphs a fresh process can reuse: one process per invocation, calling
torch.compile(flex_attention, dynamic=...) fwd+bwd at each of --lens in turn and printing, per length, what compiled
(Dynamo frames, FX-graph and AOTAutograd cache hits and misses), the first call's seconds and the steady-state
median. --no-duck turns off duck sizing (torch.fx.experimental._config.use_duck_shape) for the trace, as kernelpack
does for dynamic configs. Run it several times against one TORCHINDUCTOR_CACHE_DIR:

    TORCHINDUCTOR_CACHE_DIR=/tmp/c python3 bench/dynamic_probe.py --lens 4100 --no-duck
    TORCHINDUCTOR_CACHE_DIR=/tmp/c python3 bench/dynamic_probe.py --lens 6144,1500 --no-duck
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.fx.experimental._config as fx_config
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lens", required=True)
    p.add_argument("--static", action="store_true", help="dynamic=False instead of True")
    p.add_argument("--no-duck", action="store_true")
    p.add_argument("--steady", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--heads", default="32,8")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--fwd-only", action="store_true")
    a = p.parse_args()
    if a.no_duck:
        fx_config.use_duck_shape = False
    hq, hkv = map(int, a.heads.split(","))
    window = a.window

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    fn = torch.compile(flex_attention, dynamic=not a.static)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    grad = not a.fwd_only
    rows = []
    for n in map(int, a.lens.split(",")):
        q = torch.randn(1, hq, n, a.dim, device=a.device, dtype=dtype, requires_grad=grad)
        k, v = (torch.randn(1, hkv, n, a.dim, device=a.device, dtype=dtype, requires_grad=grad) for _ in range(2))
        bm = create_block_mask(sliding_window_mask, None, None, n, n, device=a.device)
        before = {k2: dict(v2) for k2, v2 in counters.items()}

        def step(q=q, k=k, v=v, bm=bm):
            with torch.set_grad_enabled(grad):
                out = fn(q, k, v, block_mask=bm, enable_gqa=hq != hkv)
            if grad:
                out.sum().backward()
            if a.device == "cuda":
                torch.cuda.synchronize()

        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
        delta = {
            f"{group}.{name}": n2 - before.get(group, {}).get(name, 0)
            for group, items in counters.items()
            for name, n2 in items.items()
            if n2 != before.get(group, {}).get(name, 0) and group in ("frames", "inductor", "aot_autograd")
        }
        times = []
        for _ in range(a.steady):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        steady_ms = round(1e3 * statistics.median(times), 3)
        rows.append({"len": n, "first_s": round(first, 3), "steady_ms": steady_ms, **delta})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
