"""Threads that cold-compile flex at once, and the fix: N threads reach their first flex_attention call at once.

  raw         each thread's first call goes through a plain ``torch.compile(flex_attention, dynamic=False)`` with
              an empty cache dir (what the drafter did). Bounded by --timeout: a hang is reported as such.
  kernelpack  ``kernelpack.runtime.activate(ARTIFACT)`` in the main thread, then the same threads call
              ``kernelpack.flex_attention`` on covered configs.

Each mode runs in a fresh subprocess with its own empty TORCHINDUCTOR_CACHE_DIR. Thread i uses config i of the
artifact (cycling) on device ``cuda:(i % ndev)`` with --spread (one process driving several GPUs), else cuda:0.

    python bench/threads_first_step.py --artifact out/x.kpack --threads 3 --timeout 400 --out threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def steady_state(fn, work: list, calls: int, sync) -> dict[str, float]:
    """Every thread makes ``calls`` more calls at once; returns the wall time and, for the gated entry point, the most
    calls seen inside kernelpack's gate together (1 would mean the gate serializes steady-state calls)."""
    from torch.autograd import grad as torch_grad

    from kernelpack import compiled

    barrier = threading.Barrier(len(work) + 1)
    done = threading.Event()
    samples: list[int] = []

    def monitor() -> None:
        barrier.wait()
        while not done.is_set():
            samples.append(compiled.gate.readers)
            time.sleep(0.0002)

    def loop(i: int) -> None:
        c, device, q, k, v, dout, bm = work[i]
        barrier.wait()
        for _ in range(calls):
            out = fn(q, k, v, block_mask=bm, enable_gqa=c.enable_gqa)
            if dout is not None:
                torch_grad(out, (q, k, v), dout)
        sync(device)

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(len(work))]
    mon = threading.Thread(target=monitor)
    t0 = time.perf_counter()
    for t in [*workers, mon]:
        t.start()
    for t in workers:
        t.join()
    wall = time.perf_counter() - t0
    done.set()
    mon.join()
    return {"wall": wall, "max_inside_gate": max(samples, default=0)}


