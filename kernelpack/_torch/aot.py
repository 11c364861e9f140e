"""``aot_compile``: a call compiled ahead of time into a function that runs without Dynamo, its bytes, loading it in
another process, and the guards torch keeps on it (tier 2 of an artifact; :mod:`kernelpack.precompiled` says where
the files go).

What differs between torch generations, each chosen by probing:
- torch 2.11 gives a compiled function its ``aot_compile`` method only when ``enable_aot_compile`` is on at
  ``torch.compile`` time; 2.13+ always does. Turning it on while compiling serves both.
- torch 2.11 and 2.13 unpickle a loaded function's guards with a Source that installs an ID_MATCH guard, which asks
  for the current TracingContext; outside a trace there is none ("TracingContext.get() must be called within an
  ongoing trace"; no torch issue found). torch 2.14 and 2.15 do not. A load is tried without a context first; on
  that error, once, every later load gets a fresh context over a FakeTensorMode (the guards it installs are the
  identity guards torch drops on load anyway, which kernelpack's call signature replaces).
- torch 2.15 rewrote aot_compile.py (guard-scope seeding, a per-call re-read of guarded globals); the attributes used
  here (``_artifacts.guard_manager``, ``_artifacts.guards_state``, ``_artifacts.original_code``, ``fn``,
  ``prepare_f_locals``, ``disable_guard_check``, ``guard_check``) are the same in 2.11-2.15.
- A CUDA function's guard manager must expect the job's CPU thread count, not the builder's (:func:`_guard_manager`).
  torch builds one at every load, from the saved guards, with the builder's; building another for the job's meant
  unpickling the guards again and a second build, at every load in a job whose count is not the builder's
  (torchrun's OMP_NUM_THREADS=1): on CPU, torch 2.13, 15 % and 33 % of a 14.8 ms load (bench/later_first_call.py
  --profile, docs/BENCHMARKS.md). :meth:`Loaded.from_bytes` has torch's own build use the
  loading thread's count instead (:func:`_load_at`): every 2.11-2.15 ``AOTCompiledFunction.__post_init__`` reads
  ``torch._dynamo.package.load_guards_state`` from its module at each load, so one process-wide wrapper of it,
  which changes nothing for any other caller or thread, hands torch the state with that count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import io
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from . import unsupported
from .dynamo import compile_options

_NO_TRACING_CONTEXT = "TracingContext.get() must be called within an ongoing trace"


def unavailable() -> str | None:
    """Why this torch cannot compile ahead of time, or None. torch 2.11-2.15 can (``enable_aot_compile``,
    ``torch.compiler.load_compiled_function``)."""
    import torch
    import torch._dynamo.config as dynamo_config

    if not hasattr(dynamo_config, "enable_aot_compile"):
        return f"torch {torch.__version__} has no Dynamo aot_compile switch (torch >= 2.10)"
    if not hasattr(torch.compiler, "load_compiled_function"):
        return f"torch {torch.__version__} has no torch.compiler.load_compiled_function"
    return None


def load_unavailable() -> str | None:
    """Why this torch cannot load a precompiled function, or None; imports nothing past torch (Dynamo costs a
    second). torch 2.11-2.15: ``torch.compiler.load_compiled_function``."""
    import torch

    if not hasattr(torch.compiler, "load_compiled_function"):
        return f"torch {torch.__version__} has no torch.compiler.load_compiled_function"
    return None


def compile_call(arguments: Mapping[str, Any], *, grad: bool, mode: str = "default", dynamic: bool = False) -> Any:
    """``torch.compile(flex_attention, fullgraph=True).aot_compile`` of a call with these (named) arguments, under
    the grad mode of the graph it serves (the loaded function guards on it): q, k, v positional, the rest by name.
    torch 2.11-2.15."""
    import torch
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    args = (arguments["query"], arguments["key"], arguments["value"])
    kwargs = {k: v for k, v in arguments.items() if k not in ("query", "key", "value")}
    with dynamo_config.patch(enable_aot_compile=True), torch.set_grad_enabled(grad):  # type: ignore[attr-defined]
        # dynamic: what the caller marked symbolic (kernelpack.compiled.trace_settings), the rest static
        dyn = None if dynamic else False
        # the guards it saves: torch's default filter for aot_compile's, less those on the pytree registry, whose
        # count is the builder's process's (kernelpack._torch.dynamo.guard_filter)
        options = compile_options(mode, dyn, serializable=True)
        compiled = torch.compile(flex_attention, fullgraph=True, dynamic=dyn, options=options)
        return compiled.aot_compile((args, kwargs))  # type: ignore[attr-defined]


def dumps(fn: Any) -> bytes:
    """The bytes of an aot-compiled function (:func:`loads` makes it again). torch 2.11-2.15: the function's own
    ``save_compiled_function`` (torch.compiler has none)."""
    with tempfile.TemporaryDirectory(prefix="kernelpack-aot-") as tmp:
        path = os.path.join(tmp, "fn.bin")
        fn.save_compiled_function(path)
        with open(path, "rb") as f:
            return f.read()


def guards_pass(fn: Any, arguments: Mapping[str, Any]) -> bool:
    """Whether a call with these (named) arguments passes an aot-compiled function's own guards, as compiled.
    torch 2.11-2.15: ``guard_check``."""
    return bool(fn.guard_check(**arguments))


_needs_tracing_context = False


def loads(blob: bytes) -> Any:
    """The function :func:`dumps` saved, loaded in this process. The inductor artifacts it refers to must be in the
    process's cache dir: without them torch compiles its kernels again. torch 2.11-2.15."""
    import torch

    return _unpickling_guards(lambda: torch.compiler.load_compiled_function(io.BytesIO(blob)))


