"""Dynamo: its cache entries and their guard managers, its config (the recompile limit, what a dynamic trace runs
under), its counters, and the per-compile metrics and callbacks that tell one compile from another.

Every function here serves torch 2.11-2.15 (the names below are the same in all five; tests/test_torch_internals.py
runs each on the torch it is given).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
import sys
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._imports import after_import
from . import unsupported

# ------------------------------------------------------------------------------------------------ cache entries


def cache_entries(code: Any) -> list[Any]:
    """Dynamo's cache entries for a code object, most recent first (each has a backend and a guard manager: see
    :func:`entry_backend`, :func:`entry_guards`). torch 2.11-2.15: ``_debug_get_cache_entry_list``."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError as e:
        raise unsupported("Dynamo does not expose its cache entries (_debug_get_cache_entry_list)") from e
    return list(_debug_get_cache_entry_list(code))


def entry_backend(entry: Any) -> Any:
    """The backend an entry was compiled with (compared by value, as Dynamo's lookup does). torch 2.11-2.15."""
    return entry.backend


def entry_guards(entry: Any) -> Any:
    """An entry's guard manager (kernelpack keeps them as the identity of what served a call). torch 2.11-2.15."""
    return entry.guard_manager


_backends: dict[tuple[str | None, bool | None], Any] = {}


def inductor_backend(mode: str | None, dynamic: bool | None) -> Any:
    """The backend ``torch.compile(..., mode=mode, dynamic=dynamic)`` gives its frames, equal by value to the one in
    their cache entries. torch 2.11-2.15: ``_TorchCompileInductorWrapper(mode, options, dynamic)``."""
    key = (mode, dynamic)
    if key not in _backends:
        try:
            from torch import _TorchCompileInductorWrapper
        except ImportError as e:
            raise unsupported("torch.compile's inductor backend wrapper (_TorchCompileInductorWrapper) is gone") from e
        _backends[key] = _TorchCompileInductorWrapper(mode, None, dynamic)
    return _backends[key]


# Dynamo guards a graph whose trace flattened a pytree (flex_attention flattens its BlockMask) on torch's registry of
# pytree node types, torch.utils._pytree.SUPPORTED_NODES: a length check, the registry's keys by position, which
# types are in it and which are not. A job adds to the registry after activate(): importing a transformers model
# module registers its ModelOutput classes (146 nodes after `from transformers import Gemma3ForCausalLM`, 140
# before, torch 2.13). Every graph traced before would fail its guards, and a precompiled function keeps the guards
# of the builder's process, whose count no job has. The node types the graphs flatten (tuple, list, dict, the
# BlockMask) are registered by torch at its import and never change; dropping these guards costs nothing a job can
# hit. (torch's own default filter for aot_compile drops globals and unserializable guards but keeps these.)
# The registry by either of its sources: ``__import__('torch').utils._pytree.SUPPORTED_NODES`` and, as a global of
# flex_attention's module, ``G['__import_torch_dot_utils_dot__pytree'].SUPPORTED_NODES`` (torch 2.15 hangs the
# length check of an in-process graph on that one, whose only guard of its own is DUPLICATE_INPUT).
_REGISTRY = re.compile(r"pytree\W*\.SUPPORTED_NODES\b")


def guard_filter(*, serializable: bool) -> Callable[[Sequence[Any]], list[bool]]:
    """A ``guard_filter_fn`` for torch.compile that drops the guards on torch's pytree registry (above), and, for a
    function compiled ahead of time (``serializable``), what torch's default filter for aot_compile drops: guards on
    globals and guard types it cannot serialize. torch 2.11-2.15: ``GuardFilterEntry.name/.is_global/.guard_type``,
    ``CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES``."""
    unserializable: Collection[str] = ()
    if serializable:
        from torch._dynamo.guards import CheckFunctionManager

        try:
            unserializable = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
        except AttributeError as e:
            raise unsupported("Dynamo's list of unserializable guard types is gone") from e

    def keep(entries: Sequence[Any]) -> list[bool]:
        return [
            not _REGISTRY.search(g.name) and not (serializable and (g.is_global or g.guard_type in unserializable))
            for g in entries
        ]

    return keep


