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
  AOTAutograd's make_fx traces with torch.fx, whose tracing state reaches other threads (all of it on torch <= 2.13,
  where a compiled call entered by another thread then raises "Detected that you are using FX to symbolically trace
  a dynamo-optimized function" or, with ``error_on_nested_fx_trace=False``, silently runs uncompiled: dense; the
  module patcher on every release: :mod:`kernelpack._torch.fx`), and a Dynamo trace of a fwd+bwd call runs
  ``torch.autograd.grad``, which waits for the autograd engine's device thread. Every wait at the gate is bounded: a
  thread inside a backward pass (:func:`in_backward`) may be the autograd engine thread the first call waits for.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from . import functions, settings
from ._torch import dynamo as _dynamo
from ._torch import flex as _flex
from ._torch import fx as _fx
from ._torch.autograd import in_backward
from ._torch.inductor import fix_cpu_flex_split_names, key_settings
from .errors import KernelpackError

DEFAULT_RECOMPILE_LIMIT = 64
_recompile_floor = DEFAULT_RECOMPILE_LIMIT

_create_lock = threading.Lock()
_compiled: dict[tuple[str, bool], Callable[..., Any]] = {}


def compiled_flex_attention(mode: str = "default", dynamic: bool = False) -> Callable[..., Any]:
    """``torch.compile(flex_attention, mode=...)``, one object per option set for the whole process.

    ``dynamic=False`` (the default) gives one static graph per shape, so the cache keys a process needs do not depend
    on the order in which it meets its shapes (torch's default automatic-dynamic recompiles the second shape it sees
    as a dynamic graph: a different key). ``dynamic=True``: the object a dynamic range config's graph is traced and
    served through, ``torch.compile(dynamic=None)`` (another backend than the static object's, so that its entries
    are told from the static ones; the same as a job's own ``torch.compile(flex_attention)``, whose calls Dynamo may
    then serve from a warmed dynamic graph too), whose first call traces under :func:`trace_settings` with the
    config's marks: only what varies over the range is symbolic. Calling the returned object directly bypasses the
    guard; use :data:`kernelpack.flex_attention` (default options) or :func:`kernelpack.runtime.guarded` for other
    options.
    """
    key = (mode, dynamic)
    fn = _compiled.get(key)
    if fn is None:
        with _create_lock:
            fn = _compiled.get(key)
            if fn is None:
                import torch

                dyn = None if dynamic else False
                # with kernelpack's guard filter: a pytree node type the job registers later (importing a model
                # module) leaves the warmed graphs serving (kernelpack._torch.dynamo.guard_filter)
                fn = torch.compile(_flex.eager_flex(), dynamic=dyn, options=_dynamo.compile_options(mode, dyn))
                _compiled[key] = fn
    return fn


# --------------------------------------------------------------------------------------------- dynamic marks

_marking: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("kernelpack_marks", default=None)


@contextlib.contextmanager
def marking(marks: tuple[str, ...] | None) -> Iterator[None]:
    """The marks (:func:`kernelpack.canonical.marks`) a dynamic trace in this thread uses when its caller has no
    artifact entry to take them from: the builder's calls, made with nothing active."""
    token = _marking.set(marks)
    try:
        yield
    finally:
        _marking.reset(token)


_TENSOR_DIM = re.compile(r"^(?P<of>.+)\.shape\[(?P<dim>\d+)\]$")


def resolve_marks(
    marks: Collection[str], arguments: Mapping[str, Any]
) -> tuple[list[tuple[Any, tuple[int, ...]]], list[str]]:
    """A call's tensors with their marked dimensions and the Dynamo sources of its marked ints, for marks in
    kernelpack's words: ``key.shape[2]``, ``block_mask.kv_indices.shape[3]``, ``block_mask.seq_lengths[1]``,
    ``block_mask.mask_mod.context`` (a :mod:`kernelpack.functions` path in the mask), ``score_mod.bias.shape[0]``.
    A mark the call does not have (a mask without that closure value) is skipped: its guards then decide."""
    dims: dict[int, tuple[Any, set[int]]] = {}
    sources: list[str] = []
    trees: dict[str, Any] = {}
    for mark in marks:
        m = _TENSOR_DIM.match(mark)
        of, dim = (m["of"], int(m["dim"])) if m else (mark, None)
        value, source = _lookup(of, arguments, trees)
        if value is _MISSING:
            continue
        if dim is not None:
            if functions.is_tensor(value):
                dims.setdefault(id(value), (value, set()))[1].add(dim)
        elif isinstance(value, int) and not isinstance(value, bool) and source:
            sources.append(source)
    return [(t, tuple(sorted(d))) for t, d in dims.values()], sources


