"""The canonical compiled entry point that builder, verifier and workers all call.

A worker only hits what the builder compiled if it runs the very same traced graph: the same callable
(``torch.compile(flex_attention)`` with the same options), the same mask_mod (:mod:`kernelpack.masks`) and inputs of
the same shape, dtype, device and requires_grad. So kernelpack owns the compiled callable and everyone calls it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

# Dynamo's default (8) is far below a recipe's shape count with dynamic=False, and hitting it makes Dynamo run
# flex_attention eagerly, i.e. the dense math path. Raised once, never lowered.
DEFAULT_RECOMPILE_LIMIT = 64

_lock = threading.Lock()
_compiled: dict[tuple[str, bool], Callable[..., Any]] = {}


def ensure_recompile_limit(n: int = DEFAULT_RECOMPILE_LIMIT) -> None:
    """Raise Dynamo's per-code-object recompile limit to at least ``n`` (``cache_size_limit`` before torch 2.6)."""
    import torch._dynamo.config as dconfig

    name = "recompile_limit" if hasattr(dconfig, "recompile_limit") else "cache_size_limit"
    if getattr(dconfig, name) < n:
        setattr(dconfig, name, n)
    acc = "accumulated_recompile_limit" if hasattr(dconfig, "accumulated_recompile_limit") else None
    if acc and getattr(dconfig, acc) < 4 * n:
        setattr(dconfig, acc, 4 * n)


def compiled_flex_attention(mode: str = "default", dynamic: bool = False) -> Callable[..., Any]:
    """``torch.compile(flex_attention, dynamic=..., mode=...)``, one object per option set for the whole process.

    ``dynamic=False`` (the default) gives one static graph per shape, so the cache keys a process needs do not depend
    on the order in which it meets its shapes (torch's default automatic-dynamic recompiles the second shape it sees
    as a dynamic graph: a different key).
    """
    key = (mode, dynamic)
    fn = _compiled.get(key)
    if fn is None:
        with _lock:
            fn = _compiled.get(key)
            if fn is None:
                import torch
                from torch.nn.attention.flex_attention import flex_attention as eager_flex

                ensure_recompile_limit()
                fn = torch.compile(eager_flex, dynamic=dynamic, mode=None if mode == "default" else mode)
                _compiled[key] = fn
    return fn


def flex_attention(
    query: Any,
    key: Any,
    value: Any,
    score_mod: Callable[..., Any] | None = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """Same signature as ``torch.nn.attention.flex_attention.flex_attention``, compiled with kernelpack's defaults."""
    return compiled_flex_attention()(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=enable_gqa,
        return_lse=return_lse,
        kernel_options=kernel_options,
        **kwargs,
    )
