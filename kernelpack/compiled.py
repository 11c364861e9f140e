"""The compiled flex_attention callables, Dynamo's recompile floor, and the first-call gate.

The lowest runtime mechanism, with no knowledge of artifacts: :mod:`kernelpack.runtime` builds the guard on it, and
:mod:`kernelpack.masks` waits at the gate.

- A worker only hits what the builder compiled if it runs the very same traced graph, through the same callable
  (``torch.compile(flex_attention)`` with the same options): :func:`compiled_flex_attention` is that callable, one
  object per option set for the whole process.
- Dynamo's default recompile limit (8) is far below a recipe's shape count with ``dynamic=False``, and hitting it
  makes Dynamo run flex_attention eagerly, i.e. the dense math path: :func:`ensure_recompile_limit` raises it, in
  every thread that calls kernelpack (Dynamo config assignments are per-thread since torch 2.12).
- The gate: many steady-state calls at once, or one first call alone. Alone matters: while one thread compiles,
  AOTAutograd's make_fx sets torch.fx's *process-global* tracing flag, and a compiled call entered by another thread
  at that moment raises "Detected that you are using FX to symbolically trace a dynamo-optimized function" or, with
  ``error_on_nested_fx_trace=False``, silently runs uncompiled (dense).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
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
                from torch.nn.attention.flex_attention import flex_attention as eager_flex

                fn = torch.compile(eager_flex, dynamic=dynamic, mode=None if mode == "default" else mode)
                _compiled[key] = fn
    return fn


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


# ---------------------------------------------------------------------------------------------------- the gate


class Gate:
    """Many steady-state calls at once, or one first call alone (a writer-preferring readers-writer lock)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.readers = 0  # calls inside the gate now (read by tests and benchmarks)
        self._writer = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self.readers += 1
        try:
            yield
        finally:
            with self._cond:
                self.readers -= 1
                if not self.readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self.readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


gate = Gate()


def outside_first_calls() -> contextlib.AbstractContextManager[None]:
    """Run torch tracing work (e.g. create_block_mask) alongside steady-state calls but never during a first call."""
    return gate.shared()


def wait_for_foreign_fx_trace() -> None:
    """torch.fx's tracing flag is process-global: if another thread is FX-tracing right now, a compiled call would
    raise or (error_on_nested_fx_trace=False) run uncompiled. Wait for it, bounded by KERNELPACK_FX_WAIT_SECONDS."""
    from torch.fx import _symbolic_trace

    if not _symbolic_trace._is_fx_tracing_flag:
        return
    limit = settings.fx_wait_seconds()
    deadline = time.monotonic() + limit
    while _symbolic_trace._is_fx_tracing_flag:
        if time.monotonic() > deadline:
            raise KernelpackError(
                f"another thread has been FX-tracing for over {limit:.0f} s; a compiled call now would run "
                "flex_attention uncompiled",
                hint="do not FX-trace (torch.fx.symbolic_trace, make_fx) in parallel with the first steps, or raise "
                "KERNELPACK_FX_WAIT_SECONDS",
            )
        time.sleep(0.001)
