"""flex_attention's internals: its eager function, the higher-order op whose eager kernel is the dense math path,
and the block-mask helpers ``create_block_mask`` is made of.

Every function here serves torch 2.11-2.15.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from . import unsupported


def eager_flex() -> Callable[..., Any]:
    """``torch.nn.attention.flex_attention.flex_attention`` (public), the function every compiled entry compiles.
    torch 2.11-2.15."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention  # type: ignore[no-any-return]


def watch_dense_calls(on_dense: Callable[[Any, Any], None]) -> None:
    """Call ``on_dense(query, key)`` whenever flex_attention's dense math path is about to run on real tensors
    (not the fake or functional tensors a trace runs it with to learn output shapes); ``on_dense`` may raise to
    refuse the call. torch 2.11-2.15: the flex higher-order op's CompositeExplicitAutograd kernel (``sdpa_dense``),
    looked up through ``py_kernels`` and the op's per-key ``_dispatch_cache``."""
    import torch
    from torch._C import DispatchKey
    from torch._higher_order_ops.flex_attention import flex_attention as hop
    from torch._subclasses.fake_tensor import FakeTensor

    key = DispatchKey.CompositeExplicitAutograd
    kernels = getattr(hop, "py_kernels", None)
    if not isinstance(kernels, dict) or key not in kernels:
        raise unsupported("flex_attention's higher-order op has no CompositeExplicitAutograd kernel to watch")
    original = kernels[key]
    functional = getattr(torch, "_is_functional_tensor", None)

    @functools.wraps(original)
    def dense(query: Any, key_: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(query, FakeTensor) and not (functional is not None and functional(query)):
            on_dense(query, key_)
        return original(query, key_, *args, **kwargs)

    kernels[key] = dense
    # HOPs cache resolved kernels per dispatch key; drop the cache so the wrapper is used.
    cache = getattr(hop, "_dispatch_cache", None)
    if isinstance(cache, dict):
        cache.clear()


class NoInternals(Exception):
    """This torch lacks the create_block_mask internals :func:`block_tables` and :func:`block_mask_of` use."""


def block_tables(dense: Any, q_block: int, kv_block: int) -> tuple[Any, Any]:
    """A dense boolean mask ``[B, H, Q, KV]`` reduced to its (partial, full) block tables, as create_block_mask
    reduces its own. torch 2.11-2.15: ``_convert_mask_to_block_mask(..., separate_full_blocks=True)``; raises
    :class:`NoInternals` where it is gone or takes other arguments."""
    try:
        from torch.nn.attention.flex_attention import _convert_mask_to_block_mask
    except ImportError as e:
        raise NoInternals from e
    try:
        partial, full = _convert_mask_to_block_mask(
            dense, Q_BLOCK_SIZE=q_block, KV_BLOCK_SIZE=kv_block, separate_full_blocks=True
        )
    except TypeError as e:  # another signature of the internals
        raise NoInternals from e
    return partial, full


def block_mask_of(tables: tuple[Any, Any], mask_mod: Any, lengths: tuple[int, int], q_block: int, kv_block: int) -> Any:
    """The BlockMask of (partial, full) block tables, as create_block_mask builds it. torch 2.11-2.15:
    ``_create_sparse_block_from_block_mask``; raises :class:`NoInternals` where it is gone."""
    try:
        from torch.nn.attention.flex_attention import _create_sparse_block_from_block_mask
    except ImportError as e:
        raise NoInternals from e
    return _create_sparse_block_from_block_mask(tables, mask_mod, lengths, q_block, kv_block)
