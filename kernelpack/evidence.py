"""Evidence that a process compiled nothing and never ran flex_attention's dense path, read from torch itself
(:mod:`kernelpack._torch` reads it: the names and versions are there).

- FX-graph / AOTAutograd cache hits and misses: torch's own process-wide counters.
- A Triton kernel really compiled: Triton's compile listener with ``cache_hit=False`` (a disk-cache load reports
  ``cache_hit=True``). Inductor's ``async_compile_cache_miss`` is NOT that signal: it counts every Triton compile
  call inductor makes, warm FX-graph hits included.
- A C++ kernel really compiled: inductor's C++ build of a kernel runs only when the .so is missing (not counting the
  preprocessor runs it makes on warm starts).
- The dense path: flex_attention's eager implementation called with real tensors, which materializes the full
  ``[B, H, Q, KV]`` score matrix.

The listener and the wrapper see in-process work only; run with ``TORCHINDUCTOR_COMPILE_THREADS=1`` (the verifier
does) so inductor compiles in-process, or compiles in its worker pool go unseen.

Per compile (:func:`watch_compiles`, what the runtime reports): torch records metrics for every frame compile and
every lazy backward compile, in the compiling thread, with its compile id and the counts of that compile's FX-graph
and AOTAutograd cache hits and misses; so compiles in concurrent threads are told apart, where the process-wide
counters above are not. Dynamo's compile-start callback lets the runtime refuse a compile before it runs. Kernels
compiled and dense calls are charged to the compile or call in flight in the thread that made them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from . import _imports
from ._torch import dynamo as _dynamo
from ._torch import flex as _flex
from ._torch import inductor as _inductor
from ._torch import triton as _triton
from .errors import DenseFallbackError, KernelpackError

_lock = threading.Lock()
_installed = False
own = Counter[str]()  # OWN_COUNTERS

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
        _hook_dense()
        _installed = True
    # Triton's listener and inductor's C++ builds the moment their modules are imported (nothing compiles before
    # they are): importing them here would cost the job's start 1.5-3 s. Outside the lock: a module
    # imported already is hooked now, in this thread.
    global triton_detection
    if importlib.util.find_spec("triton") is None:
        triton_detection = "no triton"
    else:
        triton_detection = "when Triton is imported"
        _imports.after_import("triton", lambda _: _hook_triton())
    _inductor.watch_cpp_builds_when_imported(_on_cpp_build)


def set_refuse_dense(refuse: bool) -> None:
    """Whether the dense path raises DenseFallbackError (the runtime guard) or is only counted (the verifier)."""
    global _refuse_dense
    _refuse_dense = refuse


def snapshot() -> dict[str, int]:
    snap = _dynamo.counter_values()
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

    def kernel(cache_hit: bool) -> None:
        own["triton_cache_loaded" if cache_hit else "triton_compiled"] += 1
        if not cache_hit:
            _charge("triton_compiled")

    triton_detection = _triton.watch_compiles(kernel)


def _on_cpp_build(compiled: bool) -> None:
    if compiled:
        own["cpp_compiled"] += 1
        _charge("cpp_compiled")
    else:
        own["cpp_preprocessed"] += 1


def dense_score_bytes(query: Any, key: Any) -> int:
    """Memory of the score matrix the dense path materializes: B x Hq x Q x KV in float32 (math runs upcast)."""
    b, h, q_len, _ = query.shape
    return int(b * h * q_len * key.shape[-2] * 4)


def _hook_dense() -> None:
    def dense(query: Any, key: Any) -> None:
        nbytes = dense_score_bytes(query, key)
        own["dense_calls"] += 1
        own["dense_bytes"] += nbytes
        _record_dense(query, key, nbytes)
        if _refuse_dense:
            raise DenseFallbackError(
                f"flex_attention was about to run its dense math path (not compiled): a {tuple(query.shape)} x "
                f"{tuple(key.shape)} call would materialize {_human(nbytes)} of float32 scores",
                score_bytes=nbytes,
            )

    _flex.watch_dense_calls(dense)


def _human(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


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
    earlier ones; None keeps the one in place). The records come from torch's per-compile metrics, which torch
    makes in the compiling thread once per compile, concurrent compiles included; Dynamo's compile-start callback
    gives ``on_start`` the frame about to be compiled, but torch runs it only for the first of compiles in flight at
    once (its pending counter is process-wide), so a refusal there is best effort."""
    global _on_record, _on_start, compile_detection
    with _lock:
        # a caller that only wants the records (a benchmark, verify) must not unhook the runtime's callbacks
        _on_record = on_record if on_record is not None else _on_record
        _on_start = on_start if on_start is not None else _on_start
        if compile_detection != "not installed":
            return
        compile_detection = "when Dynamo is imported"
    # when Dynamo is imported (now, if it is: nothing has compiled before; importing it costs a second)
    try:
        _dynamo.when_imported(_hook_compiles)
    except BaseException:
        compile_detection = "not installed"
        raise


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


