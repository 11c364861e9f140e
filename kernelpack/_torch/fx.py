"""torch.fx's tracing state, as far as it reaches across threads.

Two pieces of state in torch/fx/_symbolic_trace.py matter to a compiled call made while another thread FX-traces
(``torch.fx.symbolic_trace``, ``make_fx``, AOTAutograd inside a Dynamo compile):

- the tracing flag that makes a compiled call raise "Detected that you are using FX to symbolically trace a
  dynamo-optimized function" (or, with ``error_on_nested_fx_trace=False``, run uncompiled: flex's dense path).
  torch 2.11-2.13: ``_is_fx_tracing_flag``, a module global, so set for every thread; torch >= 2.14: a thread-local
  read through ``_get_is_fx_tracing()`` (pytorch PR #168999), so another thread's trace no longer trips it.
- the patcher, ``CURRENT_PATCHER``, which replaces ``nn.Module.__call__``, ``nn.Module.__getattr__`` and the
  autowrapped ``math.*`` functions for the whole process while a trace runs. Process-global on every release up to
  2.15 (the fix, pytorch PR #187589, is unreleased): Dynamo guards on those functions by identity, so a warmed
  entry's guards fail while another thread traces, and a call made then would trace again.
"""

from __future__ import annotations

from . import unsupported


def foreign_trace() -> bool:
    """Whether another thread's FX trace can disturb a compiled call made in this thread right now.

    torch 2.11-2.13: the process-global tracing flag or the patcher is set. torch >= 2.14 (2.14, 2.15): the
    process-global patcher is set and this thread is not the one tracing (its own trace is its own business: torch
    decides, as it does for a call on FX proxies). Cheap: a module attribute read or two."""
    from torch.fx import _symbolic_trace as st

    patching = getattr(st, "CURRENT_PATCHER", None) is not None
    if hasattr(st, "_is_fx_tracing_flag"):  # torch <= 2.13
        return bool(st._is_fx_tracing_flag) or patching
    own = getattr(st, "_get_is_fx_tracing", None)
    if own is None or not hasattr(st, "CURRENT_PATCHER"):
        raise unsupported(
            "torch.fx has neither the process-global _is_fx_tracing_flag (torch <= 2.13) nor the thread-local "
            "_get_is_fx_tracing() with CURRENT_PATCHER (torch >= 2.14), so kernelpack cannot tell whether another "
            "thread is FX-tracing"
        )
    return patching and not own()


def tracing_state_is_thread_local() -> bool:
    """torch >= 2.14: the tracing flag is per thread (pytorch PR #168999); torch 2.11-2.13: process-global."""
    from torch.fx import _symbolic_trace as st

    return not hasattr(st, "_is_fx_tracing_flag")