def compile_options(mode: str | None, dynamic: bool | None, *, serializable: bool = False) -> dict[str, Any]:
    """``torch.compile``'s ``options=`` for ``mode``, with :func:`guard_filter`. torch takes a mode or options, not
    both: a mode's options are spelled out as torch applies them (``list_mode_options(mode, dynamic)``), so the
    backend is equal to that of ``torch.compile(mode=mode)`` (:func:`inductor_backend`) and its cache keys the
    same. torch 2.11-2.15 (``guard_filter_fn`` is popped from the options before the backend sees them)."""
    options: dict[str, Any] = {}
    if mode not in (None, "default"):
        from torch._inductor import list_mode_options

        options.update(list_mode_options(mode, dynamic))
    options["guard_filter_fn"] = guard_filter(serializable=serializable)
    return options


def guards_pass(manager: Any, f_locals: Mapping[str, Any]) -> bool:
    """Whether a frame with these locals passes the guard manager's guards, run in the calling thread (guards read
    its grad mode and autocast state). torch 2.11-2.15: ``GuardManagerWrapper.check``."""
    return bool(manager.check(f_locals))


def guard_failure(manager: Any, f_locals: Mapping[str, Any]) -> str:
    """The guards a frame fails, in Dynamo's words (e.g. ``tensor 'L['query']' stride mismatch at index 1``); "" when
    it passes or torch cannot say. torch 2.11-2.15: ``check_verbose(...).verbose_code_parts``."""
    try:
        verbose = manager.check_verbose(f_locals)
    except Exception:  # the reason is a courtesy: the caller's refusal stands without it
        return ""
    if verbose.result:
        return ""
    return "; ".join(str(p).split("  #")[0].strip() for p in verbose.verbose_code_parts)


def free_values(manager: Any, root: str, values: Mapping[str, tuple[str, str]]) -> set[str]:
    """Which of a function's values a graph's guards leave free: the paths (of ``values``: path -> (source below
    ``root``, kind "scalar" or "tensor")) that no guard pins to a value. A scalar is pinned by an equality or identity
    guard (``S == 2048``, ``window is None``, an object id); a type guard (``___check_type_id``) or a relation among
    symbols (``4 <= flag``, Dynamo's guard on a branch) leaves it free: other values pass the type guard, and Dynamo
    runs the relations at every call. A tensor is never pinned by value; its dimension ``path.shape[i]`` is free when
    the tensor guard's ``size=[...]`` has None there (a dynamic dimension). A value no guard names is not read by
    the graph: free. torch 2.11-2.15: ``GuardManagerWrapper.code_parts`` (the guards' Python source)."""
    import re

    parts = [str(p) for p in getattr(manager, "code_parts", None) or ()]
    if not parts:
        raise unsupported("Dynamo's guard manager lists no guard code (GuardManagerWrapper.code_parts)")
    free: set[str] = set()
    for path, (below, kind) in values.items():
        source = re.escape(root + below) + r"(?![\w.\[])"  # the value itself, not an attribute of it
        mentions = [p for p in parts if re.search(source, p)]
        if kind == "tensor":
            sizes = [
                m.group(1)
                for p in mentions
                if (m := re.search(r"check_tensor\(" + source + r".*?size=\[([^\]]*)\]", p))
            ]
            dims = sizes[0].split(",") if sizes else None
            if dims is None:
                free.add(f"{path}.shape")  # not read: every dimension is free
                continue
            free.update(f"{path}.shape[{i}]" for i, d in enumerate(dims) if d.strip() == "None")
            continue
        pinned = any(
            re.search(source + r"\s*(==|is\b)", p)
            or re.search(r"(==|\bis)\s*" + source, p)
            or re.search(r"___check_obj_id\(" + source, p)
            for p in mentions
        )
        if not pinned:
            free.add(path)
    return free


