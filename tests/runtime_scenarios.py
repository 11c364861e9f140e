"""Runtime-guard scenarios, each run in a fresh process by tests/test_runtime.py (torch's state is process-wide).

python tests/runtime_scenarios.py SCENARIO ARTIFACT CACHE_DIR   -> prints one JSON line
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import kernelpack
from kernelpack import compiled, runtime
from kernelpack.artifact import read_manifest
from kernelpack.canonical import make_inputs
from kernelpack.config import Config
from kernelpack.errors import DenseFallbackError, KernelpackError, NotPrecompiledError
from kernelpack.masks import block_mask_for

THREADS = torch.get_num_threads()  # as the process starts, as the builder's workers started


def configs(artifact: str) -> list[Config]:
    return [c.config for c in read_manifest(artifact).configs]


def call(config: Config, mask: Any = None) -> Any:
    q, k, v = make_inputs(config, "cpu")
    bm = mask if mask is not None else block_mask_for(config, "cpu")
    return kernelpack.flex_attention(q, k, v, block_mask=bm, enable_gqa=config.enable_gqa)


def threads(artifact: str, cache: str, warmup: bool = True) -> dict[str, Any]:
    """4 threads x every config at once, first calls racing (without warm-up; with it, activate() made them);
    repeated 20 times with Dynamo's memory cleared."""
    cs = configs(artifact)
    rounds = []
    for _ in range(20):
        torch._dynamo.reset()  # the next call is a true first call again (from the on-disk cache)
        runtime.deactivate()
        runtime.activate(artifact, cache_dir=cache, warmup=warmup)
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
                "warmup_calls": sum(c.warmup for c in rep.first_calls),
                "compiled": len(rep.compiled),
                "fx_hits": hits,
                "alive": sum(t.is_alive() for t in ts),
                "tiers": [c.tier for c in rep.first_calls],
                "tier1_why": sorted({why for _, why in rep.tier1}),
                "served": {t: sum(s[2] for s in rep.served if s[4] == t) for t in {s[4] for s in rep.served}},
            }
        )
    return {"rounds": rounds, "configs": len(cs)}


def threads_no_warmup(artifact: str, cache: str) -> dict[str, Any]:
    return threads(artifact, cache, warmup=False)


