"""Triton: which kernels it really compiles (not loads from its disk cache)."""

from __future__ import annotations

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