_MISSING = object()
# the functions a call's marks reach into, by the argument path Dynamo reaches them through
_FUNCTIONS = {"block_mask.mask_mod": "L['block_mask'].mask_mod", "score_mod": "L['score_mod']"}


def _lookup(path: str, arguments: Mapping[str, Any], trees: dict[str, Any]) -> tuple[Any, str]:
    for prefix, root in _FUNCTIONS.items():
        if path.startswith(prefix + "."):
            fn = (
                arguments.get("score_mod")
                if prefix == "score_mod"
                else getattr(arguments.get("block_mask"), "mask_mod", None)
            )
            if fn is None:
                return _MISSING, ""
            if prefix not in trees:
                trees[prefix] = {n.path: n for n in functions.tree(fn).walk()}
            node = trees[prefix].get(path[len(prefix) + 1 :])
            return (_MISSING, "") if node is None else (node.value, root + node.source)
    name, _, rest = path.partition(".")
    value = arguments.get(name, _MISSING)
    source = f"L[{name!r}]"
    for part in filter(None, re.split(r"\.|(?=\[)", rest)):
        if value is _MISSING:
            break
        if part.startswith("["):
            i = int(part[1:-1])
            value = value[i] if isinstance(value, (tuple, list)) and i < len(value) else _MISSING
        else:
            value = getattr(value, part, _MISSING)
        source += part if part.startswith("[") else f".{part}"
    return value, source


# ------------------------------------------------------------------------------------------------ Dynamo's entries

_defaults: dict[str, Any] | None = None