# ------------------------------------------------------------------------------------------------ config


def raise_recompile_limit(floor: int) -> None:
    """Raise Dynamo's per-code-object recompile limit (and the accumulated limit, to 4x) to at least ``floor`` in
    this thread: since torch 2.12 a Dynamo config assignment is a per-thread override (pytorch #186537: the backward
    thread does not inherit it). torch 2.11-2.15: ``recompile_limit``, ``accumulated_recompile_limit``."""
    import torch._dynamo.config as config

    if config.recompile_limit < floor:
        config.recompile_limit = floor
    if config.accumulated_recompile_limit < 4 * floor:
        config.accumulated_recompile_limit = 4 * floor


@contextlib.contextmanager
def dynamic_trace_settings() -> Iterator[None]:
    """What a dynamic graph is traced under: no duck sizing (two sizes equal at trace time stay two symbols) and
    floats specialized (a dynamic float, flex's scale, is traced into a graph AOTAutograd cannot cache).
    torch 2.11-2.15: ``torch.fx.experimental._config.use_duck_shape``, ``torch._dynamo.config.specialize_float``;
    on torch < 2.12 the patch is process-wide while it lasts."""
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(use_duck_shape=False), dynamo_config.patch(specialize_float=True):  # type: ignore[attr-defined]
        yield


@contextlib.contextmanager
def marked_trace(tensors: Sequence[tuple[Any, tuple[int, ...]]], sources: Sequence[str]) -> Iterator[None]:
    """A trace that keeps exactly these tensor dimensions and these int sources (Dynamo's names, e.g.
    ``L['block_mask'].mask_mod.__closure__[3].cell_contents``) symbolic and every other size and int static: the
    graph torch's automatic dynamic would make after meeting the values that vary, made on the first call.

    ``dynamic=True`` makes every size and int symbolic (batch, heads, head_dim, the mask's block size): on the H200 a
    DFlash-shaped fwd+bwd call ran 17.9 ms against 10.6 ms for the automatic-dynamic graph (docs/BENCHMARKS.md).
    torch 2.11-2.15: ``torch._dynamo.maybe_mark_dynamic`` (a weak mark: a dimension the trace specializes, a size of
    0 or 1, stays static instead of raising), ``torch.compiler.config.dynamic_sources`` (regexes matched against a
    source's name; an int is made symbolic where Dynamo wraps it, VariableBuilder.wrap_literal) and the settings
    ``dynamic=False`` traces under (no automatic dynamic, static by default), so that the graph does not depend on
    what the process met before. The marks on tensors are taken off again; on torch < 2.12 the config patch is
    process-wide while it lasts (only first calls trace, alone at kernelpack's gate)."""
    import re

    import torch
    import torch._dynamo.config as dynamo_config

    marked: list[tuple[Any, dict[str, Any]]] = []
    for t, dims in tensors:
        marked.append((t, {a: copy.copy(getattr(t, a)) for a in _MARK_ATTRIBUTES if hasattr(t, a)}))
        torch._dynamo.maybe_mark_dynamic(t, list(dims))
    patterns = ",".join(re.escape(s) + "$" for s in sources)
    try:
        with (
            torch.compiler.config.patch(dynamic_sources=patterns),  # type: ignore[attr-defined]
            dynamo_config.patch(automatic_dynamic_shapes=False, assume_static_by_default=True),  # type: ignore[attr-defined]
        ):
            yield
    finally:
        for t, had in marked:
            for a in _MARK_ATTRIBUTES:
                if a in had:
                    setattr(t, a, had[a])
                elif hasattr(t, a):
                    delattr(t, a)


# What maybe_mark_dynamic sets on a tensor. Both are taken off after the trace: torch 2.13's guards check the flag
# alone, and a tensor left with the flag but no indices fails the guard of the very frame it was traced in
# ("_has_dynamo_dim_marking is present on runtime tensor but was absent at compile time": eager flex_attention's own
# compile of its HOP, on the job's tensors).
_MARK_ATTRIBUTES = ("_dynamo_weak_dynamic_indices", "_has_dynamo_dim_marking")


