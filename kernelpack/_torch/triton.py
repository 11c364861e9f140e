"""Triton: which kernels it really compiles (not loads from its disk cache); its source key, ahead of need."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from . import unsupported


def watch_compiles(on_kernel: Callable[[bool], None]) -> str:
    """Call ``on_kernel(cache_hit)`` for every kernel Triton compiles or loads from its disk cache in this process;
    returns how it is seen. Triton 3.6-3.9 (torch 2.11-2.15): ``triton.knobs.compilation.listener``, chained to a
    listener already there. "no triton" where Triton is not installed (a CPU build of torch)."""
    try:
        import triton
    except ImportError:
        return "no triton"
    try:
        from triton import knobs
    except ImportError as e:
        raise unsupported(f"triton {triton.__version__} has no knobs.compilation.listener (triton >= 3.4)") from e
    previous = knobs.compilation.listener

    def listener(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        on_kernel(cache_hit)
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    knobs.compilation.listener = listener
    return "Triton's compilation listener"


def prefetch_key() -> threading.Thread | None:
    """Start computing Triton's ``triton_key()`` in a thread of its own, and return it (join it before the first
    precompiled load). Inductor keys and loads compiled code by it, and the process's first load computes it: Triton
    hashes its sources and libtriton.so (505 MB in Triton 3.8), ~0.3 s of a job's start. The hashing releases the
    GIL, so it overlaps the compiler imports. Triton 3.6-3.9 (torch 2.11-2.15): ``triton.runtime.cache.triton_key``
    or ``triton.compiler.compiler.triton_key``, whichever this Triton has, an ``lru_cache``: the load then reads the
    cached value. None without Triton, or where the function is not cached (computing it here would spare the load
    nothing)."""
    try:
        import triton  # noqa: F401  (imported here, in the caller's thread: not beside its imports)
    except ImportError:
        return None
    key = None
    for module in ("triton.runtime.cache", "triton.compiler.compiler"):
        with contextlib.suppress(ImportError):
            key = getattr(__import__(module, fromlist=["triton_key"]), "triton_key", None)
        if key is not None:
            break
    if key is None or not hasattr(key, "cache_info"):
        return None
    thread = threading.Thread(target=_quietly, args=(key,), name="kernelpack-triton-key", daemon=True)
    thread.start()
    return thread


def _quietly(fn: Callable[[], Any]) -> None:
    # a failure here is torch's to raise, at the load that needs the key
    with contextlib.suppress(Exception):
        fn()