def frame_locals(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The locals of flex_attention's frame for a call with these (named) arguments: what Dynamo's guards read."""
    global _defaults
    if _defaults is None:
        params = inspect.signature(_flex.eager_flex()).parameters.values()
        _defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return {**_defaults, **arguments}


def dynamo_entries(mode: str = "default", dynamic: bool = False) -> list[Any]:
    """Dynamo's cache entries that a call through :func:`compiled_flex_attention` with these options may use, most
    recent first.

    Dynamo keeps one list per code object, so the entries of the user's own ``torch.compile(flex_attention)`` are
    there too. Dynamo's lookup skips an entry whose backend differs from the caller's, so only entries whose backend
    equals ours (an inductor wrapper with the same mode and options, compared by value as Dynamo does) are kept."""
    backend = _dynamo.inductor_backend(None if mode == "default" else mode, None if dynamic else False)
    return [e for e in _dynamo.cache_entries(_flex.eager_flex().__code__) if _dynamo.entry_backend(e) == backend]


def serving_entry(arguments: Mapping[str, Any], mode: str = "default", dynamic: bool = False) -> Any:
    """The guard manager of the entry Dynamo would serve this call from (the first of ours whose guards pass, as in
    Dynamo's lookup), or None: it would trace. Ask in the thread that makes the call: guards read its grad mode and
    autocast state."""
    f_locals = frame_locals(arguments)
    guards = (_dynamo.entry_guards(e) for e in dynamo_entries(mode, dynamic))
    return next((g for g in guards if _dynamo.guards_pass(g, f_locals)), None)


def free_mask_values(
    arguments: Mapping[str, Any], mode: str = "default", dynamic: bool = True
) -> tuple[str, ...] | None:
    """The values the call's mask_mod closes over (paths of :func:`kernelpack.functions.tree`) that the guards of the
    entry serving the call leave free: what a dynamic graph keeps symbolic (DFlash's context length S) and so enters
    the mask key by type. None when no entry serves the call. Ask in the thread that makes the call."""
    entry = serving_entry(arguments, mode, dynamic)
    mask_mod = getattr(arguments.get("block_mask"), "mask_mod", None)
    if entry is None or mask_mod is None:
        return None
    values = {
        n.path: (n.source, "tensor" if n.kind == "tensor" else "scalar")
        for n in functions.tree(mask_mod).walk()
        if n.kind in ("scalar", "tensor", "none")
    }
    # flex_attention's frame reaches the mask_mod through its block_mask argument
    return tuple(sorted(_dynamo.free_values(entry, "L['block_mask'].mask_mod", values)))


def dynamo_hit(
    arguments: Mapping[str, Any], served_by: Collection[Any], mode: str = "default", dynamic: bool = False
) -> Any:
    """The entry (guard manager) of ``served_by`` (recorded by :func:`serving_entry`) that Dynamo would serve a call
    with these arguments from, if it still has it, found by running Dynamo's own guards on the frame the call would
    make; False when none would (Dynamo would trace). Only those entries count: an entry someone else compiled may be
    a graph the artifact does not cover.

    Costs ~20 us for a dozen entries (CPU, torch 2.13): each failing entry stops at its first failing guard."""
    f_locals = frame_locals(arguments)
    # a recorded entry Dynamo no longer has (after a Dynamo reset) would not serve the call: Dynamo would trace
    guards = (_dynamo.entry_guards(e) for e in dynamo_entries(mode, dynamic))
    return next((g for g in guards if g in served_by and _dynamo.guards_pass(g, f_locals)), False)


@contextlib.contextmanager
def trace_settings(
    dynamic: bool, arguments: Mapping[str, Any] | None = None, marks: Collection[str] | None = None
) -> Iterator[None]:
    """What a call that may trace runs under: for a dynamic graph, its marks (:func:`resolve_marks` of ``arguments``;
    ``marks`` None: those of :func:`marking`) symbolic and everything else static, and no duck sizing.

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
    # a dynamic graph keeps a mask's closure ints symbolic, which inductor's CPU template renames wrongly
    fix_cpu_flex_split_names()
    if marks is None:
        marks = _marking.get() or ()
    tensors, sources = resolve_marks(marks, arguments or {})
    # Floats specialized, as in a static graph: a dynamic float (flex's scale) is traced into a graph AOTAutograd
    # cannot cache, compiled again in every process (CPU, torch 2.13: one AOTAutograd miss per fresh process).
    with _dynamo.dynamic_trace_settings(), _dynamo.marked_trace(tensors, sources):
        yield


def guard_failure(guards: Any, arguments: Mapping[str, Any]) -> str:
    """The first guard of an entry (its guards, as :func:`serving_entry` gives them) that a call fails, in Dynamo's
    words (e.g. ``tensor 'L['query']' stride mismatch at index 1``); empty when it passes or torch cannot say."""
    return _dynamo.guard_failure(guards, frame_locals(arguments))


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
    if _dynamo.imported():  # nothing traces before Dynamo is imported, and importing it costs a second
        _dynamo.raise_recompile_limit(_recompile_floor)


# ------------------------------------------------------------------------------------------ settings in the keys


def key_settings_differences(built: Mapping[str, str], device_type: str) -> list[tuple[str, str, str]]:
    """(name, builder's value, this process's value) for every setting in inductor's cache keys
    (:func:`key_settings`) that differs; names one side lacks are skipped (another torch build is refused by the
    build key, not here). A process whose settings differ from the builder's misses every entry, whatever
    kernelpack's call signatures say."""
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
    """While another thread FX-traces, a compiled call in this one may raise, run uncompiled, or fail every warmed
    entry's guards (:func:`kernelpack._torch.fx.foreign_trace` says when, per torch version). Wait for the trace to
    end, bounded by ``limit`` (default KERNELPACK_FX_WAIT_SECONDS)."""
    if not _fx.foreign_trace():
        return
    if limit is None:
        limit = settings.fx_wait_seconds()
    deadline = time.monotonic() + limit
    while _fx.foreign_trace():
        if time.monotonic() > deadline:
            raise KernelpackError(
                f"another thread has been FX-tracing for over {limit:.0f} s; a compiled call now would run "
                "flex_attention uncompiled or trace it again",
                hint="do not FX-trace (torch.fx.symbolic_trace, make_fx) in parallel with the first steps, or raise "
                + (
                    "KERNELPACK_BACKWARD_WAIT_SECONDS (this call is inside a backward pass)"
                    if in_backward()
                    else "KERNELPACK_FX_WAIT_SECONDS"
                ),
            )
        time.sleep(0.001)