def _unpickling_guards(load: Callable[[], Any]) -> Any:
    """``load()``, which unpickles guards: in a tracing context where this torch needs one (module docstring)."""
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


@contextlib.contextmanager
def _tracing_context() -> Iterator[None]:
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tracing(TracingContext(FakeTensorMode())):
        yield


_asked = threading.local()  # what a load in this thread asks of torch's guard-manager build (_load_at)
_hook_lock = threading.Lock()


def _load_at(blob: bytes, threads: int) -> tuple[Any, Any]:
    """:func:`loads`, with torch's own guard manager built for the CPU thread count ``threads`` instead of the
    builder's; and the saved guards torch unpickled for it (the builder's count), or None where this torch's state
    could not be changed (then its manager holds the builder's count, as :func:`loads` makes it)."""
    _hook_load_guards_state()
    _asked.threads, _asked.state = threads, None
    try:
        return loads(blob), _asked.state
    finally:
        _asked.threads = _asked.state = None


def _hook_load_guards_state() -> None:
    """Wraps ``torch._dynamo.package.load_guards_state`` once per process: for the first call in a thread that
    :func:`_load_at` asked (the load's own, in ``AOTCompiledFunction.__post_init__``), it returns the saved guards
    with the asked CPU thread count and keeps the original; every other call, in any thread, gets torch's result as
    it is. torch 2.11-2.15."""
    from torch._dynamo import package

    with _hook_lock:
        theirs = package.load_guards_state
        if getattr(theirs, "_kernelpack_asks", False):
            return

        def load_guards_state(*args: Any, **kwargs: Any) -> Any:
            state = theirs(*args, **kwargs)
            threads = getattr(_asked, "threads", None)
            if threads is None:
                return state
            _asked.threads = None  # one function's guards per load (a retry in a tracing context asks again)
            try:
                changed = _at_thread_count(state, threads)
            except Exception:  # private torch API: the load goes on with torch's own manager
                return state
            _asked.state = state
            return changed

        load_guards_state._kernelpack_asks = True  # type: ignore[attr-defined]
        package.load_guards_state = load_guards_state