# ------------------------------------------------------------------------------------------------ counters

# torch's process-wide counters that kernelpack reads, as (group, name): cache hits and misses of the FX-graph and
# AOTAutograd caches, inductor's compile calls (warm hits included), bundled kernels re-emitted, frames compiled
COUNTERS = (
    ("inductor", "fxgraph_cache_hit"),
    ("inductor", "fxgraph_cache_miss"),
    ("inductor", "fxgraph_cache_bypass"),
    ("aot_autograd", "autograd_cache_hit"),
    ("aot_autograd", "autograd_cache_miss"),
    ("aot_autograd", "autograd_cache_bypass"),
    ("inductor", "async_compile_cache_miss"),
    ("inductor", "triton_bundler_read_and_emit_kernel"),
    ("frames", "ok"),
)


def counter_values() -> dict[str, int]:
    """:data:`COUNTERS` now, as ``{"group.name": count}``. torch 2.11-2.15: ``torch._dynamo.utils.counters``."""
    from torch._dynamo.utils import counters

    return {f"{group}.{name}": int(counters[group][name]) for group, name in COUNTERS}


def compiled_already() -> bool:
    """Whether Dynamo or inductor compiled anything in this process (without importing Dynamo if it is not).
    torch 2.11-2.15."""
    if "torch._dynamo" not in sys.modules:
        return False
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"] > 0 or bool(counters["inductor"])


# ------------------------------------------------------------------------------------------------ per compile


@dataclass(frozen=True, slots=True)
class CompileFacts:
    """What torch's metrics say of one compile, in kernelpack's words (None: this torch does not count it)."""

    compile_id: str
    forward: bool  # False: the lazy compile of an earlier compile's backward
    code: str  # the compiled frame, "co_name (file:line)"
    seconds: float | None
    fx_hits: int | None
    fx_misses: int | None
    aot_hits: int | None
    aot_misses: int | None
    codegen_seconds: float  # inductor generated code: a cache miss, or a graph the FX cache bypassed
    failed: str | None


def _facts(m: Any) -> CompileFacts:
    def count(*names: str) -> int | None:
        known = [int(getattr(m, n) or 0) for n in names if hasattr(m, n)]
        return sum(known) if known else None

    start, end = getattr(m, "start_time_us", None), getattr(m, "end_time_us", None)
    return CompileFacts(
        compile_id=str(m.compile_id),
        forward=getattr(m, "is_forward", True) is not False,
        code=f"{m.co_name} ({m.co_filename}:{m.co_firstlineno})" if m.co_name else "",
        seconds=(end - start) / 1e6 if start is not None and end is not None else None,
        fx_hits=count("inductor_fx_local_cache_hit_count", "inductor_fx_remote_cache_hit_count"),
        fx_misses=count("inductor_fx_local_cache_miss_count", "inductor_fx_remote_cache_miss_count"),
        aot_hits=count("aotautograd_local_cache_hit_count", "aotautograd_remote_cache_hit_count"),
        aot_misses=count("aotautograd_local_cache_miss_count", "aotautograd_remote_cache_miss_count"),
        codegen_seconds=(getattr(m, "inductor_code_gen_cumulative_compile_time_us", None) or 0) / 1e6,
        failed=f"{m.fail_type}: {m.fail_reason}" if getattr(m, "fail_type", None) else None,
    )


COMPILE_DETECTION = "torch's per-compile metrics"


