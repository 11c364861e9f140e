"""A drafter training job: ``python drafter_job.py [--threads N] [--steps N] [--device cpu|cuda] [--train]
[--artifact A --cache DIR] [--seed N]``. Each thread trains (``--train``: forward + backward with reentrant
checkpointing; CUDA) or runs (forward) its own drafter for ``--steps`` steps at a new random context length each
step, and the job prints one JSON line: the context lengths, whether every step ran, and kernelpack's report when an
artifact was activated. Nothing in it knows kernelpack but the two lines that activate it."""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time

import drafter
import torch
from job_report import print_report

import kernelpack
from kernelpack import runtime

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--device", default="cpu")
ap.add_argument("--train", action="store_true")
ap.add_argument("--artifact")
ap.add_argument("--cache")
ap.add_argument("--background", action="store_true", help='activate(warmup="background"): the default')
ap.add_argument("--foreground", action="store_true", help="activate(warmup=True): the whole start in activate()")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--context", default="200:700", help="MIN:MAX of the random context length")
ap.add_argument("--size", default="64,4,2,16,16,16,128", help="hidden,heads,kv_heads,head_dim,blocks,block,window")
ap.add_argument(
    "--flex",
    choices=["kernelpack", "torch", "sdpa"],
    default="kernelpack",
    help="torch: its own compile; sdpa: no compile at all (the mask made dense for scaled_dot_product_attention): "
    "the job's own floor, what a first step costs with nothing to compile or load",
)
ap.add_argument("--mask", choices=["own", "specforge"], default="own", help="specforge: SpecForge 0.2.0's mask")
ap.add_argument("--mega-save", help="after the steps, write torch.compiler.save_cache_artifacts() here")
ap.add_argument("--mega-load", help="before the steps, torch.compiler.load_cache_artifacts() of this file")
args = ap.parse_args()
hidden, heads, kv_heads, head_dim, blocks, block, window = map(int, args.size.split(","))
lo, hi = map(int, args.context.split(":"))
# the job's attention: kernelpack's (served after activate()), or torch's own compile as a job ships it
if args.flex == "torch":
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    flex = torch.compile(torch_flex)
elif args.flex == "sdpa":
    from torch.nn.attention.flex_attention import create_mask

    def flex(q, k, v, block_mask, enable_gqa=False):  # the same attention, dense, with nothing compiled
        dense = create_mask(block_mask.mask_mod, 1, 1, q.shape[-2], k.shape[-2], device=q.device)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=enable_gqa)

else:
    flex = kernelpack.flex_attention
start = time.perf_counter()
if args.mega_load:
    with open(args.mega_load, "rb") as f:
        torch.compiler.load_cache_artifacts(f.read())
warmup = True if args.foreground else "background"
activation = runtime.activate(args.artifact, cache_dir=args.cache, warmup=warmup) if args.artifact else None
activated = time.perf_counter() - start
# nothing has compiled before Dynamo is imported (a background start imports it in its own thread)
frames_before = torch._dynamo.utils.counters["frames"]["ok"] if "torch._dynamo" in sys.modules else 0
dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
masks = None
if args.mask == "specforge":  # SpecForge's own DFlash mask builder, as its trainer calls it (pip install specforge)
    from specforge.algorithms.common.dflash_family_model import create_dflash_block_mask

    def masks(anchors, keep, context, block, window):
        return create_dflash_block_mask(anchors, keep, context, block, anchors.device, sliding_window=window)


rng = random.Random(args.seed)
contexts = [[rng.randint(lo, hi) for _ in range(args.steps)] for _ in range(args.threads)]
first_step_done: list[float] = []
step_seconds: list[float] = []  # every step after each thread's first
errors: list[str] = []


def train(i: int) -> None:
    try:
        torch.manual_seed(i)
        model = drafter.Drafter(hidden, heads, kv_heads, head_dim, window, flex, masks).to(args.device, dtype)
        model.checkpoint = args.train
        for step, s in enumerate(contexts[i]):
            began = time.perf_counter()
            draft = torch.randn(1, blocks * block, hidden, device=args.device, dtype=dtype)
            context = torch.randn(1, s, hidden, device=args.device, dtype=dtype)
            anchors = torch.randint(0, s, (1, blocks), device=args.device)
            keep = torch.rand(1, blocks, device=args.device) > 0.1
            if args.train:
                draft.requires_grad_(True)
                model(draft, context, anchors, keep).float().square().mean().backward()
            else:
                with torch.no_grad():
                    model(draft, context, anchors, keep)
            if args.device == "cuda":
                torch.cuda.synchronize()
            if step == 0:
                first_step_done.append(time.perf_counter() - start)
            else:
                step_seconds.append(time.perf_counter() - began)
    except Exception as e:  # reported, not raised: the job's line says what failed
        errors.append(f"thread {i}: {type(e).__name__}: {e}"[:2000])


threads = [threading.Thread(target=train, args=(i,)) for i in range(args.threads)]
for t in threads:
    t.start()
for t in threads:
    t.join()
if args.mega_save:
    saved = torch.compiler.save_cache_artifacts()
    with open(args.mega_save, "wb") as f:
        f.write(saved[0] if saved else b"")
print_report(
    threads=args.threads,
    contexts=contexts,
    errors=errors,
    first_step_done=first_step_done,
    step_seconds=step_seconds,
    activated=activated,
    frames_before=frames_before,
    activation=activation,
    start=start,
)
