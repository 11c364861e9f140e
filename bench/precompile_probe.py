"""What torch's precompile path does with flex_attention on this torch: one step per process.

    TORCHINDUCTOR_CACHE_DIR=/tmp/c python bench/precompile_probe.py save  --out /tmp/fn.bin   # aot_compile + save
    TORCHINDUCTOR_CACHE_DIR=/tmp/c python bench/precompile_probe.py load  --out /tmp/fn.bin   # load + first call
    TORCHINDUCTOR_CACHE_DIR=/tmp/c python bench/precompile_probe.py plain                     # a plain torch.compile

Prints one JSON line: seconds, torch's counters (FX-graph and AOTAutograd cache), whether the plain load worked or
needed the tracing-context workaround, and the output's max difference from eager (CPU: forward under no_grad; CUDA:
--backward adds the training graph).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

ap = argparse.ArgumentParser()
ap.add_argument("step", choices=("save", "load", "plain"))
ap.add_argument("--out", default="/tmp/kp-precompiled.bin")
ap.add_argument("--length", type=int, default=256)
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = ap.parse_args()


def sliding_window(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 64)


n = args.length
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, n, 64, generator=gen).to(args.device) for _ in range(3))
bm = create_block_mask(sliding_window, None, None, n, n, device=args.device)
result: dict[str, object] = {"step": args.step, "torch": torch.__version__, "device": args.device}
start = time.perf_counter()
with torch.no_grad():
    if args.step == "save":
        import torch._dynamo.config as dynamo_config

        dynamo_config.enable_aot_compile = True  # torch >= 2.10
        # traced under the grad mode of the calls it serves: a loaded function guards on it
        fn = torch.compile(flex_attention, fullgraph=True, dynamic=False).aot_compile(((q, k, v), {"block_mask": bm}))
        result["aot_compile_s"] = time.perf_counter() - start
        save = getattr(torch.compiler, "save_compiled_function", None)
        result["api"] = "torch.compiler.save_compiled_function" if save else "fn.save_compiled_function"
        if save is not None:
            save(fn, args.out)
        else:
            fn.save_compiled_function(args.out)
        out = fn(q, k, v, block_mask=bm)
    elif args.step == "load":
        try:
            with open(args.out, "rb") as f:
                fn = torch.compiler.load_compiled_function(f)
            result["load"] = "plain"
        except RuntimeError as e:  # "TracingContext.get() must be called within an ongoing trace" (2.11, 2.13)
            from torch._guards import TracingContext, tracing
            from torch._subclasses.fake_tensor import FakeTensorMode

            result["load"] = f"workaround after: {str(e)[:80]}"
            with tracing(TracingContext(FakeTensorMode())), open(args.out, "rb") as f:
                fn = torch.compiler.load_compiled_function(f)
        result["load_s"] = time.perf_counter() - start
        t = time.perf_counter()
        out = fn(q, k, v, block_mask=bm)
        result["first_call_s"] = time.perf_counter() - t
    else:
        out = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=bm)
        result["plain_s"] = time.perf_counter() - start
    result["max_diff_from_eager"] = float((out - flex_attention(q, k, v, block_mask=bm)).abs().max())
result["counters"] = {g: dict(counters[g]) for g in ("inductor", "aot_autograd") if counters[g]}
print(json.dumps(result))
