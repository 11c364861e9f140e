"""kernelpack: build once, ship, install and prove precompiled torch.compile(flex_attention) caches.

torch is imported lazily: ``import kernelpack``, ``kernelpack --help`` and ``kernelpack inspect`` never import it.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Bound eagerly: importing the submodule kernelpack.install (which kernelpack itself does) would otherwise shadow a
# lazily provided function with the module object. install.py imports no torch at module level.
from .install import install
from .store import install_from

__all__ = ["__version__", "flex_attention", "install", "install_from", "masks"]


def __getattr__(name: str) -> Any:
    if name == "flex_attention":
        from .runtime import flex_attention

        return flex_attention
    if name == "masks":
        import importlib

        return importlib.import_module(".masks", __name__)  # "from . import masks" would recurse into here
    raise AttributeError(f"module 'kernelpack' has no attribute {name!r}")
