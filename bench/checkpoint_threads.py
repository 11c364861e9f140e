"""Threads x gradient checkpointing after ``activate()``: a drafter job's setting.

Each run is a fresh process (``--child``) bounded by ``--timeout`` seconds; the parent runs ``--runs`` of each mode
in a row and writes one JSON with every run and the medians:

  none          THREADS threads, each a block that calls kernelpack.flex_attention, no checkpointing
  none-nowarm   the same after ``activate(warmup=False)``: what the warm-up saves at the first step
  reentrant     THREADS threads, the block under ``checkpoint(..., use_reentrant=True)``
  nonreentrant  THREADS threads, the block under ``checkpoint(..., use_reentrant=False)``
  both          one thread, each config under reentrant and then non-reentrant checkpointing

``--block`` picks what each thread trains: ``canonical`` (contiguous q/k/v, kernelpack's masks), ``hf``
(bench/hf_block.py: projections seen through ``.transpose(1, 2)``, the user's own mask; needs a bshd artifact) or
``tf`` (a transformers MistralForCausalLM of bench/transformers_step.py per thread,
``attn_implementation="kernelpack"``, checkpointing through transformers' own
``gradient_checkpointing_enable(use_reentrant=...)``; needs the artifact of ``transformers_step.py --write-recipe``:
a step is then one batch per length of the artifact).

A step runs every config of the artifact once (each thread starts at another config), forward + backward, with the
BlockMask rebuilt every step as the drafters do. The clock starts after ``import torch`` and CUDA init:
``activate_s`` is install + warm-up (and, when nothing before it paid them, Dynamo's imports and the other GPUs' CUDA
contexts: about 4.4 s more on a 2-H200 host, bench/activate_phases.py), ``first_step_s`` the first step of all threads
(wall), ``second_step_s`` the next.
During the steps, torch's counters must show no compile at all: no FX-graph or AOTAutograd miss, no Triton kernel
and no Dynamo frame compiled (a Dynamo re-trace of flex would count there); ``refused`` lists calls the guard refused.

    python bench/checkpoint_threads.py --artifact A.kpack --modes reentrant,nonreentrant --runs 10 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

MODES = ("none", "none-nowarm", "reentrant", "nonreentrant", "both")


def child(
    artifact: str,
    mode: str,
    threads: int,
    cache: str,
    block_kind: str = "canonical",
    random_steps: int = 0,
    spread: bool = False,
) -> dict[str, Any]:
    import torch
    from torch.utils.checkpoint import checkpoint

    torch.cuda.init()
    from kernelpack import evidence, runtime
    from kernelpack.artifact import read_manifest
    from kernelpack.masks import block_mask_for

    configs = [c.config for c in read_manifest(artifact).configs if c.config.backward]
    gpus = torch.cuda.device_count() if spread else 1

    def device_of(i: int) -> str:  # --spread: thread i on cuda:i (one drafter per GPU)
        return f"cuda:{i % gpus}"

    def here() -> str:
        return device_of(int(threading.current_thread().name.split("-")[1]))

    models: list[Any] = []
    if block_kind == "tf":  # before activate(): the model's module registers pytree nodes (runtime's hint says why)
        models = tf_models(configs[0], [device_of(i) for i in range(threads if mode != "both" else 1)])
    t0 = time.perf_counter()
    activation = runtime.activate(artifact, cache_dir=cache, warmup=mode != "none-nowarm")
    activate_s = time.perf_counter() - t0

    def inputs(c: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator(device="cpu").manual_seed(0)
        device = here()

        def rand(h: int, n: int) -> torch.Tensor:
            return torch.randn(c.batch, h, n, c.head_dim, generator=g).to(device, getattr(torch, c.dtype))

        scale = torch.ones(c.head_dim, device=device, dtype=getattr(torch, c.dtype), requires_grad=True)
        return rand(c.q_heads, c.q_len).requires_grad_(), rand(c.kv_heads, c.kv_len).requires_grad_(), scale

    def block(xq: torch.Tensor, xkv: torch.Tensor, scale: torch.Tensor, bm: Any, gqa: bool) -> torch.Tensor:
        # elementwise "projections" keep q/k/v contiguous [B, H, S, D]: the canonical layout this artifact serves
        return runtime.flex_attention(xq * scale, xkv * scale, xkv + 0, block_mask=bm, enable_gqa=gqa)

    modules: dict[tuple[str, str], Any] = {}  # --block hf: each thread its own model, as each drafter has
    rngs: dict[str, random.Random] = {}
    lengths_seen: list[int] = []

    def step_one(c: Any, reentrant: bool | None) -> None:
        if block_kind == "tf":  # transformers builds the BlockMask (kernelpack's mask interface) every forward
            model = models[int(threading.current_thread().name.split("-")[1])]
            if reentrant is None:
                model.gradient_checkpointing_disable()
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            n = length = c.q_len
            if random_steps:  # --random-steps: a random length per step, padded to a bucket for a static artifact
                lo, hi = c.q_range or (min(x.q_len for x in configs), max(x.q_len for x in configs))
                name = threading.current_thread().name
                n = rngs.setdefault(name, random.Random(name)).randint(lo, hi)
                length = n if c.q_range else runtime.padded_length(n)
                lengths_seen.append(n)
            ids = torch.randint(0, model.config.vocab_size, (c.batch, length), device=here())
            labels = ids.clone()
            labels[:, n:] = -100  # padding: no loss, and causal attention keeps it out of the real tokens
            model(ids, labels=labels, use_cache=False).loss.backward()
            return
        if block_kind == "hf":  # bench/hf_block.py: projections seen through .transpose(1, 2), the user's own mask
            import hf_block

            key = (threading.current_thread().name, c.id)
            if key not in modules:
                modules[key] = hf_block.Attention(c, runtime.flex_attention, here())
            x = hf_block.hidden_states(c, here()).requires_grad_()
            hf_mask = hf_block.block_mask(c, here())  # torch's create_block_mask, rebuilt every step
            if reentrant is None:
                out = modules[key](x, hf_mask)
            else:
                out = checkpoint(modules[key], x, hf_mask, use_reentrant=reentrant)
            out.float().square().mean().backward()
            return
        xq, xkv, scale = inputs(c)
        bm = block_mask_for(c, here())  # rebuilt every step, as the drafters do
        if reentrant is None:
            out = block(xq, xkv, scale, bm, c.enable_gqa)
        else:
            out = checkpoint(block, xq, xkv, scale, bm, c.enable_gqa, use_reentrant=reentrant)
        out.float().square().mean().backward()

    errors: list[str] = []

    def worker(i: int, plan: list[tuple[Any, bool | None]]) -> None:
        try:
            for c, reentrant in plan[i % len(plan) :] + plan[: i % len(plan)]:
                step_one(c, reentrant)
            torch.cuda.synchronize(here())
        except BaseException as e:  # the benchmark records what a thread raised
            errors.append(f"{type(e).__name__}: {e}"[:2000])

    if mode == "both":
        n, plan = 1, [(c, r) for c in configs for r in (True, False)]
    else:
        n = threads
        plan = [(c, {"reentrant": True, "nonreentrant": False}.get(mode)) for c in configs]
    if random_steps:  # one config stands for the range (dynamic) or the buckets (padded_length picks each)
        plan = plan[:1] * random_steps

    def step() -> tuple[float, int]:
        ts = [threading.Thread(target=worker, args=(i, plan), name=f"drafter-{i}", daemon=True) for i in range(n)]
        start = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return time.perf_counter() - start, sum(t.is_alive() for t in ts)

    from torch._dynamo.utils import counters

    frames_before = counters["frames"]["ok"]
    before = evidence.snapshot()
    mark = evidence.next_seq()
    first, alive = step()
    second, _ = step()
    during = evidence.delta(before, evidence.snapshot())
    rep = runtime.report()
    return {
        "mode": mode,
        "block": block_kind,
        "threads": n,
        "configs": len(configs),
        "activate_s": activate_s,
        "warmup_s": rep.warmup_seconds,
        "install_s": activation.install.seconds if activation.install is not None else None,
        "warmup_calls": sum(c.warmup for c in rep.first_calls),
        # every covered signature's first call: the warm-up's, and the precompiled functions loaded at their first
        # call in the job's threads or on the autograd engine's (KERNELPACK_LOAD=lazy)
        "first_calls": len(rep.first_calls),
        "first_call_signatures": [c.signature.describe() for c in rep.first_calls],
        "first_call_graphs": [[c.warmup, c.signature.graph] for c in rep.first_calls],
        "first_compiled": [c.compiled for c in rep.first_calls if c.compiled],
        "warmup_call_s": [round(c.seconds, 3) for c in rep.first_calls if c.warmup],
        "warmup_compiled": [c.compiled for c in rep.first_calls if c.warmup and c.compiled],
        "first_step_s": first,
        "second_step_s": second,
        "alive": alive,
        "errors": errors,
        "refused": rep.to_dict()["refused"],
        "dynamo_frames_compiled": counters["frames"]["ok"] - frames_before,
        "during_steps": {k: v for k, v in during.items() if v},
        "compiled_during_steps": evidence.compiled_anything(during),
        # torch's own record of each compile during the steps (a re-trace served from the cache shows here too)
        "compiles_during_steps": [
            {**evidence.fields_of(r), "path": getattr(r.note, "path", None)} for r in evidence.compile_records(mark)
        ],
        "activation": activation.describe(),
        "lengths": sorted(lengths_seen),
        "devices": sorted({device_of(i) for i in range(n)}),
        "torch": torch.__version__,
    }


def tf_models(c: Any, devices: list[str]) -> list[Any]:
    """A transformers model per thread, on its device (each drafter has its own), of the attention the artifact
    serves."""
    import torch
    from transformers import MistralForCausalLM
    from transformers_step import TINY, config

    from kernelpack.integrations import transformers as hf

    hf.register()  # the name must be known when the model is built; activate() registers it again
    cfg = config(tiny=c.q_heads == TINY["num_attention_heads"])
    cfg._attn_implementation = "kernelpack"
    models = []
    for device in devices:
        torch.manual_seed(0)
        with torch.device(device):
            models.append(MistralForCausalLM(cfg).to(getattr(torch, c.dtype)).train())
    return models


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True)
    p.add_argument("--modes", default="none,none-nowarm,reentrant,nonreentrant,both")
    p.add_argument("--runs", type=int, default=10, help="fresh processes per mode")
    p.add_argument("--runs-for", default="", help="per-mode override, e.g. none=3,both=3")
    p.add_argument("--threads", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument(
        "--block",
        choices=("canonical", "hf", "tf"),
        default="canonical",
        help="canonical: contiguous q/k/v and kernelpack's masks; hf: bench/hf_block.py (needs a bshd artifact); "
        "tf: a transformers model (needs transformers_step.py's recipe)",
    )
    p.add_argument("--random-steps", type=int, default=0, help="--block tf: steps of random lengths per thread step")
    p.add_argument("--spread", action="store_true", help="thread i on cuda:i mod GPUs (needs a --devices artifact)")
    p.add_argument("--out", help="the JSON to write (required except in --child)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        try:
            cache = os.environ["KP_BENCH_CACHE"]
            result = child(args.artifact, args.child, args.threads, cache, args.block, args.random_steps, args.spread)
        except BaseException as e:
            result = {"mode": args.child, "crash": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(json.dumps(result), flush=True)
        os._exit(0)  # a stuck thread must not keep the process alive
    if not args.out:
        p.error("the following arguments are required: --out")
    runs_for = dict(kv.split("=") for kv in args.runs_for.split(",") if kv)
    results: dict[str, list[dict[str, Any]]] = {}
    for mode in args.modes.split(","):
        assert mode in MODES, mode
        results[mode] = []
        for i in range(int(runs_for.get(mode, args.runs))):
            with tempfile.TemporaryDirectory(prefix="kp-ckpt-") as tmp:
                env = dict(os.environ, KP_BENCH_CACHE=str(Path(tmp, "cache")))
                cmd = [sys.executable, __file__, "--artifact", args.artifact, "--threads", str(args.threads)]
                cmd += ["--block", args.block, "--random-steps", str(args.random_steps)]
                cmd += ["--spread"] if args.spread else []
                start = time.perf_counter()
                try:
                    proc = subprocess.run(
                        [*cmd, "--child", mode],
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=args.timeout,
                        check=False,
                    )
                    lines = proc.stdout.strip().splitlines()
                    r = json.loads(lines[-1]) if lines else {"crash": f"no output, rc {proc.returncode}"}
                    if "crash" in r or r.get("errors"):
                        r["stderr_tail"] = proc.stderr[-3000:]
                except subprocess.TimeoutExpired as e:
                    err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
                    r = {"mode": mode, "timeout": args.timeout, "stderr_tail": err[-3000:]}
                r["process_s"] = time.perf_counter() - start
            results[mode].append(r)
            ok = "timeout" not in r and "crash" not in r and not r.get("errors") and not r.get("refused")
            print(
                f"{mode:13s} run {i + 1}: {'ok  ' if ok else 'FAIL'} activate {r.get('activate_s', 0):6.2f} s  "
                f"first step {r.get('first_step_s', 0):6.2f} s  second {r.get('second_step_s', 0):5.2f} s  "
                f"compiled {r.get('compiled_during_steps')} frames {r.get('dynamo_frames_compiled')}"
                + ("" if ok else f"  {r.get('crash') or r.get('errors') or r.get('refused') or 'TIMEOUT'}"),
                flush=True,
            )
    summary = {}
    for mode, rs in results.items():
        good = [r for r in rs if "first_step_s" in r]

        def med(key: str, good: list[dict[str, Any]] = good) -> float | None:
            vals = [r[key] for r in good if r.get(key) is not None]
            return statistics.median(vals) if vals else None

        summary[mode] = {
            "runs": len(rs),
            "completed": sum(1 for r in good if not r["errors"] and not r["alive"]),
            "timeouts": sum("timeout" in r for r in rs),
            "with_compiles": sum(bool(r["compiled_during_steps"] or r["dynamo_frames_compiled"]) for r in good),
            "refused": sum(len(r["refused"]) for r in good),
            "activate_s": med("activate_s"),
            "warmup_s": med("warmup_s"),
            "first_step_s": med("first_step_s"),
            "second_step_s": med("second_step_s"),
        }
        print(mode, json.dumps(summary[mode]))
    Path(args.out).write_text(json.dumps({"summary": summary, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
