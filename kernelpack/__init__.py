"""kernelpack: build once, ship, install and prove precompiled torch.compile(flex_attention) caches.

The names a training script uses, resolved lazily: ``import kernelpack``, ``kernelpack --help`` and
``kernelpack inspect`` never import torch.

- ``kernelpack.activate(artifact)``: job start with the runtime guard (install, warm-up, refusals), and
  ``kernelpack.report()``: what the process compiled since (:mod:`kernelpack.runtime`);
- ``kernelpack.install(artifact)``, ``kernelpack.install_from(registry, recipe)``: job start without the guard;
- ``kernelpack.flex_attention``: torch's flex_attention, compiled once for the process and guarded;
- ``kernelpack.rank_cache_dir()``: a private cache dir per worker on a node;
- ``kernelpack.masks``: the canonical mask_mods and the BlockMask helper;
- ``kernelpack.recording(path)``: record the flex_attention calls made in a block into a recipe
  (:mod:`kernelpack.record`; ``kernelpack record -- CMD`` for a whole job).
"""

from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__

__all__ = [
    "__version__",
    "activate",
    "flex_attention",
    "install",
    "install_from",
    "masks",
    "rank_cache_dir",
    "recording",
    "report",
    "runtime",
]

_FROM = {
    "activate": "runtime",
    "flex_attention": "runtime",
    "install": "runtime",
    "install_from": "runtime",
    "rank_cache_dir": "runtime",
    "recording": "record",
    "report": "runtime",
}


def __getattr__(name: str) -> Any:
    if name in _FROM:
        return getattr(importlib.import_module(f".{_FROM[name]}", __name__), name)
    if name in ("masks", "runtime"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'kernelpack' has no attribute {name!r}")