class Loaded:
    """A loaded function, called by flex_attention's parameter names. torch's own guard check (what remains of
    Dynamo's guards once identity guards and guards on globals are dropped: shapes, strides, dtypes, grad mode,
    closure constants, the global state) runs through :meth:`serves`; the caller stands in for the dropped ones.

    ``device`` is the device type the function runs on. For "cuda", torch's global-state guard expects the calling
    thread's CPU thread count instead of the builder's (:func:`_guard_manager`); for "cpu" it keeps the builder's,
    since Inductor's C++ kernels are generated for it. torch 2.11-2.15."""

    def __init__(self, fn: Any, device: str = "cpu") -> None:
        import torch

        self._fn = fn
        # The loaded function's frame runs in a globals dict of its own (GraphRuntimeEnv.forward_callable). Bytecode
        # that writes globals would race between threads calling it at once: such a function is refused (the caller
        # falls back to tier 1), so one function serves every thread without a lock.
        writes = sorted(
            {i.argval for i in dis.get_instructions(fn.fn.__code__) if i.opname in ("STORE_GLOBAL", "DELETE_GLOBAL")}
        )
        if writes:
            raise RuntimeError(f"its bytecode writes the globals {writes}: not safe to call from several threads")
        fn.disable_guard_check()  # checked once per call in serves(), not again in __call__
        self._threads_now = torch.get_num_threads
        # CUDA: a guard manager per CPU thread count, built on first need and never replaced. The count is per thread
        # in torch (set_num_threads in one thread leaves a running one's as it was), so threads with different counts
        # each get theirs instead of rebuilding one for each other. None: torch's own manager, for every count.
        self._managers: dict[int, Any] | None = None if device == "cpu" else {}
        # the saved guards (the builder's count), to build a manager for another count: kept from the load
        # (from_bytes), else unpickled again where a count needs it
        self._state: Any = None
        self._lock = threading.Lock()
        self._bind = _locals_binder(fn)
        self._bind_checked = False

    @classmethod
    def from_bytes(cls, blob: bytes, device: str = "cpu") -> Loaded:
        """The function :func:`dumps` saved, loaded in this process (:func:`loads`). For "cuda" torch's own guard
        manager is built for this thread's CPU thread count (where a function loads at its first call, the calling
        thread's), and the saved guards torch unpickled for it are kept for any other count: no count a job runs at
        costs a second unpickle, and the loading thread's none a second build."""
        if device == "cpu":
            return cls(loads(blob), device)
        import torch

        threads = torch.get_num_threads()
        fn, state = _load_at(blob, threads)
        loaded = cls(fn, device)
        if state is not None:
            assert loaded._managers is not None
            loaded._state = state
            loaded._managers[threads] = fn._artifacts.guard_manager
        return loaded

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
                            if self._state is None:
                                self._state = _unpickling_guards(lambda: _load_guards_state(self._fn))
                                self._managers.setdefault(_thread_count(self._state), self._fn._artifacts.guard_manager)
                            manager = self._managers.get(threads) or _guard_manager(self._fn, self._state, threads)
                        except Exception:  # private torch API: a refusal (tier 1 serves), never the user's error
                            return None
                        self._managers[threads] = manager
        return manager

    def serves(self, arguments: Mapping[str, Any]) -> bool:
        f_locals = self._f_locals(arguments)
        if self._managers is not None and (threads := self._threads_now()) not in self._managers:
            # A count not seen yet. Without the saved guards at hand (loaded by loads()), torch's own manager holds
            # the builder's count in its global-state guard: where it passes, this count is the builder's, and the
            # saved guards are not unpickled again (2.19 ms a function on CPU, torch 2.13:
            # bench/later_first_call.py, docs/BENCHMARKS.md); only where it fails does _manager learn the builder's
            # count and build one for this count. With them (from_bytes), _manager builds one from them at once.
            own = self._fn._artifacts.guard_manager
            if self._state is None and own.check(f_locals):
                with self._lock:
                    self._managers.setdefault(threads, own)
                return True
        manager = self._manager()
        return manager is not None and bool(manager.check(f_locals))

    def _f_locals(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """What torch's ``prepare_f_locals(**arguments)`` makes (the frame's locals its guards read), without its
        ``inspect.Signature.bind``: that took ~30 us of a served call's ~500 us beside the kernel (CPU, torch 2.13;
        bench/dispatch_overhead.py --parts). The first call checks it against torch's own; on any difference (another
        torch's binding) torch's serves from then on."""
        bind = self._bind
        if bind is not None:
            f_locals = bind(arguments)
            if f_locals is not None:
                if not self._bind_checked:
                    theirs = self._fn.prepare_f_locals(**arguments)
                    if theirs.keys() != f_locals.keys() or any(theirs[k] is not f_locals[k] for k in theirs):
                        self._bind = None
                        return theirs  # type: ignore[no-any-return]
                    self._bind_checked = True
                return f_locals
        return self._fn.prepare_f_locals(**arguments)  # type: ignore[no-any-return]

    def guard_failure(self, arguments: Mapping[str, Any]) -> str:
        """Which of torch's guards this call fails ("" when it passes or torch does not say)."""
        try:
            manager = self._manager()
            if manager is None:
                return f"no guard manager could be built for {self._threads_now()} CPU threads"
            return str(manager.check_verbose(self._fn.prepare_f_locals(**arguments)).verbose_code_parts)
        except Exception:  # the reason is a courtesy, the refusal stands without it
            return ""

    def __call__(self, arguments: Mapping[str, Any]) -> Any:
        return self._fn(**arguments)

    def checked(self, **arguments: Any) -> Any:
        """A call that must pass torch's guards (the warm-up's and verify's canonical calls): raises naming the guard
        that failed instead."""
        if not self.serves(arguments):
            raise RuntimeError(f"the canonical call fails its guards: {self.guard_failure(arguments)}")
        return self(arguments)


def _locals_binder(fn: Any) -> Callable[[Mapping[str, Any]], dict[str, Any] | None] | None:
    """A function making what ``fn.prepare_f_locals(**arguments)`` makes for a call by keyword: the values of the
    compiled function's closure cells by their names, then every parameter of its signature, given or its default.
    It returns None where a call is not simply that (a name the signature lacks, a required one missing: torch's
    binding raises its TypeError). None where the function is not one it can bind (``*args``/``**kwargs``, or
    another torch's attributes). torch 2.11-2.15: ``_artifacts.signature``, ``_artifacts.runtime_env`` (``closure``,
    ``bytecode.co_freevars``), as ``AOTCompiledFunction.prepare_f_locals`` reads them."""
    import inspect

    try:
        params = fn._artifacts.signature.parameters
        env = fn._artifacts.runtime_env
        cells = tuple(env.closure or ())
        names = tuple(env.bytecode.co_freevars) if cells else ()
    except AttributeError:
        return None
    if len(names) != len(cells):
        return None
    if any(
        p.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY) for p in params.values()
    ):
        return None
    order = tuple(params)
    known = frozenset(order)
    defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}

    def bind(arguments: Mapping[str, Any]) -> dict[str, Any] | None:
        if not known.issuperset(arguments):
            return None
        f_locals = {n: c.cell_contents for n, c in zip(names, cells, strict=True)}
        for n in order:
            if n in arguments:
                f_locals[n] = arguments[n]
            elif n in defaults:
                f_locals[n] = defaults[n]
            else:
                return None
        return f_locals

    return bind


