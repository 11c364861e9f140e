"""Runtime-guard scenarios, each run in a fresh process by tests/test_runtime.py (torch's state is process-wide).

python tests/runtime_scenarios.py SCENARIO ARTIFACT CACHE_DIR   -> prints one JSON line
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from typing import Any

import torch

import kernelpack
from kernelpack import compiled, runtime
from kernelpack.artifact import read_manifest
from kernelpack.errors import DenseFallbackError, NotPrecompiledError
from kernelpack.masks import block_mask_for
from kernelpack.recipe import Config
from kernelpack.workload import make_inputs


def configs(artifact: str) -> list[Config]:
    return [c.config for c in read_manifest(artifact).configs]


def call(config: Config, mask: Any = None) -> Any:
    q, k, v = make_inputs(config, "cpu")
    bm = mask if mask is not None else block_mask_for(config, "cpu")
    return kernelpack.flex_attention(q, k, v, block_mask=bm, enable_gqa=config.enable_gqa)


def threads(artifact: str, cache: str) -> dict[str, Any]:
    """4 threads x every config at once, first calls racing; repeated 20 times with Dynamo's memory cleared."""
    cs = configs(artifact)
    rounds = []
    for _ in range(20):
        torch._dynamo.reset()  # the next call is a true first call again (from the on-disk cache)
        runtime.deactivate()
        runtime.activate(artifact, cache_dir=cache)
        barrier = threading.Barrier(4)
        errors: list[str] = []

        def worker(i: int, barrier: threading.Barrier = barrier, errors: list[str] = errors) -> None:
            try:
                barrier.wait()
                for c in cs[i % len(cs) :] + cs[: i % len(cs)]:
                    call(c)
            except BaseException as e:
                errors.append(f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")

        ts = [threading.Thread(target=worker, args=(i,), name=f"worker-{i}") for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=300)
        rep = runtime.report()
        hits = sum(c.counters.get("inductor.fxgraph_cache_hit", 0) for c in rep.first_calls)
        rounds.append(
            {
                "errors": errors,
                "first_calls": len(rep.first_calls),
                "compiled": len(rep.compiled),
                "fx_hits": hits,
                "alive": sum(t.is_alive() for t in ts),
            }
        )
    return {"rounds": rounds, "configs": len(cs)}


def strict_uncovered(artifact: str, cache: str) -> dict[str, Any]:
    runtime.activate(artifact, cache_dir=cache)
    c = configs(artifact)[0]
    uncovered = Config.from_dict({**c.to_dict(), "q_len": c.q_len * 2, "kv_len": c.kv_len * 2})
    try:
        call(uncovered)
    except NotPrecompiledError as e:
        return {"error": str(e), "hint": e.hint, "compiled": len(runtime.report().compiled)}
    return {"error": None}


def non_strict(artifact: str, cache: str) -> dict[str, Any]:
    import warnings

    runtime.activate(artifact, cache_dir=cache, strict=False)
    c = configs(artifact)[0]
    uncovered = Config.from_dict({**c.to_dict(), "q_len": 128, "kv_len": 128})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call(uncovered)
        call(uncovered)
    rep = runtime.report()
    ours = [str(w.message) for w in caught if str(w.message).startswith("kernelpack:")]
    return {"warnings": ours, "first_calls": rep.to_dict()["first_calls"]}


def eager(artifact: str, cache: str) -> dict[str, Any]:
    from torch.nn.attention.flex_attention import flex_attention

    runtime.activate(artifact, cache_dir=cache)
    c = configs(artifact)[0]
    q, k, v = make_inputs(c, "cpu")
    try:
        flex_attention(q, k, v, block_mask=block_mask_for(c, "cpu"))
    except DenseFallbackError as e:
        return {"error": str(e), "bytes": e.score_bytes}
    return {"error": None}


def recompile_limit(artifact: str, cache: str) -> dict[str, Any]:
    """A plain torch.compile'd flex past Dynamo's recompile limit falls back to eager: the guard refuses it."""
    from torch.nn.attention.flex_attention import flex_attention

    runtime.activate(artifact, cache_dir=cache)
    raw = torch.compile(flex_attention, dynamic=False)
    torch._dynamo.config.recompile_limit = 1
    c = configs(artifact)[0]
    out: dict[str, Any] = {"error": None}
    for length in (64, 128):
        cc = Config.from_dict({**c.to_dict(), "q_len": length, "kv_len": length})
        q, k, v = make_inputs(cc, "cpu")
        try:
            raw(q, k, v, block_mask=block_mask_for(cc, "cpu"))
        except DenseFallbackError as e:
            out["error"] = str(e)
            out["at_length"] = length
    return out


def foreign_fx_trace(artifact: str, cache: str) -> dict[str, Any]:
    """Another thread sits inside torch.fx.symbolic_trace (torch's process-global tracing flag is set)."""
    from torch.nn.attention.flex_attention import flex_attention

    runtime.activate(artifact, cache_dir=cache)
    c = configs(artifact)[0]
    call(c)  # first call done: the next ones are steady-state
    entered, release = threading.Event(), threading.Event()

    def traced(x: Any) -> Any:
        entered.set()
        release.wait()
        return x + 1

    tracer = threading.Thread(target=lambda: torch.fx.symbolic_trace(traced))
    tracer.start()
    entered.wait()
    out: dict[str, Any] = {"flag_set": bool(torch.fx._symbolic_trace._is_fx_tracing_flag)}
    # 1. torch's own compiled flex, with the error suppressed as in the seeds: runs uncompiled -> refused
    torch._dynamo.config.error_on_nested_fx_trace = False
    raw = torch.compile(flex_attention, dynamic=False)
    q, k, v = make_inputs(c, "cpu")
    try:
        raw(q, k, v, block_mask=block_mask_for(c, "cpu"))
        out["raw"] = "ran"
    except DenseFallbackError as e:
        out["raw"] = f"DenseFallbackError: {e}"
    # 2. kernelpack's entry point waits for the trace to end instead of running dense
    threading.Timer(0.5, release.set).start()
    t = time.perf_counter()
    call(c)
    out["kernelpack_waited"] = time.perf_counter() - t
    tracer.join()
    out["dense_calls_refused"] = int(__import__("kernelpack.evidence").evidence.own["dense_calls"])
    return out


def overlap(artifact: str, cache: str) -> dict[str, Any]:
    """Steady-state calls from 4 threads hold the gate together: it does not serialize them. A monitor samples how
    many calls are inside the gate at once (times measured around the call would include waiting for the gate)."""
    runtime.activate(artifact, cache_dir=cache)
    big = configs(artifact)[0]
    call(big)
    q, k, v = make_inputs(big, "cpu")
    bm = block_mask_for(big, "cpu")
    barrier = threading.Barrier(5)
    done = threading.Event()
    samples: list[int] = []

    def monitor() -> None:
        barrier.wait()
        while not done.is_set():
            samples.append(compiled.gate.readers)
            time.sleep(0.0001)

    def worker() -> None:
        barrier.wait()
        for _ in range(200):
            kernelpack.flex_attention(q, k, v, block_mask=bm)

    mon = threading.Thread(target=monitor)
    ts = [threading.Thread(target=worker, name=f"t{i}") for i in range(4)]
    mon.start()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    done.set()
    mon.join()
    return {"max_inside": max(samples), "samples": len(samples), "first_calls": len(runtime.report().first_calls)}


def thread_config(artifact: str, cache: str) -> dict[str, Any]:
    """The recompile limit set by activate() in the main thread is in force in a worker thread after a call."""
    import torch._dynamo.config as dconfig

    runtime.activate(artifact, cache_dir=cache)
    seen: dict[str, int] = {}

    def worker() -> None:
        seen["before"] = dconfig.recompile_limit
        call(configs(artifact)[0])
        seen["after"] = dconfig.recompile_limit

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    return {**seen, "main": dconfig.recompile_limit, "floor": compiled.recompile_floor()}


if __name__ == "__main__":
    name, artifact, cache = sys.argv[1:4]
    try:
        result = globals()[name](artifact, cache)
    except BaseException as e:
        result = {"crash": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    print(json.dumps(result))
