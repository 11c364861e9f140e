"""Tier 2, precompiled functions: torch's ``aot_compile`` of a config's canonical call, saved by the builder beside
the inductor cache (tier 1), loaded by the runtime and called without Dynamo.

A mechanism, like :mod:`kernelpack.compiled`: it knows calls, bytes and where the format puts them, not activation or
dispatch. How torch compiles, saves and loads such a function, and every torch version's workaround on that path,
is :mod:`kernelpack._torch.aot`.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from . import _fs, functions
from ._torch.aot import Loaded, compile_call, dumps, guards_pass, load_unavailable, loads, unavailable
from .manifest import PRECOMPILED_DIR

__all__ = [
    "Loaded",
    "PrecompiledMismatch",
    "compile_call",
    "dumps",
    "file_name",
    "guards_pass",
    "load",
    "load_unavailable",
    "loads",
    "reads_globals",
    "unavailable",
]


def file_name(config_id: str, device_index: int, graph: str, sha256: str) -> str:
    """Where the builder writes a graph's function, relative to the cache dir: named by its content (``sha256`` of
    its bytes), so that two builds of one config (another mask factory's code, another torch) never share a path in a
    cache dir, whose installs keep what is already there. The config id, device and graph are for people."""
    return f"{PRECOMPILED_DIR}/{config_id}-{device_index}-{graph.replace('+', '_')}-{sha256[:32]}.bin"


def load(path: str | os.PathLike[str], device: str, sha256: str) -> Loaded:
    """The function the builder saved at ``path``, for ``device`` ("cuda", "cpu"), if its bytes hash to the
    manifest's ``sha256``: loading unpickles it, so a file planted or swapped in the cache dir after the install is
    refused before any of it runs. Raises when it differs, when torch cannot load it, or when it is unsafe to share."""
    with _fs.open_regular(path) as f:
        blob = f.read()
    got = hashlib.sha256(blob).hexdigest()
    if got != sha256:
        raise PrecompiledMismatch(
            f"{path} has sha256 {got[:16]}..., not the manifest's {sha256[:16]}...: another file is at its path "
            "(changed in the cache dir after the install); not loaded"
        )
    return Loaded.from_bytes(blob, device)


class PrecompiledMismatch(RuntimeError):
    """A precompiled function's file does not hash to what the manifest says it holds."""


def reads_globals(fn: Any) -> str | None:
    """The first global value (not a module, function, class or builtin) that ``fn`` or a function in its closure reads,
    as "name=value", or None. torch drops every guard on a global from a saved function (aot_compile's guard filter:
    ``is_global``), so a mask that reads ``WINDOW`` would run with the builder's value after the job changed it; tier 1
    keeps Dynamo's guard on it. Such a function is left to tier 1."""
    return next((f"{n}={v!r}"[:200] for n, v in functions.global_reads(fn) if functions.plain_value(v)), None)
