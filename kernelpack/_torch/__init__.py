"""Every private torch and Triton name kernelpack touches, and nothing else: one module per area.

- :mod:`.fx`: torch.fx's tracing state: can another thread's FX trace disturb a compiled call now;
- :mod:`.autograd`: the autograd engine: is this thread running a backward pass;
- :mod:`.dynamo`: Dynamo's cache entries and guard managers, its config (recompile limit, trace settings), its
  counters, and the per-compile metrics and callbacks;
- :mod:`.inductor`: inductor's key of torch's sources, its cache dir, the settings in its cache keys, its C++ builds;
- :mod:`.aot`: ``aot_compile``: compiling, saving and loading a precompiled function, and its guards;
- :mod:`.flex`: flex_attention's eager function, its higher-order op (the dense path), its block-mask helpers;
- :mod:`.triton`: Triton's compile listener.

Everything above this package speaks kernelpack's words; tests/test_torch_internals.py checks that no private torch
name appears outside it, and docs/torch-compat.md lists every function here with the torch versions CI runs it on.

Each function says which torch versions it serves and chooses between torch generations by probing for the feature,
never by parsing a version string (a nightly or a local build of a release has the release's version and another
release's internals). Where a probe finds neither generation's feature, the function raises
:class:`~kernelpack.errors.TorchUnsupportedError` naming the torch version and what is missing, never an
AttributeError from deep inside a call. Nothing here imports torch at import time.
"""

from __future__ import annotations

from ..errors import TorchUnsupportedError

# The releases CI runs kernelpack on (.ci/run, docs/torch-compat.md): the floor is pyproject's.
SUPPORTED = "2.11 through 2.15"


def unsupported(what: str) -> TorchUnsupportedError:
    """The error for a torch that lacks ``what``, naming this torch's version."""
    import torch

    return TorchUnsupportedError(torch.__version__, what, SUPPORTED)
