"""kernelpack's bounded BlockMask builder (kernelpack.masks.eager_block_mask) against torch's eager
create_block_mask: time and peak device memory per length, and that every block table is equal.

    python bench/mask_builder.py --device cuda --lengths 4096,16384 --window 1024
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask

from kernelpack.masks import eager_block_mask, sliding_window

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def measure(build, device: str) -> tuple[float, float, object]:  # type: ignore[no-untyped-def]
    build()  # once, so that lazy initialization is not timed
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    mask = build()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else float("nan")
    return time.perf_counter() - t0, peak, mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="4096,16384")
    ap.add_argument("--window", type=int, default=1024)
    args = ap.parse_args()
    mask_mod = sliding_window(args.window)
    rows = []
    for n in map(int, args.lengths.split(",")):
        ours = measure(lambda n=n: eager_block_mask(mask_mod, None, None, n, n, args.device), args.device)
        torchs = measure(lambda n=n: create_block_mask(mask_mod, None, None, n, n, device=args.device), args.device)
        equal = all(torch.equal(getattr(ours[2], f), getattr(torchs[2], f)) for f in FIELDS)
        rows.append(
            {
                "length": n,
                "bounded_s": ours[0],
                "bounded_MiB": ours[1],
                "torch_s": torchs[0],
                "torch_MiB": torchs[1],
                "equal": equal,
            }
        )
        print(json.dumps(rows[-1]))


if __name__ == "__main__":
    main()
