"""The compiled flex_attention callables, what Dynamo already compiled for them, Dynamo's recompile floor, and the
first-call gate.

The lowest runtime mechanism, with no knowledge of artifacts: :mod:`kernelpack.runtime` builds the guard on it, and
:mod:`kernelpack.masks` waits at the gate.

- A worker only hits what the builder compiled if it runs the very same traced graph, through the same callable
  (``torch.compile(flex_attention)`` with the same options): :func:`compiled_flex_attention` is that callable, one
  object per option set for the whole process.
- Dynamo's default recompile limit (8) is far below a recipe's shape count with ``dynamic=False``, and hitting it
  makes Dynamo run flex_attention eagerly, i.e. the dense math path: :func:`ensure_recompile_limit` raises it, in
  every thread that calls kernelpack (Dynamo config assignments are per-thread since torch 2.12).
- :func:`dynamo_hit` asks Dynamo's own guards, before a call, whether Dynamo would serve it from a graph it already
  has or trace it again: only the second runs make_fx (and, for a training graph, ``torch.autograd.grad``).
- The gate: many steady-state calls at once, or one first call alone. Alone matters: while one thread compiles,
  AOTAutograd's make_fx sets torch.fx's *process-global* tracing flag, and a compiled call entered by another thread
  at that moment raises "Detected that you are using FX to symbolically trace a dynamo-optimized function" or, with
  ``error_on_nested_fx_trace=False``, silently runs uncompiled (dense). Every wait at the gate is bounded: a thread
  inside a backward pass (:func:`in_backward`) may be the autograd engine thread the first call is waiting for.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from . import settings
from .errors import KernelpackError

DEFAULT_RECOMPILE_LIMIT = 64
_recompile_floor = DEFAULT_RECOMPILE_LIMIT

_create_lock = threading.Lock()
_compiled: dict[tuple[str, bool], Callable[..., Any]] = {}


def compiled_flex_attention(mode: str = "default", dynamic: bool = False) -> Callable[..., Any]:
    """``torch.compile(flex_attention, dynamic=..., mode=...)``, one object per option set for the whole process.

    ``dynamic=False`` (the default) gives one static graph per shape, so the cache keys a process needs do not depend
    on the order in which it meets its shapes (torch's default automatic-dynamic recompiles the second shape it sees
    as a dynamic graph: a different key). Calling the returned object directly bypasses the guard; use
    :data:`kernelpack.flex_attention` (default options) or :func:`kernelpack.runtime.guarded` for other options.
    """
    key = (mode, dynamic)
    fn = _compiled.get(key)
    if fn is None:
        with _create_lock:
            fn = _compiled.get(key)
            if fn is None:
                import torch

                fn = torch.compile(_eager_flex(), dynamic=dynamic, mode=None if mode == "default" else mode)
                _compiled[key] = fn
    return fn


def _eager_flex() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    return eager_flex  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------------------ Dynamo's entries

_defaults: dict[str, Any] | None = None


def frame_locals(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The locals of flex_attention's frame for a call with these (named) arguments: what Dynamo's guards read."""
    global _defaults
    if _defaults is None:
        params = inspect.signature(_eager_flex()).parameters.values()
        _defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return {**_defaults, **arguments}


def dynamo_entries(mode: str = "default", dynamic: bool = False) -> list[Any] | None:
    """Dynamo's cache entries that a call through :func:`compiled_flex_attention` with these options may use, most
    recent first; None where this torch does not expose them (``_debug_get_cache_entry_list``, torch >= 2.4).

    Dynamo keeps one list per code object, so the entries of the user's own ``torch.compile(flex_attention)`` are
    there too. Dynamo's lookup skips an entry whose backend differs from the caller's, so only entries whose backend
    equals ours (an inductor wrapper with the same mode and options, compared by value as Dynamo does) are kept."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # pragma: no cover - torch < 2.4
        return None
    backend = _backend(mode, dynamic)
    if backend is None:
        return None
    return [e for e in _debug_get_cache_entry_list(_eager_flex().__code__) if e.backend == backend]


_backends: dict[tuple[str, bool], Any] = {}


def _backend(mode: str, dynamic: bool) -> Any:
    """The backend torch.compile gives these options; None if this torch's private wrapper is not there."""
    key = (mode, dynamic)
    if key not in _backends:
        try:
            from torch import _TorchCompileInductorWrapper

            _backends[key] = _TorchCompileInductorWrapper(None if mode == "default" else mode, None, dynamic)
        except Exception:
            _backends[key] = None
    return _backends[key]


