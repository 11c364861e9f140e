#!/usr/bin/env python
"""Race an FX trace in one thread against flex_attention calls in others, on the installed torch.

    python bench/fx_race.py --seconds 4 --out docs/data/fx-race/<torch-version>.json

Background: on torch <= 2.13, torch.fx's tracing flag (``torch.fx._symbolic_trace._is_fx_tracing_flag``) is a module
global, so while thread A is inside ``symbolic_trace`` / ``make_fx`` / a Dynamo compile (AOTAutograd runs make_fx), a
compiled call entered by thread B raises "Detected that you are using FX to symbolically trace a dynamo-optimized
function" or, with ``torch._dynamo.config.error_on_nested_fx_trace = False``, runs flex_attention uncompiled (its
dense path). torch >= 2.14 keeps that flag per thread (pytorch PR #168999); the module patcher that ``Tracer.trace``
installs (``CURRENT_PATCHER``: ``nn.Module.__call__``, ``nn.Module.__getattr__``, autowrapped ``math.*``) is still
process-global. This script measures what each of those still does to other threads.

Every scenario runs in a fresh child process (``--child``), so that global state one scenario leaves behind (a patch
never reverted, a flag left set) cannot leak into the next; the child reports what it left behind. The parent kills a
child that overruns its time limit and records that. Every loop is bounded in count and in time.

Scenarios (tracer thread x caller threads):
  none-flex       no tracer (the thread sleeps)                              x 2 callers of a warmed compiled flex
  symtrace-flex   symbolic_trace of a small module (submodule + math.sqrt)  x 2 callers of a warmed compiled flex
  makefx-flex     make_fx of a small function                                x 2 callers of a warmed compiled flex
  dynamo-flex     torch.compile of a fresh function each iteration (cold Dynamo trace + AOTAutograd make_fx)
                                                                             x 2 callers of a warmed compiled flex
  symtrace-modflex    symbolic_trace x 2 callers of an nn.Module whose forward calls the warmed compiled flex
  symtrace-modmath    symbolic_trace x 2 callers of an nn.Module doing plain tensor math with math.sqrt
  symtrace-modlinear  symbolic_trace x 2 callers of an nn.Module with an nn.Linear submodule and math.sqrt
  cold-symtrace   symbolic_trace x 1 caller making FIRST calls (cold Dynamo + AOT + Inductor compiles) of flex,
                  at L=256 then L=128 (retrying a failed call), then steady calls of both for `seconds`, the tracer
                  tracing until that caller is done
  cold-makefx     make_fx        x 1 caller making FIRST calls of flex
  cold-none       no tracer      x 1 caller making FIRST calls of flex (the baseline)
  symtrace-flexwait, makefx-flexwait, dynamo-flexwait, cold-symtrace-wait: as above, but each caller call first
                  waits (at most WAIT_LIMIT s) while foreign_trace_visible(): torch <= 2.13 the process-global
                  _is_fx_tracing_flag or CURRENT_PATCHER is set; torch >= 2.14 CURRENT_PATCHER is set
each with error_on_nested_fx_trace at its default ("default") and set False in the caller threads ("off");
torch._dynamo.config is per thread (a ContextVar) on these versions, so callers set it themselves.

Counted per scenario: iterations per thread, exceptions by type (with one example message), dense-path flex calls
(the HOP's CompositeExplicitAutograd kernel called on real, non-fake tensors), outputs that differ from the reference,
tracer graphs whose (op, target) node list differs from the one traced alone before the race, Dynamo recompiles
(the "recompiles" log, by thread), and the state left behind (patched Module.__call__/__getattr__/math.sqrt,
CURRENT_PATCHER, the tracing flag) with a compiled call and a module call made in the main thread afterwards.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types

SCENARIOS = {
    # name: (tracer kind, caller kind); tracer "none" sleeps: the baselines
    "none-flex": ("none", "flex"),
    "symtrace-flex": ("symtrace", "flex"),
    "makefx-flex": ("makefx", "flex"),
    "dynamo-flex": ("dynamo", "flex"),
    "symtrace-modflex": ("symtrace", "modflex"),
    "symtrace-modmath": ("symtrace", "modmath"),
    "symtrace-modlinear": ("symtrace", "modlinear"),
    "cold-symtrace": ("symtrace", "cold"),
    "cold-makefx": ("makefx", "cold"),
    "cold-none": ("none", "cold"),
    # callers that first wait (bounded) while another thread's trace is visible: see foreign_trace_visible()
    "symtrace-flexwait": ("symtrace", "flexwait"),
    "makefx-flexwait": ("makefx", "flexwait"),
    "dynamo-flexwait": ("dynamo", "flexwait"),
    "cold-symtrace-wait": ("symtrace", "coldwait"),
}
WAIT_LIMIT = 2.0  # seconds a waiting caller waits before calling anyway
MAX_COLD_ATTEMPTS = 30  # first-call attempts per length, on top of --cold-timeout
NESTED = ("default", "off")
MAX_ITERS = 200_000  # per thread, on top of the time bound
MAX_DYNAMO_TRACES = 400  # fresh code objects compiled by the dynamo tracer, on top of the time bound
B, H, L, D = 1, 2, 256, 64
WINDOW = 64
ATOL = RTOL = 1e-4


# ---------------------------------------------------------------------------------------------------------------
# child: one scenario, one setting
# ---------------------------------------------------------------------------------------------------------------


class Stats:
    """Counts for one thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.iterations = 0
        self.ok = 0
        self.errors: dict[str, dict] = {}
        self.wrong_outputs = 0
        self.wrong_example: str | None = None
        self.graph_anomalies = 0
        self.graph_example: dict | None = None
        self.extra: dict = {}
        self.finished = False
        self.seconds = 0.0

    def error(self, exc: BaseException) -> None:
        key = type(exc).__module__ + "." + type(exc).__qualname__
        slot = self.errors.setdefault(key, {"count": 0, "example": None})
        slot["count"] += 1
        if slot["example"] is None:
            msg = str(exc).strip().splitlines()
            tb = traceback.extract_tb(exc.__traceback__)
            cause = exc.__cause__ or exc.__context__
            slot["example"] = {
                "message": " | ".join(line for line in msg[:3] if line.strip())[:500],
                "cause": f"{type(cause).__name__}: {str(cause).strip()[:300]}" if cause is not None else None,
                "raised_at": [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in tb[-4:]],
            }

    def wrong(self, why: str) -> None:
        self.wrong_outputs += 1
        if self.wrong_example is None:
            self.wrong_example = why[:400]

    def as_dict(self) -> dict:
        return {
            "iterations": self.iterations,
            "ok": self.ok,
            "errors": self.errors,
            "wrong_outputs": self.wrong_outputs,
            "wrong_example": self.wrong_example,
            "graph_anomalies": self.graph_anomalies,
            "graph_example": self.graph_example,
            "finished": self.finished,
            "seconds": round(self.seconds, 3),
            **self.extra,
        }