def strict_uncovered(artifact: str, cache: str) -> dict[str, Any]:
    runtime.activate(artifact, cache_dir=cache)
    c = configs(artifact)[0]
    uncovered = Config.from_dict({**c.to_dict(), "q_len": c.q_len * 2, "kv_len": c.kv_len * 2})
    out: dict[str, Any] = {"error": None}
    try:
        call(uncovered)
    except NotPrecompiledError as e:
        out = {"error": str(e), "hint": e.hint}
    window = c.window

    def reordered(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # the same meaning in another op order
        return (q_idx - kv_idx < window) & (q_idx >= kv_idx)

    q, k, v = make_inputs(c, "cpu")
    mask = kernelpack.masks.block_mask(reordered, c.q_len, c.kv_len, "cpu")
    try:
        kernelpack.flex_attention(q, k, v, block_mask=mask)
    except NotPrecompiledError as e:
        out["reordered"] = str(e)
    out["compiled"] = len(runtime.report().compiled)
    return out


def non_strict_no_warmup(artifact: str, cache: str) -> dict[str, Any]:
    import warnings

    runtime.activate(artifact, cache_dir=cache, strict=False, warmup=False)
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
    """A plain torch.compile'd flex past Dynamo's recompile limit falls back to eager: the guard refuses it. Its first
    call is a covered one (strict mode lets it compile); the next length is past the limit of 1."""
    from torch.nn.attention.flex_attention import flex_attention

    runtime.activate(artifact, cache_dir=cache)
    torch._dynamo.reset()  # whichever tier the warm-up used: no Dynamo entry for flex_attention's frame yet
    raw = torch.compile(flex_attention, dynamic=False)
    torch._dynamo.config.recompile_limit = 1
    c = configs(artifact)[0]
    out: dict[str, Any] = {"error": None}
    for length in (c.q_len, 64):
        cc = Config.from_dict({**c.to_dict(), "q_len": length, "kv_len": length})
        q, k, v = make_inputs(cc, "cpu")
        try:
            raw(q, k, v, block_mask=block_mask_for(cc, "cpu"))
        except DenseFallbackError as e:
            out["error"] = str(e)
            out["at_length"] = length
            break
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
    st = torch.fx._symbolic_trace
    out: dict[str, Any] = {
        # torch <= 2.13: the tracing flag is process-global; >= 2.14 it is the tracer thread's own (pytorch#168999),
        # and what other threads see is the module patcher, process-global on every release
        "flag_set": bool(st._is_fx_tracing_flag if hasattr(st, "_is_fx_tracing_flag") else st._get_is_fx_tracing()),
        "patcher_set": st.CURRENT_PATCHER is not None,
    }
    # 1. torch's own compiled flex, with the error suppressed as in the seeds: runs uncompiled -> refused
    torch._dynamo.config.error_on_nested_fx_trace = False
    raw = torch.compile(flex_attention, dynamic=False)
    q, k, v = make_inputs(c, "cpu")
    try:
        raw(q, k, v, block_mask=block_mask_for(c, "cpu"))
        out["raw"] = "ran"
    except DenseFallbackError as e:
        out["raw"] = f"DenseFallbackError: {e}"
    except Exception as e:  # what a cold compile under another thread's patcher raises (torch >= 2.14)
        out["raw"] = f"{type(e).__name__}: {str(e)[:300]}"
    # 2. kernelpack's entry point waits for the trace to end instead of running dense
    threading.Timer(0.5, release.set).start()
    t = time.perf_counter()
    call(c)
    out["kernelpack_waited"] = time.perf_counter() - t
    tracer.join()
    out["dense_calls_refused"] = int(__import__("kernelpack.evidence").evidence.own["dense_calls"])
    return out


def overlap(artifact: str, cache: str) -> dict[str, Any]:
    """Without warm-up, steady-state calls from 4 threads hold the gate together: it does not serialize them. A
    monitor samples how many calls are inside the gate at once (times measured around the call would include waiting
    for the gate), until it has seen two or 30 s have passed; the threads call at least 200 times each, and on until
    the monitor stops (on a loaded machine, pytest-xdist's other worker compiling, the monitor gets the GIL less
    often: a serializing gate never shows two at any rate). With warm-up, served calls do not enter the gate."""
    runtime.activate(artifact, cache_dir=cache, warmup=False)
    big = configs(artifact)[0]
    call(big)
    q, k, v = make_inputs(big, "cpu")
    bm = block_mask_for(big, "cpu")
    barrier = threading.Barrier(5)
    stop = threading.Event()
    samples: list[int] = []

    def monitor() -> None:
        barrier.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            samples.append(compiled.gate.readers)
            if samples[-1] >= 2:
                break
            time.sleep(0.0001)
        stop.set()

    def worker() -> None:
        barrier.wait()
        n = 0
        while n < 200 or not stop.is_set():
            kernelpack.flex_attention(q, k, v, block_mask=bm)
            n += 1

    mon = threading.Thread(target=monitor)
    ts = [threading.Thread(target=worker, name=f"t{i}") for i in range(4)]
    mon.start()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    mon.join()
    return {"max_inside": max(samples), "samples": len(samples), "first_calls": len(runtime.report().first_calls)}


def thread_config(artifact: str, cache: str) -> dict[str, Any]:
    """The recompile limit set by activate() in the main thread is in force in a worker thread after a call Dynamo
    serves."""
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


def not_warmed(artifact: str, cache: str) -> dict[str, Any]:
    """After the warm-up, in non-strict mode: calls Dynamo would trace are refused and explained, nothing compiles;
    the same call as the warm-up's, from another thread and with a freshly built BlockMask, is served."""
    from torch.nn.attention.flex_attention import create_block_mask

    runtime.activate(artifact, cache_dir=cache, strict=False)
    c = configs(artifact)[0]
    q, k, v = make_inputs(c, "cpu")
    out: dict[str, Any] = {}

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = "served"
        except KernelpackError as e:
            out[name] = {"type": type(e).__name__, "error": str(e), "hint": e.hint}

    # the recipe's mask function, a new BlockMask (as a job rebuilding it every step), another thread; the user's
    # own mask function computing the same graph is served with the warmed one in its place
    t = threading.Thread(target=attempt, args=("same_call", lambda: call(c)))
    t.start()
    t.join()
    window = c.window

    def own_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # the same meaning, in the user's own code
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    own = create_block_mask(own_mask, None, None, c.q_len, c.kv_len, device="cpu")
    attempt("own_mask", lambda: kernelpack.flex_attention(q, k, v, block_mask=own))

    def reordered(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # the same meaning in another op order
        return (q_idx - kv_idx < window) & (q_idx >= kv_idx)

    other_order = create_block_mask(reordered, None, None, c.q_len, c.kv_len, device="cpu")
    attempt("reordered", lambda: kernelpack.flex_attention(q, k, v, block_mask=other_order))

    def tagged(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # claims to be the built-in: covered by name
        return (q_idx - kv_idx < window) & (q_idx >= kv_idx)

    tagged.kernelpack_mask = c.mask_label  # type: ignore[attr-defined]
    imposter = create_block_mask(tagged, None, None, c.q_len, c.kv_len, device="cpu")
    attempt("other_code", lambda: kernelpack.flex_attention(q, k, v, block_mask=imposter))
    bshd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]  # proj(x).view(B,S,H,D).transpose
    attempt("transposed", lambda: kernelpack.flex_attention(*bshd, block_mask=block_mask_for(c, "cpu")))
    uncovered = Config.from_dict({**c.to_dict(), "q_len": 128, "kv_len": 128})
    attempt("uncovered", lambda: call(uncovered))
    # forward-only calls autograd does not record are served whatever their grad mode and requires_grad: inference
    # with grad mode on, and reentrant checkpointing's forward (no_grad on inputs that require grad)
    bm = block_mask_for(c, "cpu")
    rq, rk, rv = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.no_grad():
        attempt("no_grad_on_inputs_requiring_grad", lambda: kernelpack.flex_attention(rq, rk, rv, block_mask=bm))
    attempt("grad_mode_on", lambda: kernelpack.flex_attention(q, k, v, block_mask=bm))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # Dynamo guards on autocast: not what was warmed
        attempt("autocast", lambda: kernelpack.flex_attention(q, k, v, block_mask=bm))
    # an entry someone else compiled (another backend) for an uncovered call does not make it served
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    uq, uk, uv = make_inputs(uncovered, "cpu")
    ubm = block_mask_for(uncovered, "cpu")
    with torch.no_grad(), contextlib.suppress(DenseFallbackError):  # eager backend: dense, refused after compiling
        torch.compile(eager_flex, backend="eager")(uq, uk, uv, block_mask=ubm)
    frames = counters["frames"]["ok"]
    attempt("foreign_entry", lambda: kernelpack.flex_attention(uq, uk, uv, block_mask=ubm))
    out["frames_compiled_by_kernelpack"] = counters["frames"]["ok"] - frames
    rep = runtime.report()
    out["compiled"] = len(rep.compiled)
    out["first_calls"] = [(f.warmup, f.signature.graph) for f in rep.first_calls]
    out["refused"] = [why for _, why in rep.refused]
    out["summary"] = rep.summary()
    return out


def background(artifact: str, cache: str) -> dict[str, Any]:
    """activate(warmup="background") returns at once, having imported neither Dynamo nor inductor: its thread
    imports them while this one imports inductor's internals as a job's model code might (the cross-thread import
    cycle kernelpack._imports.importing_alone prevents); 3 threads call at once and wait for it, then are served."""
    from kernelpack import _imports, installer
    from kernelpack.runtime import warmup

    imported_by: dict[str, str] = {}
    switch_intervals = {"before": sys.getswitchinterval()}  # and while the start's thread imports Dynamo
    for name in ("torch._dynamo", "torch._inductor.codecache"):
        _imports.after_import(name, lambda m: imported_by.setdefault(m.__name__, threading.current_thread().name))
    _imports.after_import("torch._dynamo", lambda m: switch_intervals.setdefault("importing", sys.getswitchinterval()))
    # who writes the files (the install's child process, unless KERNELPACK_INSTALL_PROCESS=0) and whether inductor's
    # own torch_key is computed (not where kernelpack's reading of torch's sources matched the artifact's)
    extracted_here: list[str] = []
    extract, key = installer.extract, warmup.inductor_torch_key

    def counted_extract(*args: Any, **kwargs: Any) -> Any:
        extracted_here.append(threading.current_thread().name)
        return extract(*args, **kwargs)

    key_reads: list[str] = []

    def counted_key() -> str:
        key_reads.append(threading.current_thread().name)
        return key()

    installer.extract, warmup.inductor_torch_key = counted_extract, counted_key  # type: ignore[assignment]
    if os.environ.get("KERNELPACK_TEST_MISREAD"):  # a torch whose sources kernelpack would misread
        from kernelpack._torch import inductor

        inductor._source_key = functools.cache(lambda: "00" * 32)
    t0 = time.perf_counter()
    activation = runtime.activate(artifact, cache_dir=cache, warmup="background")
    returned = time.perf_counter() - t0
    assert activation.warmup is not None
    done_at_return = activation.warmup.done.is_set()
    from torch._inductor.utils import IndentedBuffer  # noqa: F401  (failed beside a background inductor import)

    errors: list[str] = []

    def worker() -> None:
        try:
            for c in configs(artifact):
                call(c)
        except BaseException as e:
            errors.append(f"{type(e).__name__}: {e}")

    ts = [threading.Thread(target=worker) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    rep = runtime.report()
    switch_intervals["after"] = sys.getswitchinterval()
    return {
        "returned": returned,
        "done_at_return": done_at_return,
        "switch_intervals": switch_intervals,
        "imported_by": imported_by,
        "install": activation.install is not None,
        "warmup_seconds": rep.warmup_seconds,
        "errors": errors,
        "first_calls": [(f.warmup, f.thread) for f in rep.first_calls],
        "compiled": len(rep.compiled),
        "extracted_here": extracted_here,
        "inductor_key_reads": key_reads,
        "installed": activation.install.written,
    }


def hf_block(artifact: str, cache: str) -> dict[str, Any]:
    """A model's attention as HF writes it (Linear projections seen through .view(B, S, H, D).transpose(1, 2), a
    scale, GQA), against an artifact built for that call (`[call] layout = "bshd"`): served, nothing
    compiles; the canonical contiguous call is refused, naming the layout."""
    runtime.activate(artifact, cache_dir=cache)
    c = configs(artifact)[0]
    hidden = 32

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(hidden, c.q_heads * c.head_dim)
            self.k_proj = torch.nn.Linear(hidden, c.kv_heads * c.head_dim)
            self.v_proj = torch.nn.Linear(hidden, c.kv_heads * c.head_dim)

        def forward(self, x: torch.Tensor, mask: Any) -> torch.Tensor:
            b, s, _ = x.shape
            q = self.q_proj(x).view(b, s, c.q_heads, c.head_dim).transpose(1, 2)
            k = self.k_proj(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
            v = self.v_proj(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
            softcap = None  # transformers' flex_attention_forward: a score_mod closure, an identity here

            def score_mod(score: Any, batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
                if softcap is not None:
                    score = softcap * torch.tanh(score / softcap)
                return score

            out = kernelpack.flex_attention(
                q, k, v, score_mod=score_mod, block_mask=mask, scale=c.scale, enable_gqa=True
            )
            return out.transpose(1, 2).reshape(b, s, -1)

    from torch.nn.attention.flex_attention import create_block_mask

    window = c.window

    def local_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # the user's own mask, in its own words
        causal = q_idx >= kv_idx
        near = q_idx - kv_idx < window
        return causal & near

    attention = Attention()
    mask = create_block_mask(local_causal, None, None, c.q_len, c.kv_len, device="cpu")
    x = torch.randn(c.batch, c.q_len, hidden)
    with torch.no_grad():  # compiled flex has no backward on CPU: inference
        out = attention(x, mask)
    rep = runtime.report()
    result: dict[str, Any] = {
        "out": list(out.shape),
        "compiled": len(rep.compiled),
        "refused": [why for _, why in rep.refused],
        "summary": rep.summary(),
        "compiles": [(r["path"], r["missed"]) for r in rep.to_dict()["compiles"]],
    }
    q, k, v = (t.contiguous() for t in make_inputs(c, "cpu"))
    try:
        score = kernelpack.masks.identity_score
        kernelpack.flex_attention(q, k, v, score_mod=score, block_mask=mask, scale=c.scale, enable_gqa=True)
        result["contiguous"] = "served"
    except NotPrecompiledError as e:
        result["contiguous"] = f"{e} | {e.hint}"
    return result


def code_paths(artifact: str, cache: str) -> dict[str, Any]:
    """Mismatch class x code path, after the warm-up. kernelpack's entry refuses naming the field; the user's own
    torch.compile(flex_attention) is refused before it compiles in strict mode, and in non-strict mode compiles,
    reported with the differing field and warned of once per call site; other compiled code and the dense path
    are reported with their site."""
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    c = configs(artifact)[0]
    window = c.window
    q, k, v = make_inputs(c, "cpu")
    bm = block_mask_for(c, "cpu")

    def reordered(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # the same meaning in another op order
        return (q_idx - kv_idx < window) & (q_idx >= kv_idx)

    def doubled(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score * 2

    short = Config.from_dict({**c.to_dict(), "q_len": 128, "kv_len": 128})
    sq, sk, sv = make_inputs(short, "cpu")
    bshd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    cases: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
        "layout": ((*bshd,), {"block_mask": bm}),
        "scale": ((q, k, v), {"block_mask": bm, "scale": 0.5}),
        "mask": ((q, k, v), {"block_mask": create_block_mask(reordered, None, None, c.q_len, c.kv_len, "cpu")}),
        "q_len": ((sq, sk, sv), {"block_mask": block_mask_for(short, "cpu")}),
        "score_mod": ((q, k, v), {"block_mask": bm, "score_mod": doubled}),
        "mask_dims": (
            (q, k, v),
            {"block_mask": kernelpack.masks.block_mask(bm.mask_mod, c.q_len, c.kv_len, "cpu", heads=2)},
        ),
        "alias": ((q, k, k), {"block_mask": bm}),  # one tensor as key and value
    }
    out: dict[str, Any] = {}

    def attempt(fn: Any, *args: Any, **kwargs: Any) -> str:
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                fn(*args, **kwargs)
            return f"served in {time.perf_counter() - t0:.1f} s"
        except Exception as e:  # what the user sees, whatever the type
            return f"{type(e).__name__}: {e} | {getattr(e, 'hint', '')}"

    runtime.activate(artifact, cache_dir=cache)  # strict
    user_compiled = torch.compile(torch_flex)
    for name, (args, kwargs) in cases.items():
        out[f"kernelpack/{name}"] = attempt(kernelpack.flex_attention, *args, **kwargs)
        out[f"torch.compile/{name}"] = attempt(user_compiled, *args, **kwargs)
    out["eager"] = attempt(torch_flex, q, k, v, block_mask=bm)
    out["covered"] = attempt(kernelpack.flex_attention, q, k, v, block_mask=bm)  # served: report().served
    rep = runtime.report().to_dict()
    out["strict"] = {"compiles": rep["compiles"], "dense": rep["dense"], "refused": len(rep["refused"])}
    sections = ("first_calls", "compiles", "refused", "dense", "served")
    out["keys"] = {"": sorted(rep)} | {k: sorted(rep[k][0]) for k in sections}

    runtime.activate(artifact, cache_dir=cache, strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        short_bshd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (sq, sk, sv)]
        short_bm = block_mask_for(short, "cpu")
        for args, mask in (((*bshd,), bm), ((*short_bshd,), short_bm)):  # two compiles at one call site
            out[f"torch.compile/layout (non-strict) {args[0].shape[2]}"] = attempt(
                user_compiled, *args, block_mask=mask
            )
        other = torch.compile(lambda x: torch.sin(x) * 2)
        other(torch.randn(8))
    out["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("kernelpack:")]
    rep = runtime.report().to_dict()
    out["non_strict"] = {"summary": rep["summary"], "compiles": rep["compiles"]}
    os.environ["KERNELPACK_PRECOMPILED"] = "0"  # tier 1 serves every warmed signature, each listed with why
    try:
        runtime.activate(artifact, cache_dir=cache)
        out["keys"]["inductor_cache_tier"] = sorted(runtime.report().to_dict()["inductor_cache_tier"][0])
    finally:
        del os.environ["KERNELPACK_PRECOMPILED"]
    return out


def key_settings(artifact: str, cache: str) -> dict[str, Any]:
    """A process whose inductor config differs from the builder's: strict activate() refuses naming the setting;
    non-strict warns; set back, it activates and is served."""
    import warnings

    out: dict[str, Any] = {}
    torch._inductor.config.max_autotune = True  # enters every FX-graph key
    torch.set_num_threads(max(1, torch.get_num_threads() - 1) if torch.get_num_threads() > 1 else 2)
    try:
        runtime.activate(artifact, cache_dir=cache)
        out["strict"] = "activated"
    except KernelpackError as e:
        out["strict"] = str(e)
    # a background start reads the settings in its thread, where reading them would import Dynamo: its first call
    # refuses (in a child process that imported neither config module); here both are imported, so it refuses at
    # activate() as the foreground start does
    try:
        runtime.activate(artifact, cache_dir=cache, warmup="background")
        out["background_activate"] = "activated"
    except KernelpackError as e:
        out["background_activate"] = str(e)
    out["background"] = background_settings_child(artifact, cache)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime.activate(artifact, cache_dir=cache, strict=False, warmup=False)
    out["warnings"] = [str(w.message) for w in caught if "inductor's cache keys" in str(w.message)]
    torch._inductor.config.max_autotune = False
    torch.set_num_threads(THREADS)
    runtime.activate(artifact, cache_dir=cache)
    call(configs(artifact)[0])
    out["summary"] = runtime.report().summary()
    return out


def background_settings_child(artifact: str, cache: str) -> str:
    """A fresh process that sets an inductor setting through the environment (no config module imported) and
    starts in the background: activate() returns, and its first guarded call refuses the mismatch."""
    child = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from runtime_scenarios import call, configs
from kernelpack import runtime
from kernelpack.errors import KernelpackError
runtime.activate({artifact!r}, cache_dir={cache!r})
assert "torch._inductor.config" not in sys.modules
try:
    call(configs({artifact!r})[0])
    print("served")
except KernelpackError as e:
    print(f"{{e}}\\n{{e.__cause__}}")
"""
    env = dict(os.environ, TORCHINDUCTOR_MAX_AUTOTUNE="1")
    done = subprocess.run(
        [sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    return done.stdout + done.stderr[-2000:]


def declared_call(artifact: str, cache: str) -> dict[str, Any]:
    """The call a recipe declares with [call] mask_dims and alias, made in the user's own words (torch's
    create_block_mask with a head dimension, one tensor as key and value): served, nothing compiles; the same call
    with a broadcast mask, or with a copy as value, is refused naming the field."""
    from torch.nn.attention.flex_attention import create_block_mask

    runtime.activate(artifact, cache_dir=cache)
    c = configs(artifact)[0]
    window = c.window

    def local(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    x = torch.randn(c.batch, c.q_heads, c.q_len, c.head_dim)
    kv = torch.randn(c.batch, c.kv_heads, c.kv_len, c.head_dim)
    per_head = create_block_mask(local, None, c.q_heads, c.q_len, c.kv_len, device="cpu")
    out: dict[str, Any] = {}
    for name, args, mask in (
        ("declared", (x, kv, kv), per_head),
        ("broadcast_mask", (x, kv, kv), create_block_mask(local, None, None, c.q_len, c.kv_len, device="cpu")),
        ("value_copy", (x, kv, kv.clone()), per_head),
    ):
        try:
            with torch.no_grad():
                kernelpack.flex_attention(*args, block_mask=mask)
            out[name] = "served"
        except NotPrecompiledError as e:
            out[name] = str(e)
    rep = runtime.report()
    out["summary"] = rep.summary()
    out["missed"] = len(rep.misses)
    return out


def document_mask(artifact: str, cache: str) -> dict[str, Any]:
    """A mask that closes over a tensor (document ids, per batch), from the recipe's factory module: every step
    builds a new closure over new ids with the same helper, as a data loader would. Served with nothing compiled,
    and computed with this step's ids (checked against dense attention). The user's own function with the same graph
    is refused, never served by the warmed closure (which holds the warm-up's example ids)."""
    import doc_masks  # the recipe's factory module, on PYTHONPATH
    from torch.nn.attention.flex_attention import create_block_mask

    runtime.activate(artifact, cache_dir=cache, strict=False)
    c = configs(artifact)[0]
    q, k, v = make_inputs(c, "cpu")
    out: dict[str, Any] = {"errors": []}
    softcap = 30.0

    def score_mod(score: Any, batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        # the user's own closure (transformers' words), computing what the recipe's score_mod factory computes
        return softcap * torch.tanh(score / softcap)

    for step in range(3):
        ids = torch.sort(torch.randint(0, 3 + step, (c.q_len,), generator=torch.Generator().manual_seed(step)))[0]
        mask_mod = doc_masks.same_document(ids.to(torch.int32))
        bm = create_block_mask(mask_mod, None, None, c.q_len, c.kv_len, device="cpu")
        with torch.no_grad():
            got = kernelpack.flex_attention(q, k, v, block_mask=bm, score_mod=score_mod)
        qi = torch.arange(c.q_len)[:, None]
        ki = torch.arange(c.kv_len)[None, :]
        dense = (ids[qi] == ids[ki]) & (qi >= ki)
        scores = softcap * torch.tanh(q @ k.transpose(-2, -1) / c.head_dim**0.5 / softcap)
        want = scores.masked_fill(~dense, float("-inf")).softmax(-1) @ v
        out["errors"].append(float((got - want).abs().max()))

    ids = torch.zeros(c.q_len, dtype=torch.int32)

    def own(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # the same graph, the user's own code
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    try:
        with torch.no_grad():
            own_bm = create_block_mask(own, None, None, c.q_len, c.kv_len, "cpu")
            kernelpack.flex_attention(q, k, v, block_mask=own_bm, score_mod=score_mod)
        out["own"] = "served"
    except KernelpackError as e:
        out["own"] = f"{type(e).__name__}: {e}"
    rep = runtime.report()
    out["summary"] = rep.summary()
    out["missed"] = len(rep.misses)
    return out


def evidence_edges(artifact: str, cache: str) -> dict[str, Any]:
    """What the per-compile records must not get wrong: a compile that bypasses the FX cache is a miss; a kernel
    built outside any compile is not charged to the next compile; torch._dynamo.reset() does not switch off strict
    mode's check of the user's own torch.compile(flex_attention)."""
    from torch._inductor.codecache import CppCodeCache
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    out: dict[str, Any] = {}
    runtime.activate(artifact, cache_dir=cache, strict=True)
    torch._dynamo.reset()  # clears every compile callback
    c = configs(artifact)[0]
    q, k, v = make_inputs(c, "cpu")
    bshd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    try:
        with torch.no_grad():
            torch.compile(torch_flex)(*bshd, block_mask=block_mask_for(c, "cpu"))
        out["after_reset"] = "compiled"
    except Exception as e:
        out["after_reset"] = f"{type(e).__name__}: {e}"

    runtime.activate(artifact, cache_dir=cache, strict=False, warmup=False)

    def g(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 3).cos()

    torch.compile(g)(torch.randn(16))  # compiled and cached
    torch._dynamo.reset()
    CppCodeCache.load('extern "C" int kernelpack_probe() { return 7; }')  # a C++ build outside any compile
    torch.compile(g)(torch.randn(16))  # an FX and AOTAutograd cache hit
    rep = runtime.report().to_dict()
    out["hit_after_cpp"] = [(r["fx_hits"], r["missed"], r["cpp_compiled"]) for r in rep["compiles"]][-1]

    torch._inductor.config.fx_graph_cache = False  # e.g. TORCHINDUCTOR_FX_GRAPH_CACHE=0 in the job's environment
    torch.compile(lambda x: (x.cos() * 5).sin())(torch.randn(16))
    rep = runtime.report().to_dict()
    last = rep["compiles"][-1]
    out["bypassed"] = {"missed": last["missed"], "compiled": last["compiled"], "summary": rep["summary"]}
    return out


TINY_MISTRAL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": 64,
    "max_position_embeddings": 512,
}


def transformers_model(artifact: str, cache: str) -> dict[str, Any]:
    """A transformers model with attn_implementation="kernelpack" after activate() (which registers the name,
    transformers being imported): its forward compiles nothing; its logits equal transformers' own flex_attention
    implementation and SDPA on the same weights."""
    from transformers import MistralConfig

    config = MistralConfig(**TINY_MISTRAL)

    def model(attn: str) -> Any:
        return _mistral(config, attn)

    from transformers import AttentionInterface, MistralForCausalLM  # noqa: F401  (the model's module: before)

    from kernelpack.integrations import transformers as hf

    runtime.activate(artifact, cache_dir=cache)
    calls: list[tuple[int, ...]] = []
    registered = AttentionInterface._global_mapping.get("kernelpack") is hf.attention

    def counted(module: Any, query: Any, *args: Any, **kwargs: Any) -> Any:  # proves the model called kernelpack
        calls.append(tuple(query.stride()))
        return hf.attention(module, query, *args, **kwargs)

    AttentionInterface.register("kernelpack", counted)
    ids = torch.randint(0, config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model("kernelpack")(ids, use_cache=False).logits
    rep = runtime.report()
    out: dict[str, Any] = {
        "registered_by_activate": registered,
        "calls": calls,
        "summary": rep.summary(),
        "missed": len(rep.misses),
        "refused": [why for _, why in rep.refused],
        "paths": sorted({r["path"] for r in rep.to_dict()["compiles"]}),
    }
    runtime.deactivate()  # transformers' own flex compiles: not this test's concern
    with torch.no_grad():
        sdpa = model("sdpa")(ids, use_cache=False).logits
        flex = model("flex_attention")(ids, use_cache=False).logits
    out["vs_sdpa"] = float((ours - sdpa).abs().max())
    # a pytree node type registered after activate() (importing a model module does it): Dynamo's guard on their
    # count is not kept (kernelpack._torch.dynamo.guard_filter), so the warmed graphs still serve
    runtime.activate(artifact, cache_dir=cache)

    class Late:
        pass

    torch.utils._pytree.register_pytree_node(Late, lambda x: ([], None), lambda _, __: Late())
    try:
        with torch.no_grad():
            model("kernelpack")(ids, use_cache=False)
        out["late_pytree"] = "served"
    except KernelpackError as e:
        out["late_pytree"] = str(e)
    runtime.deactivate()
    torch._dynamo.reset()  # the takeover below warms again
    out["vs_flex"] = float((ours - flex).abs().max())
    # register(takeover=True): a model that keeps attn_implementation="flex_attention" is served by kernelpack too
    hf.register(takeover=True)
    runtime.activate(artifact, cache_dir=cache)
    with torch.no_grad():
        taken = model("flex_attention")(ids, use_cache=False).logits
    rep = runtime.report()
    out["takeover"] = {
        "registered": AttentionInterface._global_mapping.get("flex_attention") is hf.attention,
        "missed": len(rep.misses),
        "vs_ours": float((taken - ours).abs().max()),
    }
    return out


def _mistral(config: Any, attn: str) -> Any:
    """The same weights whatever the attention implementation."""
    import copy

    from transformers import MistralForCausalLM

    torch.manual_seed(0)
    config = copy.deepcopy(config)
    config._attn_implementation = attn
    return MistralForCausalLM(config).eval()


def transformers_training(artifact: str, cache: str) -> dict[str, Any]:
    """A training step (forward + backward) of a transformers model with attn_implementation="kernelpack" after
    activate(), on the artifact's device: what it compiled; its loss and gradients against transformers' own
    flex_attention path on the same weights; and the first attention call's output and lse (through return_aux)
    against transformers' flex_attention_forward on the very same inputs."""
    from transformers import AttentionInterface, MistralConfig, MistralForCausalLM  # noqa: F401  (before activate)
    from transformers.integrations.flex_attention import flex_attention_forward

    from kernelpack import evidence
    from kernelpack.integrations import transformers as hf

    c = configs(artifact)[0]
    device = "cuda:0" if read_manifest(artifact).build_key.device_type == "cuda" else "cpu"
    dtype = getattr(torch, c.dtype)
    config = MistralConfig(**TINY_MISTRAL)
    runtime.activate(artifact, cache_dir=cache)
    first: list[Any] = []

    def keep_first(module: Any, query: Any, key: Any, value: Any, mask: Any, **kwargs: Any) -> Any:
        out, lse = hf.attention(module, query, key, value, mask, **kwargs)
        if not first:  # the inputs exactly as transformers passed them (views, strides), to replay on its own path
            first.append((module, query.detach(), key.detach(), value.detach(), mask, kwargs, out.detach(), lse))
        return out, lse

    AttentionInterface.register("kernelpack", keep_first)
    ids = torch.randint(0, config.vocab_size, (c.batch, c.q_len), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)

    def train_step(attn: str) -> tuple[float, dict[str, torch.Tensor]]:
        model = _mistral(config, attn).to(device, dtype).train()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return float(loss), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}

    mark = evidence.next_seq()
    loss, grads = train_step("kernelpack")
    # what compiled in the step; a precompiled function's first run (loaded at its first call, KERNELPACK_LOAD=lazy)
    # is one of torch's compile records too, with cache hits only: not a compile
    compiled = [r.code or "?" for r in evidence.compile_records(mark) if r.missed or r.failed]
    loads = [r for r in evidence.compile_records(mark) if getattr(r.note, "path", None) == runtime.LOAD_PATH]
    rep = runtime.report()
    runtime.deactivate()  # transformers' own flex path compiles: the reference, not what is measured
    ref_loss, ref_grads = train_step("flex_attention")
    module, q, k, v, mask, kwargs, out, lse = first[0]
    ref_out, ref_lse = flex_attention_forward(module, q, k, v, mask, **kwargs)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))

    return {
        "compiled_in_step": compiled,
        "loads_in_step": len(loads),
        "missed": len(rep.misses),
        "refused": [why for _, why in rep.refused],
        "paths": sorted({r["path"] for r in rep.to_dict()["compiles"]}),
        "query_stride": list(q.stride()),
        "loss": [loss, ref_loss],
        "grads": sorted(grads) == sorted(ref_grads),
        "grad_rel": max(rel(grads[n], ref_grads[n]) for n in ref_grads),
        "out_rel": rel(out, ref_out),
        "lse": None if lse is None else [str(lse.dtype), list(lse.shape)],
        "lse_rel": None if lse is None or ref_lse is None else rel(lse, ref_lse),
    }


def transformers_packed(artifact: str, cache: str) -> dict[str, Any]:
    """Packed sequences (position_ids that restart) in a batch of 2 through attn_implementation="kernelpack", no
    artifact (kernelpack compiles at the gate): each row's own documents, as SDPA computes them. transformers' packed
    mask reads the batch index, so the BlockMask must be per batch element."""
    from kernelpack.integrations import transformers as hf

    hf.register()
    config_ = __import__("transformers").MistralConfig(**{**TINY_MISTRAL, "sliding_window": None})
    s = 256
    ids = torch.randint(1, config_.vocab_size, (2, s), generator=torch.Generator().manual_seed(1))
    pos = torch.stack([torch.arange(s), torch.cat([torch.arange(100), torch.arange(s - 100)])])
    ours, sdpa = _mistral(config_, "kernelpack"), _mistral(config_, "sdpa")
    out = {}
    for name, p in (("packed", pos), ("flipped", pos.flip(0))):
        with torch.no_grad():
            d = ours(ids, position_ids=p, use_cache=False).logits - sdpa(ids, position_ids=p, use_cache=False).logits
        out[name] = [float(d[0].abs().max()), float(d[1].abs().max())]
    return out


class _Engine:
    """One executor thread standing in for the autograd engine's device thread, and a thread "A" whose compile needs
    it: a Dynamo compile-start callback in A (on CUDA, make_fx's ``torch.autograd.grad``) submits to the executor and
    waits, once the recompute is on the executor (``on_engine``)."""

    def __init__(self, artifact: str) -> None:
        c = configs(artifact)[0]
        self.q, self.k, self.v = make_inputs(c, "cpu")
        self.bm = block_mask_for(c, "cpu")
        self.uncovered = Config.from_dict({**c.to_dict(), "q_len": 128, "kv_len": 128})
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.on_engine, self.a_compiling = threading.Event(), threading.Event()
        torch._dynamo.callback.on_compile_start(self._a_compile_needs_the_engine)

    def _a_compile_needs_the_engine(self, *args: Any) -> None:
        if threading.current_thread().name == "A":
            self.a_compiling.set()
            self.on_engine.wait(30)
            self.executor.submit(lambda: None).result()

    def recompute(self) -> None:
        """The covered call a checkpoint recompute makes."""
        self.on_engine.set()
        kernelpack.flex_attention(self.q, self.k, self.v, block_mask=self.bm)


def background_timeout(artifact: str, cache: str) -> dict[str, Any]:
    """A call that waits longer than KERNELPACK_WARMUP_WAIT_SECONDS (set to 0.01 by the test) for a background
    warm-up raises instead of waiting on; after the warm-up the same call is served. Its inputs are made first: an
    import of torch's (its BlockMask's) would wait for the background start's imports instead, and then import
    beside them (kernelpack._imports.importing_alone)."""
    c = configs(artifact)[0]
    inputs, bm = make_inputs(c, "cpu"), block_mask_for(c, "cpu")
    runtime.activate(artifact, cache_dir=cache, warmup="background")
    try:
        runtime.flex_attention(*inputs, block_mask=bm)
        early = "served"
    except KernelpackError as e:
        early = f"{e} | {e.hint}"
    activation = runtime.active()
    assert activation is not None and activation.warmup is not None
    activation.warmup.done.wait(300)
    call(c)
    return {"early": early, "later": "served", "compiled": len(runtime.report().compiled)}


class _RunInBackward(torch.autograd.Function):
    """An identity whose backward runs a function: a stand-in for a checkpoint's recompute."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fn: Any) -> torch.Tensor:
        ctx.fn = fn
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.fn()
        return g, None


def _backward_running(fn: Any) -> None:
    """A backward pass (a graph task, as on the engine's thread) during which ``fn`` runs."""
    _RunInBackward.apply(torch.ones(1, requires_grad=True), fn).sum().backward()


def synthetic_engine(artifact: str, cache: str) -> dict[str, Any]:
    """The deadlock of threads + gradient checkpointing, with one executor thread standing in for the autograd
    engine's device thread (on CPU the engine runs backward in the calling thread, so the real cycle cannot form).

    Thread A makes a call that would compile (non-strict, not covered), and its compile needs the executor
    (:class:`_Engine`). Thread B runs backward through an autograd Function whose backward is handed to the executor
    and calls the guarded entry with a covered call (a checkpoint recompute). With the first-call gate of 58147ec, A
    holds the gate and waits for the executor, whose job waits at the gate for A: no progress, the threads are still
    alive after 60 s. With the warm-up, B's call is served without the gate and A is refused before compiling.
    """
    kwargs: dict[str, Any] = {"strict": False}
    if "warmup" in inspect.signature(runtime.activate).parameters:  # so that the same file runs against 58147ec
        kwargs["warmup"] = True
    runtime.activate(artifact, cache_dir=cache, **kwargs)
    engine = _Engine(artifact)
    out: dict[str, Any] = {}

    def thread_a() -> None:
        try:
            call(engine.uncovered)
            out["a"] = "compiled"
        except KernelpackError as e:
            out["a"] = type(e).__name__
        finally:
            engine.a_compiling.set()  # "compiling or done": B goes on either way

    def thread_b() -> None:
        engine.a_compiling.wait(60)
        _backward_running(lambda: engine.executor.submit(engine.recompute).result())  # handed to the "engine"
        out["b"] = "done"

    t0 = time.perf_counter()
    ts = [threading.Thread(target=thread_a, name="A", daemon=True), threading.Thread(target=thread_b, daemon=True)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=max(0.0, 60 - (time.perf_counter() - t0)))
    out["alive"] = sum(t.is_alive() for t in ts)
    out["seconds"] = time.perf_counter() - t0
    return out


def backward_wait(artifact: str, cache: str) -> dict[str, Any]:
    """Without warm-up, a call made inside a backward pass waits at the gate only KERNELPACK_BACKWARD_WAIT_SECONDS
    (set to 2 by the test) for another thread's first call, then raises: the synthetic cycle of `synthetic_engine`
    with the executor's job running inside a graph task, as the engine's is. It never hangs."""
    runtime.activate(artifact, cache_dir=cache, strict=False, warmup=False)
    engine = _Engine(artifact)
    out: dict[str, Any] = {}

    def recompute_in_backward() -> None:
        out["in_backward"] = compiled.in_backward()
        engine.recompute()

    def engine_job() -> None:
        try:
            _backward_running(recompute_in_backward)
            out["b"] = "done"
        except KernelpackError as e:
            out["b"] = str(e)
        out["b_seconds"] = time.perf_counter() - t0

    def thread_a() -> None:
        call(engine.uncovered)
        out["a"] = "compiled"

    t0 = time.perf_counter()
    a = threading.Thread(target=thread_a, name="A", daemon=True)
    a.start()
    engine.a_compiling.wait(60)
    job = engine.executor.submit(engine_job)
    job.result(timeout=60)
    # A's cold CPU compile takes 20-35 s alone and past 60 s on CI's two busy cores: A's join is generous, the
    # bound that matters is B's (it must be refused after the 2 s wait, not after A's compile).
    a.join(timeout=300)
    out["alive"] = int(a.is_alive())
    out["seconds"] = time.perf_counter() - t0
    return out


def random_lengths(artifact: str, cache: str) -> dict[str, Any]:
    """Strict activate() of a range artifact, then 24 calls at random real lengths (not multiples of 128):
    a dynamic range serves each as it is; buckets serve each padded at the end to runtime.padded_length(n), the
    padded keys masked out by masks.padded over a 0-d tensor and the padded query rows dropped. Each output is
    checked against the float64 reference at the real length; a length past the range is refused."""
    import dataclasses
    import random

    from kernelpack import evidence, masks
    from kernelpack.workload import reference_attention

    config = configs(artifact)[0]  # buckets: the others differ only in length
    runtime.activate(artifact, cache_dir=cache).wait()  # the records after the mark are the job's, not the start's
    mark = evidence.next_seq()
    rng = random.Random(0)
    lo, hi = config.q_range or (200, 700)
    errors, lengths, padded_to = [], [], []
    for _ in range(24):
        n = rng.randint(lo, hi)
        while n % 128 == 0:
            n = rng.randint(lo, hi)
        length = runtime.padded_length(n)
        real = dataclasses.replace(config, q_len=n, kv_len=n, padded=False, q_range=None, kv_range=None, dynamic=False)
        q, k, v = make_inputs(real, "cpu")
        if length != n:  # pad at the end (the values there are never read for a real row)
            q, k, v = (torch.cat([t, torch.randn(*t.shape[:2], length - n, t.shape[3])], dim=2) for t in (q, k, v))
        if config.layout == "bshd":
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        base = masks.BUILTIN[config.mask](config.window)
        mask_mod = masks.padded(base, torch.tensor(n, dtype=torch.int32)) if config.padded else base
        bm = masks.block_mask(mask_mod, length, length, "cpu")
        out = kernelpack.flex_attention(q, k, v, block_mask=bm, enable_gqa=config.enable_gqa, scale=config.scale)
        (ref,) = reference_attention(real, q[:, :, :n], k[:, :, :n], v[:, :, :n], None)
        errors.append(float((out[:, :, :n].double() - ref).norm() / ref.norm()))
        lengths.append(n)
        padded_to.append(length)
    refused = ""
    try:
        runtime.padded_length(hi + 2000)
    except KernelpackError as e:
        refused = str(e)
    beyond = ""
    try:  # one token past the range (or the largest bucket)
        n = max(c.q_range[1] if c.q_range else c.q_len for c in configs(artifact)) + 1
        q, k, v = (torch.randn(1, n, h, config.head_dim) for h in (config.q_heads, config.kv_heads, config.kv_heads))
        # in the recipe's layout: only the length differs from a covered call
        q, k, v = (t.transpose(1, 2) if config.layout == "bshd" else t.transpose(1, 2).contiguous() for t in (q, k, v))
        base = masks.BUILTIN[config.mask](config.window)
        mask_mod = masks.padded(base, torch.tensor(n, dtype=torch.int32)) if config.padded else base
        bm = masks.block_mask(mask_mod, n, n, "cpu")
        kernelpack.flex_attention(q, k, v, block_mask=bm, enable_gqa=config.enable_gqa, scale=config.scale)
    except NotPrecompiledError as e:
        beyond = str(e)
    # torch records a compile (cache hits only) for a precompiled function's first run: those loaded at their first
    # call are the load's (KERNELPACK_LOAD=lazy), not a compile of the job's; "missed" counts every record's misses
    records = [r for r in evidence.compile_records(mark) if getattr(r.tag, "path", None) != runtime.LOAD_PATH]
    report = runtime.report()
    return {
        "lengths": lengths,
        "padded_to": padded_to,
        "max_error": max(errors),
        "compiles": len(records),
        "fx_misses": sum(r.fx_misses or 0 for r in report.compiles),
        "missed": len(report.misses),
        "served": report.to_dict()["served"],
        "refused_length": refused,
        "beyond": beyond,
    }


if __name__ == "__main__":
    name, artifact, cache = sys.argv[1:4]
    try:
        result = globals()[name](artifact, cache)
    except BaseException as e:
        result = {"crash": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    print(json.dumps(result), flush=True)
    os._exit(0)  # threads a scenario proved stuck must not keep the process alive