def serving_entry(arguments: Mapping[str, Any], mode: str = "default", dynamic: bool = False) -> Any:
    """The guard manager of the entry Dynamo would serve this call from (the first of ours whose guards pass, as in
    Dynamo's lookup), or None: it would trace. Ask in the thread that makes the call: guards read its grad mode and
    autocast state. Raises RuntimeError where torch cannot tell."""
    entries = dynamo_entries(mode, dynamic)
    if entries is None:
        raise RuntimeError("this torch does not expose Dynamo's cache entries")
    f_locals = frame_locals(arguments)
    return next((e.guard_manager for e in entries if e.guard_manager.check(f_locals)), None)


def dynamo_hit(
    arguments: Mapping[str, Any], served_by: Collection[Any], mode: str = "default", dynamic: bool = False
) -> Any:
    """The entry (guard manager) of ``served_by`` (recorded by :func:`serving_entry`) that Dynamo would serve a call
    with these arguments from, if it still has it, found by running Dynamo's own guards on the frame the call would
    make; False when none would (Dynamo would trace). Only those entries count: an entry someone else compiled may be
    a graph the artifact does not cover. None where torch cannot tell (old torch).

    Costs ~20 us for a dozen entries (CPU, torch 2.13): each failing entry stops at its first failing guard."""
    entries = dynamo_entries(mode, dynamic)
    if entries is None:
        return None
    f_locals = frame_locals(arguments)
    # a recorded entry Dynamo no longer has (torch._dynamo.reset()) would not serve the call: Dynamo would trace
    return next(
        (e.guard_manager for e in entries if e.guard_manager in served_by and e.guard_manager.check(f_locals)), False
    )


@contextlib.contextmanager
def trace_settings(dynamic: bool) -> Iterator[None]:
    """What a call that may trace runs under: for a dynamic graph, no duck sizing.

    Duck sizing gives two sizes that are equal at trace time one symbol, and the graph then holds only where they are
    equal. A flex call's sizes include the block count of its BlockMask, which at some lengths equals a head count:
    at 4096 tokens, 32 blocks of 128 and 32 query heads. Measured on the H200 (bench/dynamic_probe.py,
    docs/BENCHMARKS.md): a dynamic graph traced at 4096 did not serve 8192 in the same process, and a fresh process at
    6144 missed the cache; traced without duck sizing, one graph served 8192 in-process and a fresh process at 1500,
    3001, 6144, 12288 and 16000 hit the FX-graph and AOTAutograd caches. Only first calls trace, alone at the gate;
    on torch < 2.12 the setting is process-wide while the call runs, so a compile in another thread meanwhile is
    traced without duck sizing too (a more general graph, never a wrong one)."""
    if not dynamic:
        yield
        return
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    # Floats specialized, as in a static graph: a dynamic float (flex's scale) is traced into a graph AOTAutograd
    # cannot cache, compiled again in every process (CPU, torch 2.13: one AOTAutograd miss per fresh process).
    with fx_config.patch(use_duck_shape=False), dynamo_config.patch(specialize_float=True):  # type: ignore[attr-defined]
        yield


def guard_failure(guard_manager: Any, arguments: Mapping[str, Any]) -> str:
    """The first guard of an entry that a call fails, in Dynamo's words (e.g. ``tensor 'L['query']' stride mismatch
    at index 1``); empty when it passes or torch cannot say."""
    try:
        verbose = guard_manager.check_verbose(frame_locals(arguments))
    except Exception:
        return ""
    if verbose.result:
        return ""
    return "; ".join(str(p).split("  #")[0].strip() for p in verbose.verbose_code_parts)


