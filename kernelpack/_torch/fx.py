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
  entry's guards fail while another thread's ``symbolic_trace`` has patched ``math.*``, and a call made then would
  trace again. ``make_fx`` patches only ``nn.Module``'s attributes and torch.fx's own helpers.
"""

from __future__ import annotations

from . import unsupported


def foreign_trace() -> bool:
    """Whether another thread's FX trace can disturb a compiled call made in this thread right now.

    torch 2.11-2.13: the process-global tracing flag or the patcher is set (measured on 2.13, docs/BENCHMARKS.md
    "torch.fx's tracing state across threads": a thread looping make_fx made 227,380 of 227,393 compiled flex calls in
    two other threads raise). torch >= 2.14 (2.14, 2.15): another thread's patcher has patched a function outside
    ``nn.Module`` and torch itself: ``symbolic_trace`` patches ``math.*`` (flex_attention reads ``math.sqrt``,
    and Dynamo's guards on it fail: 4 errors and 10 recompiles in 20 calls on 2.14.1), while ``make_fx`` patches
    only ``nn.Module.__call__``/``__getattr__`` and torch.fx's own helpers (0 errors in 2,366 calls on 2.14.1). This
    thread's own trace is its own business (torch decides, as for a call on FX proxies). Cheap: a few attribute
    reads, and a scan of the patch list only while a trace runs."""
    from torch.fx import _symbolic_trace as st

    patcher = getattr(st, "CURRENT_PATCHER", None)
    if hasattr(st, "_is_fx_tracing_flag"):  # torch <= 2.13
        return bool(st._is_fx_tracing_flag) or patcher is not None
    own = getattr(st, "_get_is_fx_tracing", None)
    if own is None or not hasattr(st, "CURRENT_PATCHER"):
        raise unsupported(
            "torch.fx has neither the process-global _is_fx_tracing_flag (torch <= 2.13) nor the thread-local "
            "_get_is_fx_tracing() with CURRENT_PATCHER (torch >= 2.14), so kernelpack cannot tell whether another "
            "thread is FX-tracing"
        )
    if patcher is None or own():
        return False
    return any(_reaches_compiled_code(p) for p in list(getattr(patcher, "patches_made", ())))


def _reaches_compiled_code(patch: object) -> bool:
    """Whether a patch of torch.fx's patcher replaces a function other threads' compiled code may read (and Dynamo
    guard on): anything but ``nn.Module``'s attributes and torch's own wrapped helpers (torch.fx's ``_assert_is_none``,
    Dynamo's ``dict_keys_getitem``, which every make_fx patches). ``math.*`` and a user's autowrapped functions
    count, and so do unknown patch kinds."""
    import torch

    target = getattr(patch, "frame_dict", None)
    if target is torch.nn.Module:
        return False
    name = target.get("__name__", "") if isinstance(target, dict) else ""
    return not (name == "torch" or str(name).startswith("torch."))


def tracing_state_is_thread_local() -> bool:
    """torch >= 2.14: the tracing flag is per thread (pytorch PR #168999); torch 2.11-2.13: process-global."""
    from torch.fx import _symbolic_trace as st

    return not hasattr(st, "_is_fx_tracing_flag")