def child(mode: str, artifact: str, n_threads: int, spread: bool, result: str, steady: int) -> None:
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    from kernelpack import compiled, evidence, runtime
    from kernelpack.artifact import read_manifest
    from kernelpack.canonical import make_inputs
    from kernelpack.masks import block_mask_for

    configs = [c.config for c in read_manifest(artifact).configs]
    cuda = configs[0].device == "cuda"
    ndev = torch.cuda.device_count() if (cuda and spread) else 1
    if mode == "kernelpack":
        t = time.perf_counter()
        runtime.activate(artifact)
        activate_s = time.perf_counter() - t
        fn = runtime.flex_attention
    else:
        evidence.install_hooks()  # count compiles and dense calls, refuse nothing: observe torch as it is
        activate_s = 0.0
        fn = torch.compile(flex_attention, dynamic=False)
    work = []
    for i in range(n_threads):
        c = configs[i % len(configs)]
        device = f"cuda:{i % ndev}" if cuda else "cpu"
        q, k, v = make_inputs(c, device)
        dout = torch.randn_like(q) if c.backward else None
        work.append((c, device, q, k, v, dout, block_mask_for(c, device)))
    if cuda:
        for d in range(ndev):
            torch.cuda.synchronize(d)
    barrier = threading.Barrier(n_threads)
    results: dict[int, dict[str, object]] = {}
    before = evidence.snapshot()

    def worker(i: int) -> None:
        c, device, q, k, v, dout, bm = work[i]
        barrier.wait()
        t0 = time.perf_counter()
        try:
            out = fn(q, k, v, block_mask=bm, enable_gqa=c.enable_gqa)
            if dout is not None:
                torch.autograd.grad(out, (q, k, v), dout)
            if cuda:
                torch.cuda.synchronize(device)
            results[i] = {"ok": True, "seconds": time.perf_counter() - t0, "device": device, "config": c.describe()}
        except BaseException as e:  # the benchmark reports whatever torch raised
            results[i] = {
                "ok": False,
                "seconds": time.perf_counter() - t0,
                "device": device,
                "error": f"{type(e).__name__}: {str(e)[:300]}",
            }

    threads = [threading.Thread(target=worker, args=(i,), name=f"drafter-{i}", daemon=True) for i in range(n_threads)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {
        "mode": mode,
        "wall": time.perf_counter() - t0,
        "activate_s": activate_s,
        "threads": results,
        "counters": {k: v for k, v in evidence.delta(before, evidence.snapshot()).items() if v},
        "torch": torch.__version__,
    }
    if mode == "kernelpack":
        out["report"] = runtime.report().to_dict()
        if steady and not [r for r in results.values() if not r["ok"]]:
            # Same threads, same inputs: through the gate (kernelpack.flex_attention) and straight to the compiled
            # function it wraps. Equal walls mean steady-state calls do not queue behind each other in the gate.
            def sync(device: str) -> None:
                if cuda:
                    torch.cuda.synchronize(device)

            raw_fn = compiled.compiled_flex_attention()
            steady_state(raw_fn, work, 2, sync)  # warm both paths' per-thread state before timing
            steady_state(fn, work, 2, sync)
            out["steady"] = {
                "calls_per_thread": steady,
                "gated": [steady_state(fn, work, steady, sync) for _ in range(3)],
                "ungated": [steady_state(raw_fn, work, steady, sync) for _ in range(3)],
            }
    Path(result).write_text(json.dumps(out))


def run(mode: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="kp-threads-") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp, "cache")), PYTHONUNBUFFERED="1")
        env.pop("TRITON_CACHE_DIR", None)
        result = Path(tmp, "result.json")
        cmd = [
            sys.executable,
            __file__,
            "--child",
            mode,
            args.artifact,
            str(args.threads),
            "1" if args.spread else "0",
            str(result),
            str(args.steady),
        ]
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
        except subprocess.TimeoutExpired:
            return {
                "mode": mode,
                "outcome": f"no result within {args.timeout:.0f} s (hung)",
                "wall": time.perf_counter() - t,
            }
        if not result.exists():
            return {"mode": mode, "outcome": f"crashed (exit {proc.returncode})", "stderr": proc.stderr[-2000:]}
        data = json.loads(result.read_text())
        errors = [r for r in data["threads"].values() if not r["ok"]]
        data["outcome"] = "ok" if not errors else f"{len(errors)} thread(s) failed"
        return data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--threads", type=int, default=3)
    ap.add_argument("--spread", action="store_true", help="thread i on cuda:i (several GPUs)")
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--steady", type=int, default=0, help="then N steady-state calls per thread, gated vs ungated")
    ap.add_argument("--modes", default="raw,kernelpack")
    ap.add_argument("--out", default="threads_first_step.json")
    args = ap.parse_args()
    results = [run(m, args) for m in args.modes.split(",")]
    Path(args.out).write_text(json.dumps(results, indent=1))
    for r in results:
        print(f"{r['mode']}: {r['outcome']}; wall {r.get('wall', 0):.1f} s")
        for i, t in sorted(r.get("threads", {}).items()):
            print(f"  thread {i} {t['device']}: {'ok' if t['ok'] else t['error']} {t['seconds']:.2f} s")
        if "counters" in r:
            print("  counters:", r["counters"])
        if "report" in r:
            print("  kernelpack:", r["report"]["summary"])
        if "steady" in r:
            st = r["steady"]
            med = {k: sorted(x["wall"] for x in st[k])[1] for k in ("gated", "ungated")}
            inside = max(x["max_inside_gate"] for x in st["gated"])
            print(
                f"  steady state, {args.threads} threads x {st['calls_per_thread']} calls, median of 3: gated "
                f"{med['gated']:.3f} s, ungated {med['ungated']:.3f} s (x{med['gated'] / med['ungated']:.2f}); "
                f"up to {inside} calls inside the gate at once"
            )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6], int(sys.argv[7]))
    else:
        main()