def in_backward() -> bool:
    """Whether this thread is running a backward pass (an autograd engine thread, or a backward on the CPU): the
    thread that a first call's make_fx + ``torch.autograd.grad`` may be waiting for."""
    import torch

    return bool(torch._C._current_graph_task_id() != -1)


# ------------------------------------------------------------------------------------------------ recompile floor


def recompile_floor_for(signatures: int) -> int:
    """The recompile limit an artifact of ``signatures`` (config, device) pairs needs: each may be met with and without
    grad, plus room for a few uncovered calls in non-strict mode."""
    return 2 * signatures + 8


def ensure_recompile_limit(n: int = DEFAULT_RECOMPILE_LIMIT) -> None:
    """Raise Dynamo's per-code-object recompile limit to at least ``n`` in every thread that calls kernelpack.

    Since torch 2.12 a Dynamo config assignment is a per-thread ContextVar override: set in the main thread, it is
    not seen by worker threads. So the floor is kept here and applied by each guarded call in the calling thread
    (:func:`apply_thread_config`), which provably reaches every thread that compiles through us. Raised, never
    lowered.
    """
    global _recompile_floor
    _recompile_floor = max(_recompile_floor, n)
    apply_thread_config()


def recompile_floor() -> int:
    return _recompile_floor


def apply_thread_config() -> None:
    import torch._dynamo.config as dconfig

    # ``cache_size_limit`` before torch 2.7; ``recompile_limit`` (with the old name as an alias) since.
    name = "recompile_limit" if hasattr(dconfig, "recompile_limit") else "cache_size_limit"
    if getattr(dconfig, name) < _recompile_floor:
        setattr(dconfig, name, _recompile_floor)
        acc = "accumulated_recompile_limit" if hasattr(dconfig, "accumulated_recompile_limit") else None
        if acc and getattr(dconfig, acc) < 4 * _recompile_floor:
            setattr(dconfig, acc, 4 * _recompile_floor)


# ------------------------------------------------------------------------------------------ settings in the keys


def key_settings(device_type: str) -> dict[str, str]:
    """The process-wide settings that enter inductor's FX-graph and AOTAutograd cache keys besides the graph and its
    inputs (torch/_inductor/codecache.py ``FxGraphHashDetails``, torch 2.11-2.13), as ``name -> repr``: every
    portable inductor and functorch config value, deterministic algorithms, the default dtype, the CUDA matmul
    precision flags, and on CPU the thread count C++ kernels specialize on. A process whose settings differ from the
    builder's misses every entry, whatever kernelpack's call signatures say."""
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    def portable(module: Any) -> dict[str, Any]:
        try:
            return dict(module.save_config_portable(ignore_private_configs=False))
        except TypeError:  # torch < 2.7: no ignore_private_configs
            return dict(module.save_config_portable())

    out: dict[str, str] = {}
    for prefix, module in (("inductor", inductor_config), ("functorch", functorch_config)):
        for name, value in portable(module).items():
            out[f"{prefix}.{name}"] = _stable_repr(value)
    # one value per key: a kernelpack that records one more setting must not change the ones recorded before
    deterministic = getattr(torch.utils, "deterministic", None)
    out["deterministic_algorithms"] = repr(torch.are_deterministic_algorithms_enabled())
    out["deterministic_algorithms_warn_only"] = repr(torch.is_deterministic_algorithms_warn_only_enabled())
    out["fill_uninitialized_memory"] = repr(getattr(deterministic, "fill_uninitialized_memory", None))
    out["default_dtype"] = str(torch.get_default_dtype())
    matmul = torch.backends.cuda.matmul
    for name in (
        "fp32_precision",  # torch >= 2.9; allow_tf32 before
        "allow_tf32",
        "allow_fp16_reduced_precision_reduction",
        "allow_bf16_reduced_precision_reduction",
    ):
        if hasattr(matmul, name):
            out[f"cuda_matmul.{name}"] = repr(getattr(matmul, name))
    if (
        device_type == "cpu"
        and inductor_config.cpp.threads < 1
        and not getattr(inductor_config.cpp, "dynamic_threads", False)
    ):
        out["cpu_threads"] = str(torch.get_num_threads())
    return out


