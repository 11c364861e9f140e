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
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from typing import Any

from .errors import DenseFallbackError

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
        return original(self, *args, **kwargs)

    CUDABackend.add_stages = add_stages  # type: ignore[method-assign]
    triton_detection = "CUDABackend.add_stages"


def _hook_cpp() -> None:
    from torch._inductor import cpp_builder

    original = cpp_builder.CppBuilder.build

    @functools.wraps(original)
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Inductor runs the preprocessor (gcc -E) on warm starts too, to hash headers: not a kernel compile.
        own["cpp_preprocessed" if getattr(self, "_preprocessing", False) else "cpp_compiled"] += 1
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