def run_child(scenario: str, nested: str, seconds: float, cold_timeout: float) -> dict:
    import logging

    import torch
    import torch.fx
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx import _symbolic_trace as st
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    tracer_kind, caller_kind = SCENARIOS[scenario]
    t_setup = time.monotonic()
    result: dict = {"scenario": scenario, "nested": nested, "tracer": tracer_kind, "caller": caller_kind}

    orig_call = torch.nn.Module.__call__
    orig_getattr = torch.nn.Module.__getattr__
    orig_sqrt = math.sqrt

    def foreign_trace_visible() -> bool:
        """What a runtime can read before a call: torch <= 2.13 the process-global flag or the patcher; torch >=
        2.14 the (process-global) patcher only, since the flag is per thread. Callers never trace themselves."""
        patching = getattr(st, "CURRENT_PATCHER", None) is not None
        if hasattr(st, "_is_fx_tracing_flag"):
            return bool(st._is_fx_tracing_flag) or patching
        return patching

    def wait_for_foreign(s: Stats) -> None:
        if not foreign_trace_visible():
            return
        t0 = time.monotonic()
        s.extra["waits"] = s.extra.get("waits", 0) + 1
        while foreign_trace_visible():
            if time.monotonic() - t0 > WAIT_LIMIT:
                s.extra["wait_timeouts"] = s.extra.get("wait_timeouts", 0) + 1
                break
            time.sleep(0.0002)
        s.extra["waited_seconds"] = round(s.extra.get("waited_seconds", 0.0) + time.monotonic() - t0, 4)

    def tracing_flag_here() -> bool:
        if hasattr(st, "_is_fx_tracing_flag"):
            return bool(st._is_fx_tracing_flag)
        return bool(st._get_is_fx_tracing())

    # -- dense-path counter: the HOP's eager kernel, on real tensors -------------------------------------------
    from torch._C import DispatchKey
    from torch._higher_order_ops.flex_attention import flex_attention as flex_hop

    dense_lock = threading.Lock()
    dense_by_thread: dict[str, int] = {}
    dense_key = DispatchKey.CompositeExplicitAutograd
    dense_orig = flex_hop.py_kernels[dense_key]

    def dense_counting(*args, **kwargs):
        query = args[0] if args else kwargs.get("query")
        if not isinstance(query, FakeTensor):
            name = threading.current_thread().name
            with dense_lock:
                dense_by_thread[name] = dense_by_thread.get(name, 0) + 1
        return dense_orig(*args, **kwargs)

    flex_hop.py_kernels[dense_key] = dense_counting
    flex_hop._dispatch_cache.clear()

    # -- recompiles, by thread ---------------------------------------------------------------------------------
    torch._logging.set_logs(recompiles=True)
    recompiles: dict[str, int] = {}
    recompile_examples: list[str] = []
    limit_hits: list[str] = []

    class RecompileHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            try:
                msg = record.getMessage()
            except Exception:
                msg = str(record.msg)
            name = threading.current_thread().name
            if "recompile_limit" in msg or "cache_size_limit" in msg:
                limit_hits.append(f"[{name}] {msg.strip().splitlines()[0][:300]}")
                return
            if record.name.endswith("__recompiles"):
                recompiles[name] = recompiles.get(name, 0) + 1
                if len(recompile_examples) < 3:
                    recompile_examples.append(f"[{name}] " + " | ".join(msg.strip().splitlines()[:4])[:500])

    handler = RecompileHandler(level=logging.DEBUG)
    logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(handler)
    logging.getLogger("torch._dynamo").addHandler(handler)

    # -- inputs, masks, references -----------------------------------------------------------------------------
    torch.manual_seed(0)

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

    def inputs(length: int):
        g = torch.Generator().manual_seed(length)
        qkv = [torch.randn(B, H, length, D, generator=g) for _ in range(3)]
        bm = create_block_mask(sliding, None, None, length, length, device="cpu")
        return qkv, bm

    compiled = torch.compile(flex_attention, dynamic=False)
    (q, k, v), bm = inputs(L)

    def close(out, ref) -> str | None:
        if not isinstance(out, torch.Tensor) or isinstance(out, FakeTensor):
            return f"output is {type(out).__name__}, not a real tensor"
        if out.shape != ref.shape:
            return f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
        if not torch.allclose(out, ref, atol=ATOL, rtol=RTOL):
            return f"max abs diff {(out - ref).abs().max().item():.3e}"
        return None

    # eager (dense) reference; also checks that the dense counter counts
    eager_ref = flex_attention(q, k, v, block_mask=bm)
    result["dense_counter_selftest"] = sum(dense_by_thread.values())
    dense_by_thread.clear()

    ref = eager_ref
    if caller_kind in ("flex", "modflex", "flexwait"):
        t0 = time.monotonic()
        ref = compiled(q, k, v, block_mask=bm)
        compiled(q, k, v, block_mask=bm)
        result["warmup_seconds"] = round(time.monotonic() - t0, 2)
        result["warmup_dense_calls"] = sum(dense_by_thread.values())
        result["compiled_vs_dense_max_abs_diff"] = (ref - eager_ref).abs().max().item()
        dense_by_thread.clear()
    cold_lengths = [256, 128]
    cold = caller_kind in ("cold", "coldwait")
    cold_inputs = {n: inputs(n) for n in cold_lengths} if cold else {}
    cold_refs = {n: flex_attention(*qkv, block_mask=m) for n, (qkv, m) in cold_inputs.items()}
    dense_by_thread.clear()

    # -- caller modules ----------------------------------------------------------------------------------------
    class FlexMod(nn.Module):
        def forward(self, q, k, v):
            return compiled(q, k, v, block_mask=bm)

    class MathMod(nn.Module):
        def forward(self, x):
            return x * math.sqrt(x.shape[-1]) + x.sin()

    class LinearMod(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return self.lin(x) / math.sqrt(x.shape[-1])

    x_mod = torch.randn(4, D)
    mods = {"modflex": FlexMod(), "modmath": MathMod(), "modlinear": LinearMod()}
    mod_refs = {"modflex": ref, "modmath": mods["modmath"](x_mod), "modlinear": mods["modlinear"](x_mod)}

    # -- tracer targets and the graphs they give alone ---------------------------------------------------------
    class Inner(nn.Module):
        def forward(self, x):
            return x.relu()

    class TraceMe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.inner = Inner()

        def forward(self, x):
            y = self.inner(self.lin(x))
            return y * math.sqrt(y.shape[-1])

    trace_root = TraceMe()
    x_small = torch.randn(3, 8)

    def makefx_target(x):
        return (x.sin() * 2 + x.cos()).sum(-1)

    def node_list(gm) -> list[str]:
        return [f"{n.op}:{getattr(n.target, '__name__', n.target)}" for n in gm.graph.nodes]

    expected_nodes = None
    if tracer_kind == "symtrace":
        expected_nodes = node_list(torch.fx.symbolic_trace(trace_root))
    elif tracer_kind == "makefx":
        expected_nodes = node_list(make_fx(makefx_target)(x_small))
    result["tracer_expected_nodes"] = expected_nodes

    def dyn_base(x):
        return (x.sin() * 2 + x.cos()).sum(-1)

    dyn_ref = dyn_base(x_small)

    # -- threads -----------------------------------------------------------------------------------------------
    stop = threading.Event()
    callers_done = threading.Event()
    start_barrier = threading.Barrier(2 if cold else 3)
    stats: dict[str, Stats] = {}

    def set_nested() -> bool:
        if nested == "off":
            torch._dynamo.config.error_on_nested_fx_trace = False
        return bool(torch._dynamo.config.error_on_nested_fx_trace)

    def tracer_loop(s: Stats) -> None:
        s.extra["error_on_nested_fx_trace_seen"] = bool(torch._dynamo.config.error_on_nested_fx_trace)
        start_barrier.wait(timeout=60)
        t0 = time.monotonic()
        # cold callers: keep tracing while their compiles run, then for `seconds` more; bounded by cold_timeout
        hard = t0 + (cold_timeout + seconds if cold else seconds)
        n_dyn = 0
        while not stop.is_set() and time.monotonic() < hard and s.iterations < MAX_ITERS:
            if not cold and time.monotonic() - t0 >= seconds:
                break
            if cold and callers_done.is_set():
                break
            s.iterations += 1
            try:
                if tracer_kind == "none":
                    time.sleep(0.001)
                    got = None
                elif tracer_kind == "symtrace":
                    gm = torch.fx.symbolic_trace(trace_root)
                    got = node_list(gm)
                elif tracer_kind == "makefx":
                    gm = make_fx(makefx_target)(x_small)
                    got = node_list(gm)
                else:  # dynamo: a fresh code object each time, so each compile is a cold Dynamo trace
                    if n_dyn >= MAX_DYNAMO_TRACES:
                        break
                    n_dyn += 1
                    fn = types.FunctionType(dyn_base.__code__.replace(co_name=f"dyn_{n_dyn}"), dyn_base.__globals__)
                    out = torch.compile(fn, backend=DYNAMO_BACKEND, dynamic=False)(x_small)
                    got = None
                    why = close(out, dyn_ref)
                    if why:
                        s.wrong(why)
                if got is not None and got != expected_nodes:
                    s.graph_anomalies += 1
                    if s.graph_example is None:
                        s.graph_example = {"expected": expected_nodes, "got": got}
                s.ok += 1
            except Exception as e:
                s.error(e)
        s.seconds = time.monotonic() - t0
        s.finished = True

    def caller_loop(s: Stats) -> None:
        s.extra["error_on_nested_fx_trace_seen"] = set_nested()
        start_barrier.wait(timeout=60)
        t0 = time.monotonic()
        deadline = t0 + seconds
        mod = mods.get(caller_kind)
        while time.monotonic() < deadline and s.iterations < MAX_ITERS and not stop.is_set():
            s.iterations += 1
            try:
                if caller_kind in ("flex", "flexwait"):
                    if caller_kind == "flexwait":
                        wait_for_foreign(s)
                    out = compiled(q, k, v, block_mask=bm)
                    expect = ref
                elif caller_kind == "modflex":
                    out = mod(q, k, v)
                    expect = ref
                else:
                    out = mod(x_mod)
                    expect = mod_refs[caller_kind]
                why = close(out, expect)
                if why:
                    s.wrong(why)
                else:
                    s.ok += 1
            except Exception as e:
                s.error(e)
        s.seconds = time.monotonic() - t0
        s.finished = True

    def cold_caller_loop(s: Stats) -> None:
        s.extra["error_on_nested_fx_trace_seen"] = set_nested()
        start_barrier.wait(timeout=60)
        t0 = time.monotonic()
        hard = t0 + cold_timeout
        first_calls = []
        try:
            for n in cold_lengths:
                (cq, ck, cv), cm = cold_inputs[n]
                attempts = 0
                entry: dict = {"length": n}
                t_first = time.monotonic()
                while time.monotonic() < hard and attempts < MAX_COLD_ATTEMPTS and not stop.is_set():
                    attempts += 1
                    s.iterations += 1
                    t1 = time.monotonic()
                    dense_before = dense_by_thread.get(s.name, 0)
                    try:
                        if caller_kind == "coldwait":
                            wait_for_foreign(s)
                        out = compiled(cq, ck, cv, block_mask=cm)
                    except Exception as e:
                        s.error(e)
                        time.sleep(0.001)
                        continue
                    entry["call_seconds"] = round(time.monotonic() - t1, 2)
                    entry["seconds_to_success"] = round(time.monotonic() - t_first, 2)
                    entry["dense_calls_in_first_call"] = dense_by_thread.get(s.name, 0) - dense_before
                    entry["wrong"] = close(out, cold_refs[n])
                    break
                entry["attempts"] = attempts
                entry["succeeded"] = "call_seconds" in entry
                first_calls.append(entry)
            s.extra["first_calls"] = first_calls
            s.extra["tracer_iterations_during_first_calls"] = stats["tracer"].iterations
            # then steady state on what those compiles left, for `seconds`, the tracer still tracing
            deadline = time.monotonic() + seconds
            steady = Stats("steady")
            while time.monotonic() < deadline and steady.iterations < MAX_ITERS and not stop.is_set():
                for n in cold_lengths:
                    (cq, ck, cv), cm = cold_inputs[n]
                    steady.iterations += 1
                    try:
                        if caller_kind == "coldwait":
                            wait_for_foreign(steady)
                        why = close(compiled(cq, ck, cv, block_mask=cm), cold_refs[n])
                        if why:
                            steady.wrong(why)
                        else:
                            steady.ok += 1
                    except Exception as e:
                        steady.error(e)
            s.extra["steady_after_first_calls"] = steady.as_dict()
        finally:
            callers_done.set()
            s.seconds = time.monotonic() - t0
            s.finished = True

    threads = []
    stats["tracer"] = Stats("tracer")
    threads.append(threading.Thread(target=tracer_loop, args=(stats["tracer"],), name="tracer", daemon=True))
    if cold:
        stats["caller0"] = Stats("caller0")
        threads.append(threading.Thread(target=cold_caller_loop, args=(stats["caller0"],), name="caller0", daemon=True))
    else:
        for i in range(2):
            stats[f"caller{i}"] = Stats(f"caller{i}")
            threads.append(
                threading.Thread(target=caller_loop, args=(stats[f"caller{i}"],), name=f"caller{i}", daemon=True)
            )
    frames_before = dict(torch._dynamo.utils.counters["frames"])
    recompiles.clear()
    recompile_examples.clear()
    limit_hits.clear()
    result["setup_seconds"] = round(time.monotonic() - t_setup, 2)
    t_run = time.monotonic()
    for t in threads:
        t.start()
    join_by = time.monotonic() + (cold_timeout + 2 * seconds + 30 if cold else 2 * seconds + 60)
    for t in threads:
        t.join(timeout=max(0.0, join_by - time.monotonic()))
    stop.set()
    for t in threads:
        t.join(timeout=10)
    result["run_seconds"] = round(time.monotonic() - t_run, 2)
    result["threads_still_running"] = [t.name for t in threads if t.is_alive()]
    frames_after = dict(torch._dynamo.utils.counters["frames"])
    result["dynamo_frames_during_run"] = {k: frames_after.get(k, 0) - frames_before.get(k, 0) for k in frames_after}

    result["threads"] = {name: s.as_dict() for name, s in stats.items()}
    result["dense_calls_by_thread"] = dict(dense_by_thread)
    result["recompiles_by_thread"] = dict(recompiles)
    result["recompile_examples"] = recompile_examples
    result["recompile_limit_hits"] = limit_hits[:5]
    result["recompile_limit_hit_count"] = len(limit_hits)

    # -- what the race left behind -----------------------------------------------------------------------------
    left = {
        "Module.__call__patched": torch.nn.Module.__call__ is not orig_call,
        "Module.__getattr__patched": torch.nn.Module.__getattr__ is not orig_getattr,
        "math.sqrt_patched": math.sqrt is not orig_sqrt,
        "CURRENT_PATCHER_set": getattr(st, "CURRENT_PATCHER", None) is not None,
        "tracing_flag_set_main_thread": tracing_flag_here(),
        # torch.compiler._is_compiling_flag: process-global on 2.13-2.15, set by every Dynamo compile session
        "is_compiling_set_main_thread": bool(torch.compiler.is_compiling()),
    }
    dense_before = sum(dense_by_thread.values())
    try:
        if caller_kind in ("flex", "modflex", "flexwait"):
            left["compiled_call_after"] = close(compiled(q, k, v, block_mask=bm), ref) or "ok"
        elif cold:
            (cq, ck, cv), cm = cold_inputs[L]
            left["compiled_call_after"] = close(compiled(cq, ck, cv, block_mask=cm), cold_refs[L]) or "ok"
    except Exception as e:
        left["compiled_call_after"] = f"{type(e).__name__}: {str(e)[:200]}"
    left["dense_calls_in_compiled_call_after"] = sum(dense_by_thread.values()) - dense_before
    try:
        left["module_call_after"] = close(mods["modlinear"](x_mod), mod_refs["modlinear"]) or "ok"
    except Exception as e:
        left["module_call_after"] = f"{type(e).__name__}: {str(e)[:200]}"
    result["left_behind"] = left
    return result


DYNAMO_BACKEND = "aot_eager"


def child_main(args: argparse.Namespace) -> None:
    import faulthandler

    global DYNAMO_BACKEND
    DYNAMO_BACKEND = args.dynamo_backend
    faulthandler.dump_traceback_later(args.child_timeout - 5, exit=False)
    try:
        res = run_child(args.child, args.nested, args.seconds, args.cold_timeout)
        res["status"] = "ran"
    except Exception as e:
        res = {"scenario": args.child, "nested": args.nested, "status": "setup_failed", "error": traceback.format_exc()}
        print(f"setup failed: {e}", file=sys.stderr)
    with open(args.child_out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # daemon threads may still be inside a compile; do not wait for them


# ---------------------------------------------------------------------------------------------------------------
# parent
# ---------------------------------------------------------------------------------------------------------------


def summarize_errors(threads: dict, names: list[str]) -> str:
    agg: dict[str, int] = {}
    for n in names:
        for k, v in threads.get(n, {}).get("errors", {}).items():
            short = k.rsplit(".", 1)[-1]
            agg[short] = agg.get(short, 0) + v["count"]
    return ",".join(f"{k}:{v}" for k, v in sorted(agg.items())) or "-"


def table_rows(results: list[dict]) -> list[str]:
    hdr = (
        f"{'scenario':<19} {'nested':<7} {'tracer it':>9} {'tracer err':<28} {'graph!':>6} {'caller it':>9} "
        f"{'caller ok':>9} {'caller err':<34} {'wrong':>5} {'dense':>6} {'recomp':>6} "
        "notes (left behind after the race; waits)"
    )
    rows = [hdr, "-" * len(hdr)]
    for r in results:
        if r.get("status") != "ran":
            rows.append(f"{r['scenario']:<19} {r['nested']:<7} {r.get('status')}: {str(r.get('error', ''))[-160:]!r}")
            continue
        th = r["threads"]
        callers = [n for n in th if n.startswith("caller")]
        c_it = sum(th[n]["iterations"] for n in callers)
        c_ok = sum(th[n]["ok"] for n in callers)
        if r["caller"] in ("cold", "coldwait"):  # first calls that succeeded with the right output
            c_ok = sum(1 for e in th["caller0"].get("first_calls", []) if e["succeeded"] and not e.get("wrong"))
        wrong = sum(th[n]["wrong_outputs"] for n in callers)
        dense = sum(v for k, v in r["dense_calls_by_thread"].items() if k.startswith("caller"))
        recomp = sum(v for k, v in r["recompiles_by_thread"].items())
        left = [k for k, v in r["left_behind"].items() if v is True]
        for k in ("compiled_call_after", "module_call_after"):
            if k in r["left_behind"] and r["left_behind"][k] != "ok":
                left.append(f"{k}={r['left_behind'][k]}"[:80])
        if r["left_behind"].get("dense_calls_in_compiled_call_after"):
            left.append("compiled_call_after_dense")
        waits = sum(th[n].get("waits", 0) for n in callers)
        if waits:
            left.append(
                f"waits={waits}/timeouts={sum(th[n].get('wait_timeouts', 0) for n in callers)}"
                f"/{sum(th[n].get('waited_seconds', 0) for n in callers):.2f}s"
            )
        if r["threads_still_running"]:
            left.append("still_running=" + "+".join(r["threads_still_running"]))
        cold = ""
        if r["caller"] in ("cold", "coldwait"):
            fc = th["caller0"].get("first_calls", [])
            cold = " first:" + ";".join(
                f"L{e['length']} {'ok' if e['succeeded'] and not e.get('wrong') else 'FAIL'}"
                f"/{e['attempts']}att/{e.get('seconds_to_success', '-')}s"
                f"/dense{e.get('dense_calls_in_first_call', '-')}"
                for e in fc
            )
            st = th["caller0"].get("steady_after_first_calls")
            if st:
                cold += f" steady ok {st['ok']}/{st['iterations']}"
        rows.append(
            f"{r['scenario']:<19} {r['nested']:<7} {th['tracer']['iterations']:>9} "
            f"{summarize_errors(th, ['tracer']):<28.28} {th['tracer']['graph_anomalies']:>6} {c_it:>9} {c_ok:>9} "
            f"{summarize_errors(th, callers):<34.34} {wrong:>5} {dense:>6} {recomp:>6} "
            f"{','.join(left) or '-'}{cold}"
        )
    return rows


def parent_main(args: argparse.Namespace) -> None:
    import torch

    names = args.scenarios.split(",") if args.scenarios else list(SCENARIOS)
    nesteds = args.nested.split(",") if args.nested else list(NESTED)
    for n in names:
        if n not in SCENARIOS:
            raise SystemExit(f"unknown scenario {n!r}; known: {', '.join(SCENARIOS)}")
    env = dict(os.environ)
    shared_cache = tempfile.mkdtemp(prefix="fx_race_inductor_")
    temp_dirs = [shared_cache]
    results = []
    t_all = time.monotonic()
    for name in names:
        for nested in nesteds:
            cold = SCENARIOS[name][1] in ("cold", "coldwait")
            child_env = dict(env)
            # cold first calls get an empty Inductor/AOTAutograd cache so the compile really runs AOT's make_fx;
            # the others share one cache within this run (their warm-up compile is not what is measured)
            child_env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fx_race_cold_") if cold else shared_cache
            temp_dirs.append(child_env["TORCHINDUCTOR_CACHE_DIR"])
            timeout = (args.cold_timeout + 2 * args.seconds + 240) if cold else (2 * args.seconds + 300)
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tf:
                child_out = tf.name
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                name,
                "--nested",
                nested,
                "--seconds",
                str(args.seconds),
                "--cold-timeout",
                str(args.cold_timeout),
                "--child-timeout",
                str(timeout),
                "--child-out",
                child_out,
                "--dynamo-backend",
                args.dynamo_backend,
            ]
            t0 = time.monotonic()
            print(f"[{time.strftime('%H:%M:%S')}] {name} nested={nested} ...", flush=True)
            try:
                proc = subprocess.run(cmd, check=False, env=child_env, capture_output=True, text=True, timeout=timeout)
                try:
                    with open(child_out) as f:
                        res = json.load(f)
                except (OSError, json.JSONDecodeError):
                    res = {"scenario": name, "nested": nested, "status": f"no_result_rc{proc.returncode}"}
                res["child_rc"] = proc.returncode
                res["child_stderr_tail"] = proc.stderr[-3000:]
            except subprocess.TimeoutExpired as e:
                err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
                res = {"scenario": name, "nested": nested, "status": f"timeout_{timeout}s", "error": err[-3000:]}
            finally:
                try:
                    os.unlink(child_out)
                except OSError:
                    pass
            res["wall_seconds"] = round(time.monotonic() - t0, 1)
            results.append(res)
            print("\n".join(table_rows([res])[2:]), flush=True)

    out = {
        "torch_version": torch.__version__,
        "torch_git_version": torch.version.git_version,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cuda_available": torch.cuda.is_available(),
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "seconds_per_scenario": args.seconds,
        "cold_timeout": args.cold_timeout,
        "dynamo_backend_for_dynamo_tracer": args.dynamo_backend,
        "config": {
            "B": B,
            "H": H,
            "L": L,
            "D": D,
            "window": WINDOW,
            "atol": ATOL,
            "rtol": RTOL,
            "dtype": "float32",
            "device": "cpu",
            "callers": 2,
            "cold_lengths": [256, 128],
        },
        "total_seconds": round(time.monotonic() - t_all, 1),
        "results": results,
    }
    import shutil

    for d in temp_dirs:
        shutil.rmtree(d, ignore_errors=True)
    rows = table_rows(results)
    out["table"] = rows
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    print(f"\ntorch {torch.__version__} ({torch.version.git_version})")
    print("\n".join(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=4.0, help="race time per scenario (default 4)")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--scenarios", help=f"comma list (default all): {','.join(SCENARIOS)}")
    p.add_argument("--nested", help="comma list of error_on_nested_fx_trace settings: default,off (default both)")
    p.add_argument("--cold-timeout", type=float, default=90.0, help="bound on the cold first calls (s)")
    p.add_argument("--dynamo-backend", default="aot_eager", help="backend of the dynamo tracer's compiles")
    p.add_argument("--table-from", help="print the table of a JSON this script wrote, and exit")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--child-timeout", type=float, default=600, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.table_from:
        with open(args.table_from) as f:
            data = json.load(f)
        print(f"torch {data['torch_version']} ({data['torch_git_version']})")
        print("\n".join(table_rows(data["results"])))
    elif args.child:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