def _hook_compiles() -> None:
    global compile_detection
    detection = _dynamo.watch_compile_metrics(_record_compile)
    with contextlib.suppress(ImportError, AttributeError):  # without it, compiles are recorded but not refusable
        _dynamo.watch_compile_starts(_compile_starting)
    compile_detection = detection


def ensure_watching() -> None:
    """Register the compile-start callback again if a Dynamo reset cleared it (it clears every callback; the
    metrics hook survives)."""
    if compile_detection != _dynamo.COMPILE_DETECTION:
        return
    with contextlib.suppress(ImportError, AttributeError):
        _dynamo.ensure_watching_starts(_compile_starting)


def per_compile_counts() -> bool:
    """Whether compiles are told apart by torch's per-compile metrics (else only process-wide counters exist)."""
    return compile_detection == _dynamo.COMPILE_DETECTION


def _compile_starting(*args: Any) -> None:
    _tls.pending = Counter()  # what a kernel build outside any compile left behind is not this compile's
    if _on_start is None or not _dynamo.is_frame_compile(*args) or getattr(_tls, "tag", None) is not None:
        return  # only Dynamo's own frame compiles are refusable, and not kernelpack's own
    try:
        _on_start(_dynamo.compiled_frame_locals())
    except KernelpackError:  # the runtime's refusal (strict mode)
        raise
    except Exception:  # the policy must never break a compile it does not mean to refuse
        import logging

        logging.getLogger(__name__).debug("kernelpack's compile-start check failed", exc_info=True)


def _record_compile(facts: _dynamo.CompileFacts) -> None:
    frame = _dynamo.compiled_frame_locals()
    pending: Counter[str] = getattr(_tls, "pending", None) or Counter()
    _tls.pending = Counter()
    record = CompileRecord(
        seq=next(_seq),
        compile_id=facts.compile_id,
        forward=facts.forward,
        thread=threading.current_thread().name,
        code=facts.code,
        site=_user_site(),
        seconds=facts.seconds,
        fx_hits=facts.fx_hits,
        fx_misses=facts.fx_misses,
        aot_hits=facts.aot_hits,
        aot_misses=facts.aot_misses,
        codegen_seconds=facts.codegen_seconds,
        triton_compiled=pending["triton_compiled"],
        cpp_compiled=pending["cpp_compiled"],
        failed=facts.failed,
        tag=getattr(_tls, "tag", None),
    )
    if not facts.forward:  # the lazy backward of an earlier compile: same call, same code path
        with _lock:
            first = next((r for r in reversed(_records) if r.compile_id == facts.compile_id and r.forward), None)
        if first is not None:
            record.code, record.site = first.code, record.site or first.site
            record.tag, record.note = record.tag or first.tag, first.note
    with _lock:
        if len(_records) >= _RECORDS_MAX:
            del _records[: _RECORDS_MAX // 2]
        _records.append(record)
    if _on_record is not None:
        _on_record(record, frame if facts.forward else None)


def _charge(what: str) -> None:
    """Charge a kernel compile to the compile in flight in this thread (read when its record is made). A kernel
    built outside any compile (a user's own Triton kernel, a C++ extension) is charged to none."""
    if not _dynamo.compiling_in_this_thread():
        return
    pending = getattr(_tls, "pending", None)
    if pending is None:
        pending = _tls.pending = Counter()
    pending[what] += 1


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
