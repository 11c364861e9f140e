"""kernelpack: build once, ship, install and prove precompiled torch.compile(flex_attention) caches.

torch is imported lazily: ``import kernelpack``, ``kernelpack --help`` and ``kernelpack inspect`` never import it.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "flex_attention", "install", "masks"]


def __getattr__(name: str) -> Any:
    if name == "flex_attention":
        from .runtime import flex_attention

        return flex_attention
    if name == "install":
        from .install import install

        return install
    if name == "masks":
        from . import masks

        return masks
    raise AttributeError(f"module 'kernelpack' has no attribute {name!r}")
