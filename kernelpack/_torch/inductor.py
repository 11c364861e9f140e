"""Inductor: its key of torch's own sources, its default cache dir, the process settings that enter its cache keys,
and its C++ builds.

Every function here serves torch 2.11-2.15.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from . import unsupported

# How a user sets an inductor config value, for hints that ask for one
CONFIG_HINT = "torch._inductor.config.X = ..."


def torch_key() -> str:
    """Inductor's hash of torch's sources and version, hex (in every FX-graph key: a locally patched torch with the
    same commit gets another). torch 2.11-2.15: ``torch._inductor.codecache.torch_key``."""
    from torch._inductor.codecache import torch_key as key

    return key().hex()  # type: ignore[no-any-return]


def default_cache_dir() -> str:
    """The cache dir inductor uses without TORCHINDUCTOR_CACHE_DIR (``<tmp>/torchinductor_<user>``).
    torch 2.11-2.15: ``torch._inductor.runtime.cache_dir_utils.default_cache_dir``."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as default

    return str(default())


def key_settings(device_type: str) -> dict[str, str]:
    """The process-wide settings that enter inductor's FX-graph and AOTAutograd cache keys besides the graph and its
    inputs (``FxGraphHashDetails`` in torch/_inductor/codecache.py), as ``name -> repr``: every portable inductor and
    functorch config value, deterministic algorithms, the default dtype, the CUDA matmul precision flags, and on CPU
    the thread count C++ kernels specialize on. torch 2.11-2.15 (``save_config_portable(ignore_private_configs=)``)."""
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    out: dict[str, str] = {}
    for prefix, module in (("inductor", inductor_config), ("functorch", functorch_config)):
        for name, value in module.save_config_portable(ignore_private_configs=False).items():  # type: ignore[attr-defined]
            out[f"{prefix}.{name}"] = _stable_repr(value)
    # one value per key: a kernelpack that records one more setting must not change the ones recorded before
    deterministic = getattr(torch.utils, "deterministic", None)
    out["deterministic_algorithms"] = repr(torch.are_deterministic_algorithms_enabled())
    out["deterministic_algorithms_warn_only"] = repr(torch.is_deterministic_algorithms_warn_only_enabled())
    out["fill_uninitialized_memory"] = repr(getattr(deterministic, "fill_uninitialized_memory", None))
    out["default_dtype"] = str(torch.get_default_dtype())
    matmul = torch.backends.cuda.matmul
    for name in (
        "fp32_precision",
        "allow_tf32",
        "allow_fp16_reduced_precision_reduction",
        "allow_bf16_reduced_precision_reduction",
    ):
        if hasattr(matmul, name):
            out[f"cuda_matmul.{name}"] = repr(getattr(matmul, name))
    if (
        device_type == "cpu"
        and inductor_config.cpp.threads < 1
        and not getattr(inductor_config.cpp, "dynamic_threads", False)
    ):
        out["cpu_threads"] = str(torch.get_num_threads())
    return out


def _stable_repr(value: Any) -> str:
    # a function or object repr carries its address, different in every process: its type stands in
    text = repr(value)
    return f"<{type(value).__qualname__}>" if " at 0x" in text or " object at " in text else text


def watch_cpp_builds(on_build: Callable[[bool], None]) -> None:
    """Call ``on_build(compiled)`` before each C++ build inductor runs: ``compiled`` False for the preprocessor runs
    it makes on warm starts too (to hash headers), True for a real kernel compile (it runs only when the .so is
    missing). torch 2.11-2.15: ``cpp_builder.CppBuilder.build`` and its ``_preprocessing`` flag."""
    from torch._inductor import cpp_builder

    builder = getattr(cpp_builder, "CppBuilder", None)
    if builder is None:
        raise unsupported("inductor has no cpp_builder.CppBuilder to watch C++ kernel builds with")
    original = builder.build

    @functools.wraps(original)
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        on_build(not getattr(self, "_preprocessing", False))
        return original(self, *args, **kwargs)

    builder.build = build
