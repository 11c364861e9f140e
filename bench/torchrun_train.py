"""Training steps of a transformers causal LM under torchrun, one process per GPU: does
every rank's first training step compile nothing?

The model is bench/transformers_step.py's (Mistral architecture: sliding window, GQA 32/8, D=128, 2 layers, bf16).
Modes, each a ``torchrun --standalone --nproc-per-node N`` job (bench/torchrun_driver.py: caches, rounds, medians):

  cold            attn_implementation="flex_attention" (transformers' own torch.compile), rank r on cuda:r, empty cache
  warm            the same over a copy of the first cold job's cache: torch's native warm start
  pinned          ``runtime.pin_local_gpu()`` first, ``activate(ARTIFACT)``, attn_implementation="kernelpack"
  unpinned        rank r on cuda:r, ``activate(ARTIFACT, strict=False)``: ranks != 0 are not covered (pytorch#170123);
                  after the warm-up non-strict mode refuses them too (it compiles only with warmup=False)
  unpinned-strict rank r on cuda:r, ``activate(ARTIFACT)``: a rank != 0 is refused, the error names the device fix

A step is, by default, one batch of each length the artifact covers, in order (transformers_step.py's step).
``--random MIN:MAX`` makes it one batch of a random length instead, drawn per (rank, step) from a seeded generator,
so that the ranks meet different lengths at the same step (item 4); against a bucketed artifact the batch is padded
to its bucket (labels -100 on the padding), against a dynamic one it runs as it is. The clock starts after CUDA init
and a gloo barrier all ranks leave together; ``ttfs`` covers activate (install + warm-up), building the model and
the first step. Compiles are torch's per-compile records (kernelpack.evidence) outside kernelpack's warm-up.

    python bench/transformers_step.py --write-recipe r.toml --lengths 4096,8192 && kernelpack build r.toml -o out
    python bench/torchrun_train.py --artifact out/*.kpack --nproc 2 --modes pinned,unpinned-strict --out t.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torchrun_driver

MODES = ("cold", "warm", "pinned", "unpinned", "unpinned-strict")


def worker(mode: str, result_dir: str, artifact: str, steps: str, lengths: str, seed: str) -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    from kernelpack import runtime

    pinned = mode == "pinned"
    if pinned:
        runtime.pin_local_gpu()  # before CUDA initializes: this rank's GPU becomes cuda:0
    import torch
    import torch.distributed as dist
    from transformers import MistralForCausalLM
    from transformers_step import TINY, config

    from kernelpack import evidence
    from kernelpack.artifact import read_manifest
    from kernelpack.integrations import transformers as hf

    manifest = read_manifest(artifact)
    cuda = manifest.build_key.device_type == "cuda"  # a CPU artifact: a dry run of the script, forward only
    device = ("cuda:0" if pinned else f"cuda:{local_rank}") if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
    first = manifest.configs[0].config
    train = all(c.config.backward for c in manifest.configs)
    cfg = config(tiny=first.q_heads == TINY["num_attention_heads"])
    ours = mode not in ("cold", "warm")
    cfg._attn_implementation = "kernelpack" if ours else "flex_attention"
    if ours:  # the name must be known when the model is built
        hf.register()
    evidence.install_hooks()
    evidence.watch_compiles()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rng = random.Random(f"{seed}-{rank}")  # another sequence on every rank
    low, high = (int(x) for x in lengths.split(":")) if lengths else (0, 0)
    covered = sorted({c.config.q_len for c in manifest.configs})
    out: dict[str, Any] = {
        "mode": mode,
        "rank": rank,
        "local_rank": local_rank,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "device": device,
        "steps": [],
    }
    dist.barrier()
    t0 = time.perf_counter()
    try:
        padded = False
        if ours:
            activation = runtime.activate(artifact, strict=mode != "unpinned")
            padded = all(c.config.q_range is None for c in activation.manifest.configs)  # buckets: pad to them
        out["activate_s"] = time.perf_counter() - t0
        torch.manual_seed(0)
        with torch.device(device):
            model = MistralForCausalLM(cfg).to(getattr(torch, first.dtype)).train(train)
        for step in range(int(steps)):
            before = evidence.next_seq()
            start = time.perf_counter()
            ns = [rng.randint(low, high)] if lengths else covered
            for n in ns:
                length = runtime.padded_length(n) if padded else n
                ids = torch.randint(0, cfg.vocab_size, (1, length), device=device)
                labels = ids.clone()
                labels[:, n:] = -100  # the padding: no loss; causal attention keeps it out of the real tokens
                with torch.set_grad_enabled(train):
                    loss = model(ids, labels=labels if train else None, use_cache=False).loss
                if train:
                    loss.backward()
            if cuda:
                torch.cuda.synchronize(device)
            records = [r for r in evidence.compile_records(before) if r.tag is None]  # not kernelpack's warm-up
            out["steps"].append(
                {
                    "lengths": ns,
                    "s": time.perf_counter() - start,
                    "compiles": len(records),
                    "misses": sum(r.missed for r in records),
                }
            )
            if step == 0:
                out["ttfs"] = time.perf_counter() - t0
        out["ok"] = True
    except Exception as e:  # the benchmark records what the rank raised (strict mode is expected to)
        out["ok"] = False
        out["ttfs"] = time.perf_counter() - t0
        out["error"] = f"{type(e).__name__}: {e}"[:3000]
    out["compiles_in_steps"] = sum(s["compiles"] for s in out["steps"])
    out["misses_in_steps"] = sum(s["misses"] for s in out["steps"])
    if ours:
        rep = runtime.report()
        out["report"] = rep.summary()
        out["tiers"] = sorted({s["tier"] for s in rep.to_dict()["served"]})
        out["refused"] = rep.to_dict()["refused"][:3]
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


def describe(rank: dict[str, Any]) -> str:
    lengths = [s["lengths"] for s in rank["steps"]]
    compiles = f"{rank['compiles_in_steps']} compiles ({rank['misses_in_steps']} misses) in the steps"
    return f"{compiles}, lengths {lengths}; {rank.get('report', '')}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True, help="built on one GPU (cuda:0), from this model's recipe")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--random", default="", metavar="MIN:MAX", help="one batch of a random length per (rank, step)")
    ap.add_argument("--seed", default="0")
    torchrun_driver.add_arguments(ap, MODES, "torchrun_train.json")
    args = ap.parse_args()
    torchrun_driver.main(__file__, args, [args.artifact, str(args.steps), args.random, args.seed], describe)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:8])
    else:
        main()