def _stable_repr(value: Any) -> str:
    # a function or object repr carries its address, different in every process: its type stands in
    text = repr(value)
    return f"<{type(value).__qualname__}>" if " at 0x" in text or " object at " in text else text


def key_settings_differences(built: Mapping[str, str], device_type: str) -> list[tuple[str, str, str]]:
    """(name, builder's value, this process's value) for every key setting that differs; names one side lacks are
    skipped (another torch build is refused by the build key, not here)."""
    here = key_settings(device_type)
    return [(name, built[name], here[name]) for name in sorted(built) if name in here and here[name] != built[name]]


# ---------------------------------------------------------------------------------------------------- the gate


class Gate:
    """Many steady-state calls at once, or one first call alone (a writer-preferring readers-writer lock).

    Waits take a ``timeout`` (seconds, None: forever; kernelpack bounds them inside a backward pass) and raise
    :class:`KernelpackError` when it passes."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.readers = 0  # calls inside the gate now (read by tests and benchmarks)
        self._writer = False
        self._writers_waiting = 0

    def _wait(self, blocked: Callable[[], bool], timeout: float | None, what: str) -> None:
        if not self._cond.wait_for(lambda: not blocked(), timeout):
            raise KernelpackError(
                f"a kernelpack call inside a backward pass (a checkpoint recompute?) waited {timeout:.0f} s for {what},"
                " which may be waiting for this thread (the autograd engine runs backward on one thread per device): "
                "refused instead of deadlocking",
                hint="activate() an artifact with warm-up (the default) so that nothing compiles during training; or "
                "make every call once before starting threads; or raise KERNELPACK_BACKWARD_WAIT_SECONDS",
            )

    @contextlib.contextmanager
    def shared(self, timeout: float | None = None) -> Iterator[None]:
        with self._cond:
            self._wait(lambda: self._writer or bool(self._writers_waiting), timeout, "another thread's first call")
            self.readers += 1
        try:
            yield
        finally:
            with self._cond:
                self.readers -= 1
                if not self.readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self, timeout: float | None = None) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            try:
                self._wait(lambda: self._writer or bool(self.readers), timeout, "the calls in flight to finish")
            finally:
                self._writers_waiting -= 1
                self._cond.notify_all()  # readers held back by this writer may go on if it gave up
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


gate = Gate()


def outside_first_calls() -> contextlib.AbstractContextManager[None]:
    """Run torch tracing work (e.g. create_block_mask) alongside steady-state calls but never during a first call;
    inside a backward pass, wait only KERNELPACK_BACKWARD_WAIT_SECONDS (the first call may be waiting for us)."""
    return gate.shared(settings.backward_wait_seconds() if in_backward() else None)


def wait_for_foreign_fx_trace(limit: float | None = None) -> None:
    """torch.fx's tracing flag is process-global: if another thread is FX-tracing right now, a compiled call would
    raise or (error_on_nested_fx_trace=False) run uncompiled. Wait for it, bounded by ``limit`` (default
    KERNELPACK_FX_WAIT_SECONDS)."""
    from torch.fx import _symbolic_trace

    if not _symbolic_trace._is_fx_tracing_flag:
        return
    if limit is None:
        limit = settings.fx_wait_seconds()
    deadline = time.monotonic() + limit
    while _symbolic_trace._is_fx_tracing_flag:
        if time.monotonic() > deadline:
            raise KernelpackError(
                f"another thread has been FX-tracing for over {limit:.0f} s; a compiled call now would run "
                "flex_attention uncompiled",
                hint="do not FX-trace (torch.fx.symbolic_trace, make_fx) in parallel with the first steps, or raise "
                + (
                    "KERNELPACK_BACKWARD_WAIT_SECONDS (this call is inside a backward pass)"
                    if in_backward()
                    else "KERNELPACK_FX_WAIT_SECONDS"
                ),
            )
        time.sleep(0.001)