def watch_compile_metrics(on_compile: Callable[[CompileFacts], None]) -> str:
    """Call ``on_compile`` in the compiling thread as torch records each compile's metrics (concurrent compiles
    included), never letting it break the compile; returns how compiles are seen (:data:`COMPILE_DETECTION`).
    torch 2.11-2.15: ``CompilationMetrics.create``, a classmethod torch calls once per compile."""
    from torch._dynamo import utils as dynamo_utils

    create = getattr(getattr(dynamo_utils, "CompilationMetrics", None), "create", None)
    if create is None:
        raise unsupported("Dynamo records no per-compile metrics (CompilationMetrics.create)")
    original = create.__func__

    @functools.wraps(original)
    def recorded(cls: Any, metrics: dict[str, Any]) -> Any:
        made = original(cls, metrics)
        try:
            on_compile(_facts(made))
        except Exception:  # evidence must never break a compile
            import logging

            logging.getLogger(__name__).debug("kernelpack could not record a compile", exc_info=True)
        return made

    dynamo_utils.CompilationMetrics.create = classmethod(recorded)  # type: ignore[assignment]
    return COMPILE_DETECTION


def watch_compile_starts(callback: Callable[..., None]) -> None:
    """Register ``callback`` for the start of Dynamo compiles, and again whenever ``torch._dynamo.reset()`` clears
    every callback. torch runs it only for the first of compiles in flight at once (its pending counter is
    process-wide). torch 2.11-2.15: ``torch._dynamo.callback``; the callback gets ``CallbackArgs`` (see
    :func:`is_frame_compile`)."""
    from torch._dynamo.callback import callback_handler
    from torch._dynamo.callback import on_compile_start as register

    register(callback)
    clear = callback_handler.clear

    @functools.wraps(clear)
    def clear_then_register() -> None:
        clear()
        register(callback)

    callback_handler.clear = clear_then_register  # type: ignore[method-assign]


def ensure_watching_starts(callback: Callable[..., None]) -> None:
    """Register ``callback`` again if something cleared Dynamo's callbacks past :func:`watch_compile_starts`'s watch.
    torch 2.11-2.15."""
    from torch._dynamo.callback import callback_handler
    from torch._dynamo.callback import on_compile_start as register

    if callback not in callback_handler.start_callbacks:
        register(callback)


def is_frame_compile(*args: Any) -> bool:
    """Whether a compile-start callback's arguments are for a Dynamo frame compile (not a lazy backward compile).
    torch 2.11-2.15: ``CallbackArgs.callback_trigger``."""
    trigger = getattr(args[0], "callback_trigger", None) if args else None
    return getattr(trigger, "name", "DYNAMO") == "DYNAMO"


def compiling_in_this_thread() -> bool:
    """A Dynamo frame compile, or a lazy backward compile, is in flight in this thread (torch's thread-local metrics
    contexts are open exactly then). torch 2.11-2.15."""
    try:
        from torch._dynamo import utils as dynamo_utils

        if dynamo_utils.get_metrics_context().in_progress():
            return True
        return bool(getattr(dynamo_utils.get_runtime_metrics_context(), "_metrics", None))
    except Exception:  # the contexts moved: charge the kernel to the compile, as before they existed
        return True


def compiled_frame_locals() -> Mapping[str, Any] | None:
    """The locals of the frame Dynamo is compiling in this thread, from its compile's stack: convert_frame holds it
    as the local ``frame`` (a frame object, or Dynamo's DynamoFrameType). None when not found. torch 2.11-2.15."""
    f: Any = sys._getframe(1)
    while f is not None:
        candidate = f.f_locals.get("frame") if "convert_frame" in f.f_code.co_filename else None
        if candidate is not None and hasattr(candidate, "f_code") and hasattr(candidate, "f_locals"):
            return candidate.f_locals  # type: ignore[no-any-return]
        f = f.f_back
    return None


def when_imported(hook: Callable[[], None]) -> None:
    """``hook()`` once Dynamo is imported: now if it is, else right after its import (:mod:`kernelpack._imports`),
    before anything can compile. torch 2.11-2.15."""
    after_import("torch._dynamo", lambda _: hook())


def imported() -> bool:
    """Whether Dynamo is imported in this process (nothing has compiled before it is). Importing it also makes
    inductor's cache dir (``TORCHINDUCTOR_CACHE_DIR``): torch/_dynamo/package.py calls ``cache_dir()`` at import
    (torch 2.11-2.15)."""
    return "torch._dynamo" in sys.modules
