"""Evidence that a process compiled nothing and never ran flex_attention's dense path, read from torch itself.

- FX-graph / AOTAutograd cache hits and misses: ``torch._dynamo.utils.counters`` (torch's own counters).
- A Triton kernel really compiled: Triton's ``knobs.compilation.listener`` with ``cache_hit=False`` (a disk-cache
  load reports ``cache_hit=True``). Inductor's ``async_compile_cache_miss`` is NOT that signal: it counts every
  ``AsyncCompile.triton()`` call, warm FX-graph hits included.
- A C++ kernel really compiled: ``CppBuilder.build`` runs only when the .so is missing.
- The dense path: flex_attention's eager implementation (``sdpa_dense``, registered for
  CompositeExplicitAutograd on the higher-order op) called with real tensors, which materializes the full
  ``[B, H, Q, KV]`` score matrix.

The listener and the wrapper see in-process work only; run with ``TORCHINDUCTOR_COMPILE_THREADS=1`` (the verifier
does) so inductor compiles in-process, or compiles in its worker pool go unseen.

Per compile (:func:`watch_compiles`, what the runtime reports): Dynamo's compile callbacks
(``torch._dynamo.callback.on_compile_start/on_compile_end``) run in the compiling thread around every frame compile
and every lazy backward compile, with its compile id; the counts of that compile's FX-graph and AOTAutograd cache
hits and misses are read from its own compilation metrics (the thread's ``MetricsContext``, or the
``CompilationMetrics`` torch records after it), so compiles in concurrent threads are told apart, where the
process-global counters above are not. Kernels compiled and dense calls are charged to the compile or call in
flight in the thread that made them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import DenseFallbackError, KernelpackError

_lock = threading.Lock()
_installed = False
own = Counter[str]()  # OWN_COUNTERS

TORCH_COUNTERS = (
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
OWN_COUNTERS = (
    "triton_compiled",
    "triton_cache_loaded",
    "cpp_compiled",
    "cpp_preprocessed",
    "dense_calls",
    "dense_bytes",
)


_refuse_dense = False
triton_detection = "not installed"  # how Triton compiles are seen; verify reports it


def install_hooks(*, refuse_dense: bool = False) -> None:
    """Idempotent. Must run before the first compile: Triton reads its listener when ``compile()`` starts."""
    global _installed, _refuse_dense
    with _lock:
        _refuse_dense = _refuse_dense or refuse_dense
        if _installed:
            return
        _hook_triton()
        _hook_cpp()
        _hook_dense()
        _installed = True


def set_refuse_dense(refuse: bool) -> None:
    """Whether the dense path raises DenseFallbackError (the runtime guard) or is only counted (the verifier)."""
    global _refuse_dense
    _refuse_dense = refuse


def snapshot() -> dict[str, int]:
    from torch._dynamo.utils import counters

    snap = {f"{group}.{name}": int(counters[group][name]) for group, name in TORCH_COUNTERS}
    snap.update({name: int(own[name]) for name in OWN_COUNTERS})
    return snap


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def compiled_anything(d: dict[str, int]) -> list[str]:
    """The reasons a counter delta shows compilation or dense execution; empty means a clean first call."""
    reasons = []
    for key, what in (
        ("inductor.fxgraph_cache_miss", "FX-graph cache misses"),
        ("aot_autograd.autograd_cache_miss", "AOTAutograd cache misses"),
        ("inductor.fxgraph_cache_bypass", "FX-graph cache bypasses"),
        ("aot_autograd.autograd_cache_bypass", "AOTAutograd cache bypasses"),
        ("triton_compiled", "Triton kernels compiled"),
        ("cpp_compiled", "C++ kernels compiled"),
        ("dense_calls", "dense (math) flex_attention calls"),
    ):
        if d.get(key, 0) > 0:
            reasons.append(f"{d[key]} {what}")
    return reasons


def _hook_triton() -> None:
    global triton_detection
    try:
        import triton
    except ImportError:
        triton_detection = "no triton"
        return
    try:
        from triton import knobs  # triton >= 3.4
    except ImportError:
        knobs = None
    if knobs is not None:
        previous = knobs.compilation.listener

        def listener(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
            own["triton_cache_loaded" if cache_hit else "triton_compiled"] += 1
            if not cache_hit:
                _charge("triton_compiled")
            if previous is not None:
                previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

        knobs.compilation.listener = listener
        triton_detection = "knobs.compilation.listener"
        return
    # Older triton (3.2/3.3, shipped with torch 2.6-2.8): compile() reaches the backend's add_stages only on a miss.
    try:
        from triton.backends.nvidia.compiler import CUDABackend
    except ImportError:
        triton_detection = f"unavailable (triton {triton.__version__})"
        return
    original = CUDABackend.add_stages

    @functools.wraps(original)
    def add_stages(self: Any, *args: Any, **kwargs: Any) -> Any:
        own["triton_compiled"] += 1
        _charge("triton_compiled")
        return original(self, *args, **kwargs)

    CUDABackend.add_stages = add_stages  # type: ignore[method-assign]
    triton_detection = "CUDABackend.add_stages"


def _hook_cpp() -> None:
    from torch._inductor import cpp_builder

    original = cpp_builder.CppBuilder.build

    @functools.wraps(original)
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Inductor runs the preprocessor (gcc -E) on warm starts too, to hash headers: not a kernel compile.
        if getattr(self, "_preprocessing", False):
            own["cpp_preprocessed"] += 1
        else:
            own["cpp_compiled"] += 1
            _charge("cpp_compiled")
        return original(self, *args, **kwargs)

    cpp_builder.CppBuilder.build = build  # type: ignore[method-assign]


def dense_score_bytes(query: Any, key: Any) -> int:
    """Memory of the score matrix the dense path materializes: B x Hq x Q x KV in float32 (math runs upcast)."""
    b, h, q_len, _ = query.shape
    return int(b * h * q_len * key.shape[-2] * 4)


def _hook_dense() -> None:
    from torch._C import DispatchKey
    from torch._higher_order_ops.flex_attention import flex_attention as hop
    from torch._subclasses.fake_tensor import FakeTensor

    key = DispatchKey.CompositeExplicitAutograd
    original = hop.py_kernels[key]

    @functools.wraps(original)
    def dense(query: Any, key_: Any, *args: Any, **kwargs: Any) -> Any:
        # Tracing runs this with fake tensors to learn output shapes; only real tensors mean the dense math ran.
        if not isinstance(query, FakeTensor) and not _is_functional(query):
            nbytes = dense_score_bytes(query, key_)
            own["dense_calls"] += 1
            own["dense_bytes"] += nbytes
            _record_dense(query, key_, nbytes)
            if _refuse_dense:
                raise DenseFallbackError(
                    f"flex_attention was about to run its dense math path (not compiled): a {tuple(query.shape)} x "
                    f"{tuple(key_.shape)} call would materialize {_human(nbytes)} of float32 scores",
                    score_bytes=nbytes,
                )
        return original(query, key_, *args, **kwargs)

    hop.py_kernels[key] = dense
    # HOPs cache resolved kernels per dispatch key; drop the cache so the wrapper is used.
    cache = getattr(hop, "_dispatch_cache", None)
    if isinstance(cache, dict):
        cache.clear()


def _human(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _is_functional(t: Any) -> bool:
    import torch

    return bool(torch._is_functional_tensor(t)) if hasattr(torch, "_is_functional_tensor") else False


# ------------------------------------------------------------------------------------------------ per compile


@dataclass
class CompileRecord:
    """One compile torch made in this process: a Dynamo frame compile, or the lazy compile of its backward (same
    ``compile_id``, made when backward first runs, often on the autograd engine's thread)."""

    seq: int
    compile_id: str
    forward: bool  # False: the lazy backward compile of ``compile_id``'s graph
    thread: str
    code: str  # the compiled frame, "co_name (file:line)"
    site: str | None  # the first frame outside torch and kernelpack on the compiling thread's stack (file:line)
    seconds: float | None
    fx_hits: int | None  # FX-graph cache hits and misses, AOTAutograd ones; None: this torch does not count them
    fx_misses: int | None
    aot_hits: int | None
    aot_misses: int | None
    codegen_seconds: float = 0.0  # inductor generated code: a cache miss, or a graph the FX cache bypassed (or off)
    triton_compiled: int = 0
    cpp_compiled: int = 0
    failed: str | None = None  # what the compile raised
    tag: Any = None  # what kernelpack was doing in the compiling thread (:func:`tagged`); None: not kernelpack
    note: Any = None  # what the runtime attached (the call's signature, how it differs from the nearest covered)

    @property
    def missed(self) -> bool:
        """Compiled something: an FX-graph or AOTAutograd cache miss, code generated past a bypassed (or disabled)
        FX cache, or a kernel."""
        return bool(
            self.fx_misses or self.aot_misses or self.codegen_seconds or self.triton_compiled or self.cpp_compiled
        )

    @property
    def counters(self) -> dict[str, int]:
        """In :func:`snapshot`'s names."""
        return {
            "inductor.fxgraph_cache_hit": self.fx_hits or 0,
            "inductor.fxgraph_cache_miss": self.fx_misses or 0,
            "aot_autograd.autograd_cache_hit": self.aot_hits or 0,
            "aot_autograd.autograd_cache_miss": self.aot_misses or 0,
            # code generated with no FX miss: the FX cache was bypassed or turned off (torch counts no lookup then)
            "inductor.fxgraph_cache_bypass": int(bool(self.codegen_seconds) and not self.fx_misses),
            "triton_compiled": self.triton_compiled,
            "cpp_compiled": self.cpp_compiled,
        }


@dataclass(frozen=True)
class DenseRecord:
    """One call of flex_attention's dense math path with real tensors."""

    seq: int
    thread: str
    site: str | None
    query: tuple[int, ...]
    key: tuple[int, ...]
    dtype: str
    score_bytes: int
    tag: Any = None


# on_record(record, frame_locals): the runtime's, called in the compiling thread as each compile ends (never raises
# into torch); on_start(frame_locals): called as a Dynamo compile starts, may raise to refuse it
OnRecord = Callable[[CompileRecord, "Mapping[str, Any] | None"], None]
OnStart = Callable[["Mapping[str, Any] | None"], None]
_RECORDS_MAX = 10_000
_records: list[CompileRecord] = []
_dense: list[DenseRecord] = []
_seq = itertools.count()
_tls = threading.local()
_on_record: OnRecord | None = None
_on_start: OnStart | None = None
compile_detection = "not installed"  # how compiles are seen: verify and the report say it


def watch_compiles(on_record: OnRecord | None = None, on_start: OnStart | None = None) -> None:
    """Record every compile from now on (idempotent), and route each to ``on_record`` / ``on_start`` (replacing
    earlier ones; None keeps the one in place). The records come from ``CompilationMetrics.create``, which torch
    calls in the compiling thread once per compile, concurrent compiles included; Dynamo's compile-start callback
    gives ``on_start`` the frame about to be compiled, but torch runs it only for the first of compiles in flight at
    once (its pending counter is process-wide), so a refusal there is best effort."""
    global _on_record, _on_start, compile_detection
    with _lock:
        # a caller that only wants the records (a benchmark, verify) must not unhook the runtime's callbacks
        _on_record = on_record if on_record is not None else _on_record
        _on_start = on_start if on_start is not None else _on_start
        if compile_detection != "not installed":
            return
        compile_detection = _hook_compiles()


def compile_records(since: int = 0) -> list[CompileRecord]:
    """The compiles recorded with ``seq >= since``, oldest first."""
    with _lock:
        return [r for r in _records if r.seq >= since]


def dense_records(since: int = 0) -> list[DenseRecord]:
    with _lock:
        return [r for r in _dense if r.seq >= since]


def next_seq() -> int:
    """A mark: records made after it have ``seq >=`` it."""
    return next(_seq)


@contextlib.contextmanager
def tagged(tag: Any) -> Iterator[Any]:
    """Tag the compiles and dense calls this thread makes inside the block (kernelpack's own calls)."""
    previous = getattr(_tls, "tag", None)
    _tls.tag = tag
    try:
        yield tag
    finally:
        _tls.tag = previous


def _hook_compiles() -> str:
    from torch._dynamo import utils as dynamo_utils

    metrics_class = getattr(dynamo_utils, "CompilationMetrics", None)
    create = getattr(metrics_class, "create", None)
    if create is None:  # torch < 2.6
        return "unavailable (no CompilationMetrics.create)"
    original = create.__func__

    @functools.wraps(original)
    def recorded(cls: Any, metrics: dict[str, Any]) -> Any:
        made = original(cls, metrics)
        try:
            _record_compile(made)
        except Exception:  # evidence must never break a compile
            import logging

            logging.getLogger(__name__).debug("kernelpack could not record a compile", exc_info=True)
        return made

    metrics_class.create = classmethod(recorded)  # type: ignore[union-attr]
    with contextlib.suppress(ImportError, AttributeError):
        from torch._dynamo.callback import callback_handler, on_compile_start

        on_compile_start(_compile_starting)
        # torch._dynamo.reset() clears every compile callback: register ours again right after
        clear = callback_handler.clear

        @functools.wraps(clear)
        def clear_then_watch() -> None:
            clear()
            on_compile_start(_compile_starting)

        callback_handler.clear = clear_then_watch  # type: ignore[method-assign]
    return "CompilationMetrics.create"


def ensure_watching() -> None:
    """Register the compile-start callback again if ``torch._dynamo.reset()`` cleared it (it clears every callback;
    the metrics hook, a class attribute, survives)."""
    if compile_detection != "CompilationMetrics.create":
        return
    with contextlib.suppress(ImportError, AttributeError):
        from torch._dynamo.callback import callback_handler, on_compile_start

        if _compile_starting not in callback_handler.start_callbacks:
            on_compile_start(_compile_starting)


def _compile_starting(*args: Any) -> None:
    # torch >= 2.7 passes CallbackArgs(callback_trigger, compile_id); only Dynamo's own frame compiles are refusable
    _tls.pending = Counter()  # what a kernel build outside any compile left behind is not this compile's
    trigger = getattr(args[0], "callback_trigger", None) if args else None
    if _on_start is None or getattr(trigger, "name", "DYNAMO") != "DYNAMO" or getattr(_tls, "tag", None) is not None:
        return
    frame = _compiled_frame()
    try:
        _on_start(frame.f_locals if frame is not None else None)
    except KernelpackError:  # the runtime's refusal (strict mode)
        raise
    except Exception:  # the policy must never break a compile it does not mean to refuse
        import logging

        logging.getLogger(__name__).debug("kernelpack's compile-start check failed", exc_info=True)


def _record_compile(m: Any) -> None:
    def count(name: str) -> int | None:
        value = getattr(m, name, None)
        return None if value is None and not hasattr(m, name) else int(value or 0)

    frame = _compiled_frame()
    start, end = getattr(m, "start_time_us", None), getattr(m, "end_time_us", None)
    pending: Counter[str] = getattr(_tls, "pending", None) or Counter()
    _tls.pending = Counter()
    compile_id = str(m.compile_id)
    forward = getattr(m, "is_forward", True) is not False
    record = CompileRecord(
        seq=next(_seq),
        compile_id=compile_id,
        forward=forward,
        thread=threading.current_thread().name,
        code=f"{m.co_name} ({m.co_filename}:{m.co_firstlineno})" if m.co_name else "",
        site=_user_site(),
        seconds=(end - start) / 1e6 if start is not None and end is not None else None,
        fx_hits=_sum(count("inductor_fx_local_cache_hit_count"), count("inductor_fx_remote_cache_hit_count")),
        fx_misses=_sum(count("inductor_fx_local_cache_miss_count"), count("inductor_fx_remote_cache_miss_count")),
        aot_hits=_sum(count("aotautograd_local_cache_hit_count"), count("aotautograd_remote_cache_hit_count")),
        aot_misses=_sum(count("aotautograd_local_cache_miss_count"), count("aotautograd_remote_cache_miss_count")),
        codegen_seconds=(getattr(m, "inductor_code_gen_cumulative_compile_time_us", None) or 0) / 1e6,
        triton_compiled=pending["triton_compiled"],
        cpp_compiled=pending["cpp_compiled"],
        failed=f"{m.fail_type}: {m.fail_reason}" if getattr(m, "fail_type", None) else None,
        tag=getattr(_tls, "tag", None),
    )
    if not forward:  # the lazy backward of an earlier compile: same call, same code path
        with _lock:
            first = next((r for r in reversed(_records) if r.compile_id == compile_id and r.forward), None)
        if first is not None:
            record.code, record.site = first.code, record.site or first.site
            record.tag, record.note = record.tag or first.tag, first.note
    with _lock:
        if len(_records) >= _RECORDS_MAX:
            del _records[: _RECORDS_MAX // 2]
        _records.append(record)
    if _on_record is not None:
        _on_record(record, frame.f_locals if frame is not None and forward else None)


def _sum(*values: int | None) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _charge(what: str) -> None:
    """Charge a kernel compile to the compile in flight in this thread (read when its record is made). A kernel
    built outside any compile (a user's own Triton kernel, a C++ extension) is charged to none."""
    if not _compiling():
        return
    pending = getattr(_tls, "pending", None)
    if pending is None:
        pending = _tls.pending = Counter()
    pending[what] += 1


def _compiling() -> bool:
    """A Dynamo frame compile, or a lazy backward compile, is in flight in this thread (torch's thread-local metrics
    contexts are open exactly then)."""
    try:
        from torch._dynamo import utils as dynamo_utils

        if dynamo_utils.get_metrics_context().in_progress():
            return True
        runtime_context = getattr(dynamo_utils, "get_runtime_metrics_context", None)
        return runtime_context is not None and bool(getattr(runtime_context(), "_metrics", None))
    except Exception:  # another torch: charge it, as before these contexts existed
        return True


def _record_dense(query: Any, key: Any, nbytes: int) -> None:
    record = DenseRecord(
        seq=next(_seq),
        thread=threading.current_thread().name,
        site=_user_site(),
        query=tuple(query.shape),
        key=tuple(key.shape),
        dtype=str(query.dtype).removeprefix("torch."),
        score_bytes=nbytes,
        tag=getattr(_tls, "tag", None),
    )
    with _lock:
        if len(_dense) >= _RECORDS_MAX:
            del _dense[: _RECORDS_MAX // 2]
        _dense.append(record)


def _compiled_frame() -> Any:
    """The frame Dynamo is compiling, from the stack of its compile: convert_frame holds it as the local ``frame``
    (a frame object, or Dynamo's DynamoFrameType, both with f_code and f_locals). None when not found."""
    f: Any = sys._getframe(2)
    while f is not None:
        candidate = f.f_locals.get("frame") if "convert_frame" in f.f_code.co_filename else None
        if candidate is not None and hasattr(candidate, "f_code") and hasattr(candidate, "f_locals"):
            return candidate
        f = f.f_back
    return None


_SKIP = (os.sep + "torch" + os.sep, os.sep + "kernelpack" + os.sep, os.sep + "contextlib.py", os.sep + "threading.py")


def _user_site() -> str | None:
    """file:line of the innermost frame on this thread's stack that is neither torch, kernelpack nor the stdlib's
    plumbing: the code that made the call. None on a thread with no such frame (the autograd engine's)."""
    f: Any = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not any(s in name for s in _SKIP) and not name.startswith("<"):  # <frozen ...>, FX's <eval_with_key>
            return f"{name}:{f.f_lineno}"
        f = f.f_back
    return None


user_site = _user_site  # for kernelpack record: where a call was made


def fields_of(record: CompileRecord | DenseRecord) -> dict[str, Any]:
    """A record as JSON-able fields (its tag and note left to the caller)."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.name not in ("tag", "note")}
