"""Inductor's CPU flex template and a mask closing over ints a dynamic graph keeps symbolic.

``python bench/cpu_flex_split_names.py [--fix]``: compiles ``torch.compile(flex_attention, dynamic=True)`` on the CPU
for two masks at three context lengths each and prints one JSON line per (mask, length): whether it compiled, how
many Dynamo entries flex has, and the max error against eager flex.

- ``anchored``: a DFlash-shaped mask (two closure tensors, ints S, N, block): without the fix gcc fails with
  ``'cur_kvSplitSize7' was not declared``.
- ``collision``: a closure tensor's size becomes a symbol whose kernel name is exactly the template's split-size
  placeholder: without the fix it compiles and computes the wrong mask (silently).

``--fix`` applies kernelpack's workaround (kernelpack._torch.inductor.fix_cpu_flex_split_names) first.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch._inductor.config as inductor_config
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from kernelpack._torch.dynamo import cache_entries
from kernelpack._torch.inductor import fix_cpu_flex_split_names


def anchored(anchors: torch.Tensor, keep: torch.Tensor, S: int, block: int) -> object:
    _, N = anchors.shape

    def mask(b, h, q_idx, kv_idx):
        blk = (q_idx // block).clamp(max=N - 1)
        ctx = (kv_idx < S) & (kv_idx < anchors[b, blk])
        draft = (kv_idx >= S) & ((kv_idx - S) // block == q_idx // block)
        return (ctx | draft) & keep[b, blk]

    return mask


def collision(T: torch.Tensor, A1: object, A2: object, A3: object) -> object:
    def mask(b, h, q, kv):
        return A1(A2(A3(kv < T.shape[1] * 20))) & (q >= 0)  # type: ignore[operator]

    return mask


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fix", action="store_true")
    args = ap.parse_args()
    inductor_config.fx_graph_cache = False  # each run compiles: a cached kernel from a run without the fix is no proof
    if args.fix:
        fix_cpu_flex_split_names()
    compiled = torch.compile(flex_attention, dynamic=True)
    for name in ("anchored", "collision"):
        torch._dynamo.reset()
        for S in (256, 384, 512):
            torch.manual_seed(S)
            if name == "anchored":
                anchors = torch.randint(0, S, (1, 8))
                mask_mod = anchored(anchors, torch.ones(1, 8, dtype=torch.bool), S, 16)
                q_len, kv_len = 128, S + 128
            else:
                ident = lambda x: x  # noqa: E731
                mask_mod = collision(torch.zeros(1, S // 32, dtype=torch.int64), ident, ident, ident)
                q_len, kv_len = 128, S + 128
            bm = create_block_mask(mask_mod, 1, None, q_len, kv_len, device="cpu")
            q, k, v = torch.randn(1, 2, q_len, 16), torch.randn(1, 2, kv_len, 16), torch.randn(1, 2, kv_len, 16)
            row: dict[str, object] = {"mask": name, "S": S, "fix": args.fix}
            try:
                out = compiled(q, k, v, block_mask=bm)
                row.update(ok=True, max_error=float((out - flex_attention(q, k, v, block_mask=bm)).abs().max()))
            except Exception as e:  # the compile error is the finding
                row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            row["entries"] = len(cache_entries(flex_attention.__code__))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
