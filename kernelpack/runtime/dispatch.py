"""The guarded entry: :data:`flex_attention` and :func:`guarded`. A call is made into one :class:`.calls.FlexCall`
and served by the chain of :mod:`.serving` (after a warm-up: a precompiled function or a warmed Dynamo entry, or
refused; without one: first calls alone at the gate). Before that, a call FX-traced by its thread is torch's to
handle, and ``kernelpack record``'s observers see the call as the user made it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import evidence
from ..compiled import apply_thread_config, compiled_flex_attention
from . import session
from .attribution import notify, observers
from .calls import FlexCall
from .serving import serve


def guarded(mode: str = "default", dynamic: bool = False) -> Callable[..., Any]:
    """The guarded entry point compiled with these options: :data:`flex_attention` for the defaults, this for a
    recipe with a non-default ``[compile]`` section."""

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
        """Same signature as ``torch.nn.attention.flex_attention.flex_attention``, compiled by kernelpack and
        guarded (see kernelpack.runtime). Safe to call from many threads at once."""
        arguments = {
            "query": query,
            "key": key,
            "value": value,
            "score_mod": score_mod,
            "block_mask": block_mask,
            "scale": scale,
            "enable_gqa": enable_gqa,
            "return_lse": return_lse,
            "kernel_options": kernel_options,
            **kwargs,
        }
        return _guarded_call(mode, dynamic, arguments)

    return flex_attention


flex_attention = guarded()


def _guarded_call(mode: str, dynamic: bool, arguments: dict[str, Any]) -> Any:
    import torch

    active = session.current().active
    warm = active.warmup if active is not None else None
    if warm is not None and not warm.done.is_set():
        # a background start first: a thread started after activate() is not held at its imports, and this path
        # imports parts of torch (kernelpack._imports.importing_alone)
        warm.wait()
    evidence.ensure_watching()
    if isinstance(arguments["query"], torch.fx.Proxy):  # this thread is FX-tracing us: torch decides (raise or inline)
        apply_thread_config()
        return compiled_flex_attention(mode, dynamic)(**arguments)
    if observers:  # the call as the user made it (before it is normalized and a forward-only call detached)
        apply_thread_config()
        stand_in = notify("kernelpack.flex_attention", arguments, mode, dynamic)
        if stand_in is not None:
            return stand_in(arguments)
    call = FlexCall.made(arguments, mode, dynamic)
    state = session.current()
    with call.context():
        return serve(state, state.active, call)
