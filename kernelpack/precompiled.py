"""Tier 2, precompiled functions (issue 18): torch's ``aot_compile`` of a config's canonical call, saved by the builder
beside the inductor cache (tier 1), loaded by the runtime and called without Dynamo.

A mechanism, like :mod:`kernelpack.compiled`: it knows calls, bytes and where the format puts them, not activation or
dispatch. Every workaround for a torch version's bug on this path is in this module, and each is skipped where torch
does not need it.

What torch 2.13.0+cpu does (bench/precompile_probe.py): ``torch.compiler.save_compiled_function`` does not exist
(the compiled function's own ``save_compiled_function`` does); ``torch.compiler.load_compiled_function`` raises
"TracingContext.get() must be called within an ongoing trace" while unpickling the guards, as on 2.11 (FINDINGS);
``aot_compile`` guards on the grad mode it ran under.
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import inspect
import io
import json
import os
import tempfile
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .artifact import PRECOMPILED_DIR

# torch raises this while unpickling a loaded function's guards outside a trace (2.11, 2.13)
_NO_TRACING_CONTEXT = "TracingContext.get() must be called within an ongoing trace"


def unavailable() -> str | None:
    """Why this torch has no tier 2 (no ``enable_aot_compile``, torch < 2.10), or None."""
    import torch
    import torch._dynamo.config as dynamo_config

    if not hasattr(dynamo_config, "enable_aot_compile"):
        return f"torch {torch.__version__} has no torch._dynamo.config.enable_aot_compile (torch >= 2.10)"
    if not hasattr(torch.compiler, "load_compiled_function"):
        return f"torch {torch.__version__} has no torch.compiler.load_compiled_function"
    return None


def compile_call(arguments: Mapping[str, Any], *, grad: bool, mode: str = "default", dynamic: bool = False) -> Any:
    """``torch.compile(flex_attention, fullgraph=True).aot_compile`` of a call with these (named) arguments, under
    the grad mode of the graph it serves (the loaded function guards on it): q, k, v positional, the rest by name,
    as :func:`kernelpack.runtime.flex_attention` passes them."""
    import torch
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    args = (arguments["query"], arguments["key"], arguments["value"])
    kwargs = {k: v for k, v in arguments.items() if k not in ("query", "key", "value")}
    # torch 2.11 gives the compiled function its aot_compile method only when the flag is on at torch.compile time
    # (FINDINGS, "Skipping Dynamo at warm start"); 2.13 always does
    with dynamo_config.patch(enable_aot_compile=True), torch.set_grad_enabled(grad):  # type: ignore[attr-defined]
        compiled = torch.compile(
            flex_attention, fullgraph=True, dynamic=dynamic, mode=None if mode == "default" else mode
        )
        return compiled.aot_compile((args, kwargs))  # type: ignore[attr-defined]


def dumps(fn: Any) -> bytes:
    """The bytes of an aot-compiled function (:func:`loads` makes it again)."""
    import torch

    save = getattr(torch.compiler, "save_compiled_function", None)
    with tempfile.TemporaryDirectory(prefix="kernelpack-aot-") as tmp:
        path = os.path.join(tmp, "fn.bin")
        if save is not None:
            save(fn, path)
        else:  # torch 2.13: the compiled function saves itself
            fn.save_compiled_function(path)
        with open(path, "rb") as f:
            return f.read()


def file_name(config_id: str, device_index: int, graph: str) -> str:
    """Where the builder writes a graph's function, relative to the cache dir."""
    return f"{PRECOMPILED_DIR}/{config_id}-{device_index}-{graph.replace('+', '_')}.bin"