def _load_guards_state(fn: Any) -> Any:
    from torch._dynamo.package import load_guards_state

    return load_guards_state(fn._artifacts.guards_state)


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
    algorithms, default dtype) is still checked. The call AOTCompiledFunction.__post_init__ makes to build its guard
    manager, torch 2.11-2.15."""
    from torch._dynamo.package import load_guard_manager

    state = _at_thread_count(state, threads)
    return _unpickling_guards(lambda: load_guard_manager(state, fn._artifacts.original_code, fn.fn.__globals__))


def _at_thread_count(state: Any, threads: int) -> Any:
    """Saved guards ``state`` with ``threads`` as the CPU thread count their global-state guard expects (the rest as
    saved). torch 2.11-2.15: ``output_graph.global_state_guard``, a pybind GlobalStateGuard pickled as JSON."""
    saved = state.output_graph.global_state_guard
    values = json.loads(saved.__getstate__())
    if "num_threads" not in values:
        raise unsupported("Dynamo's saved global-state guard no longer holds num_threads")
    values["num_threads"] = threads
    cls: Any = type(saved)
    guard = cls.__new__(cls)  # what pickle does: the pybind class restores itself from its JSON
    guard.__setstate__(json.dumps(values))
    return dataclasses.replace(state, output_graph=dataclasses.replace(state.output_graph, global_state_guard=guard))
