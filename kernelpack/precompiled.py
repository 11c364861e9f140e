"""Tier 2, precompiled functions: torch's ``aot_compile`` of a config's canonical call, saved by the builder beside
the inductor cache (tier 1), loaded by the runtime and called without Dynamo.

A mechanism, like :mod:`kernelpack.compiled`: it knows calls, bytes and where the format puts them, not activation or
dispatch. How torch compiles, saves and loads such a function, and every torch version's workaround on that path,
is :mod:`kernelpack._torch.aot`.
"""

from __future__ import annotations

import os
from typing import Any

from . import functions
from ._torch.aot import Loaded, compile_call, dumps, guards_pass, loads, unavailable
from .artifact import PRECOMPILED_DIR

__all__ = [
    "Loaded",
    "compile_call",
    "dumps",
    "file_name",
    "guards_pass",
    "load",
    "loads",
    "reads_globals",
    "unavailable",
]


def file_name(config_id: str, device_index: int, graph: str) -> str:
    """Where the builder writes a graph's function, relative to the cache dir."""
    return f"{PRECOMPILED_DIR}/{config_id}-{device_index}-{graph.replace('+', '_')}.bin"


def load(path: str | os.PathLike[str], device: str) -> Loaded:
    """The function the builder saved at ``path``, for ``device`` ("cuda", "cpu"); raises when torch cannot load it
    or it is unsafe to share."""
    with open(path, "rb") as f:
        return Loaded(loads(f.read()), device)


def reads_globals(fn: Any) -> str | None:
    """The first global value (not a module, function, class or builtin) that ``fn`` or a function in its closure reads,
    as "name=value", or None. torch drops every guard on a global from a saved function (aot_compile's guard filter:
    ``is_global``), so a mask that reads ``WINDOW`` would run with the builder's value after the job changed it; tier 1
    keeps Dynamo's guard on it. Such a function is left to tier 1."""
    return next((f"{n}={v!r}"[:200] for n, v in functions.global_reads(fn) if functions.plain_value(v)), None)