class Loaded:
    """A loaded function, called by flex_attention's parameter names. torch's own guard check (what remains of
    Dynamo's guards once identity guards and guards on globals are dropped: shapes, strides, dtypes, grad mode,
    closure constants, the global state) runs through :meth:`serves`; the caller stands in for the dropped ones (the
    call signature, the code of the mask_mod and score_mod, :func:`reads_globals`).

    ``device`` is the device type the function runs on. For "cuda", torch's global-state guard expects the calling
    thread's CPU thread count instead of the builder's (:func:`_guard_manager`); for "cpu" it keeps the builder's,
    since Inductor's C++ kernels are generated for it."""

    def __init__(self, fn: Any, device: str = "cpu") -> None:
        self._fn = fn
        # The loaded function's frame runs in a globals dict of its own (torch's GraphRuntimeEnv.forward_callable).
        # Bytecode that writes globals would race between threads calling it at once: such a function is not
        # served (the caller falls back to tier 1), so one function serves every thread without a lock.
        code = fn.fn.__code__
        writes = sorted({i.argval for i in dis.get_instructions(code) if i.opname in ("STORE_GLOBAL", "DELETE_GLOBAL")})
        if writes:
            raise RuntimeError(f"its bytecode writes the globals {writes}: not safe to call from several threads")
        fn.disable_guard_check()  # checked once per call in serves(), not again in __call__
        import torch

        self._threads_now = torch.get_num_threads
        # CUDA: a guard manager per CPU thread count, built on first need and never replaced. The count is per thread
        # in torch (set_num_threads in one thread leaves a running one's as it was), so threads with different counts
        # each get theirs instead of rebuilding one for each other. None: torch's own manager, for every count.
        self._managers: dict[int, Any] | None = None
        self._state: Any = None
        self._lock = threading.Lock()
        if device != "cpu":
            self._state = _guards_state(fn)
            self._managers = {_thread_count(self._state): fn._artifacts.guard_manager}

    def _manager(self) -> Any:
        """The guard manager for this thread's CPU thread count; None when it cannot be built (then refused)."""
        manager = self._fn._artifacts.guard_manager
        if self._managers is not None:
            threads = self._threads_now()
            manager = self._managers.get(threads)
            if manager is None:
                with self._lock:
                    manager = self._managers.get(threads)
                    if manager is None:
                        try:
                            manager = _guard_manager(self._fn, self._state, threads)
                        except Exception:  # private torch API: a refusal (tier 1 serves), never the user's error
                            return None
                        self._managers[threads] = manager
        return manager

    def serves(self, arguments: Mapping[str, Any]) -> bool:
        manager = self._manager()
        return manager is not None and bool(manager.check(self._fn.prepare_f_locals(**arguments)))

    def guard_failure(self, arguments: Mapping[str, Any]) -> str:
        """Which of torch's guards this call fails ("" when it passes or torch does not say)."""
        try:
            manager = self._manager()
            if manager is None:
                return f"no guard manager could be built for {self._threads_now()} CPU threads"
            return str(manager.check_verbose(self._fn.prepare_f_locals(**arguments)).verbose_code_parts)
        except Exception:  # private API: the reason is a courtesy, the refusal stands without it
            return ""

    def __call__(self, arguments: Mapping[str, Any]) -> Any:
        return self._fn(**arguments)

    def checked(self, **arguments: Any) -> Any:
        """A call that must pass torch's guards (the warm-up's and verify's canonical calls): raises naming the guard
        that failed instead."""
        if not self.serves(arguments):
            raise RuntimeError(f"the canonical call fails its guards: {self.guard_failure(arguments)}")
        return self(arguments)


def load(path: str | os.PathLike[str], device: str) -> Loaded:
    """The function the builder saved at ``path``, for ``device`` ("cuda", "cpu"); raises when torch cannot load it
    or it is unsafe to share."""
    with open(path, "rb") as f:
        return Loaded(loads(f.read()), device)


def reads_globals(fn: Any, depth: int = 0) -> str | None:
    """The first global value (not a module, function, class or builtin) that ``fn`` or a function in its closure reads,
    as "name=value", or None. torch drops every guard on a global from a saved function (aot_compile's guard filter:
    ``is_global``), so a mask that reads ``WINDOW`` would run with the builder's value after the job changed it; tier 1
    keeps Dynamo's guard on it. Such a function is left to tier 1."""
    code = getattr(fn, "__code__", None)
    if code is None or depth > 8:
        return None
    scope = getattr(fn, "__globals__", {})
    for name in code.co_names:
        if name in scope:
            value = scope[name]
            if not isinstance(value, (types.ModuleType, type)) and not inspect.isroutine(value):
                return f"{name}={value!r}"[:200]
    for inner in (c for c in code.co_consts if isinstance(c, types.CodeType)):  # nested functions, lambdas
        found = reads_globals(types.FunctionType(inner, scope), depth + 1)
        if found:
            return found
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        for value in values if isinstance(values, (tuple, list)) else (values,):
            if inspect.isfunction(value) and (found := reads_globals(value, depth + 1)):
                return found
    return None


# torch 2.11 and 2.13 need the tracing-context workaround for every load; found once, then used directly, so that a
# load does not deserialize twice
_needs_tracing_context = False


def loads(blob: bytes) -> Callable[..., Any]:
    """The function :func:`dumps` saved, loaded in this process. The inductor artifacts it refers to must be in the
    process's cache dir (tier 1's files): without them torch compiles its kernels again."""
    import torch

    return _unpickling_guards(lambda: torch.compiler.load_compiled_function(io.BytesIO(blob)))


def _unpickling_guards(load: Callable[[], Any]) -> Any:
    """``load()``, which unpickles guards: in a tracing context where torch needs one (below)."""
    global _needs_tracing_context
    if not _needs_tracing_context:
        try:
            return load()
        except RuntimeError as e:
            if _NO_TRACING_CONTEXT not in str(e):
                raise
            _needs_tracing_context = True
    with _tracing_context():
        return load()


def _guards_state(fn: Any) -> Any:
    from torch._dynamo.package import load_guards_state

    return _unpickling_guards(lambda: load_guards_state(fn._artifacts.guards_state))


def _thread_count(state: Any) -> int:
    """The CPU thread count a saved global-state guard holds (the builder's)."""
    return int(json.loads(state.output_graph.global_state_guard.__getstate__())["num_threads"])


def _guard_manager(fn: Any, state: Any, threads: int) -> Any:
    """``fn``'s guard manager, built from its saved guards ``state`` with ``threads`` as the CPU thread count its
    global-state guard expects.

    Dynamo's GLOBAL_STATE guard (GlobalStateGuard, torch/csrc/dynamo/guards.cpp) compares torch.get_num_threads()
    with the count at compile time, and a saved function keeps the builder's. torchrun sets OMP_NUM_THREADS=1 in every
    worker and a job's host has its own core count, so on 2 H200s with torch 2.11 every pinned rank's load failed
    ("GLOBAL_STATE changed: num_threads") and tier 1 served. A CUDA graph's kernels do not depend on it (tier 1's
    Inductor key does not hold it either); the rest of the global state (grad mode, autocast, TF32, deterministic
    algorithms, default dtype) is still checked. Private torch API, the same in 2.11 and 2.13: the call
    AOTCompiledFunction.__post_init__ makes to build its guard manager."""
    from torch._dynamo.package import load_guard_manager

    saved = state.output_graph.global_state_guard
    values = json.loads(saved.__getstate__())
    values["num_threads"] = threads
    cls: Any = type(saved)
    guard = cls.__new__(cls)  # what pickle does: the pybind class restores itself from its JSON
    guard.__setstate__(json.dumps(values))
    state = dataclasses.replace(state, output_graph=dataclasses.replace(state.output_graph, global_state_guard=guard))
    return _unpickling_guards(lambda: load_guard_manager(state, fn._artifacts.original_code, fn.fn.__globals__))


@contextlib.contextmanager
def _tracing_context() -> Iterator[None]:
    """torch 2.11 and 2.13 unpickle a loaded function's guards with a Source that installs an ID_MATCH guard, which
    asks for the current TracingContext; outside a trace there is none (FINDINGS, "Skipping Dynamo at warm start"; no
    torch issue found). A fresh context over a FakeTensorMode gives it one; the guards it installs are the ones
    torch drops on load anyway (identity guards), which kernelpack's signature check replaces."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tracing(TracingContext(FakeTensorMode())):
        yield
