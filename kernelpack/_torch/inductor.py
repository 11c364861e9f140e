"""Inductor: its key of torch's own sources, its default cache dir, the process settings that enter its cache keys,
and its C++ builds.

Every function here serves torch 2.11-2.15.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from .._imports import after_import
from ..errors import TorchUnsupportedError
from . import unsupported

# How a user sets an inductor config value, for hints that ask for one
CONFIG_HINT = "torch._inductor.config.X = ..."


def torch_key(expected: str | None = None) -> str:
    """Inductor's hash of torch's sources and version, hex (in every FX-graph key: a locally patched torch with the
    same commit gets another). Computed here as inductor computes it (:func:`_source_key`), without importing
    inductor: that import is Dynamo's too, 1.5-5 s of a job's start, and a background start defers it to its
    thread. Once inductor's code cache is imported, its own value. ``inductor_torch_key`` is torch's,
    for the check that both agree (the warm-up, and a test on every torch version). ``expected`` (an artifact's):
    where kernelpack's reading differs from it, inductor's own value decides (importing inductor), so that a
    refusal is never kernelpack's misreading of a torch it does not know. torch 2.11-2.15."""
    if "torch._inductor.codecache" in sys.modules:
        return inductor_torch_key()
    try:
        ours = _source_key()
    except (OSError, TorchUnsupportedError):  # a torch tree kernelpack cannot read as inductor does: inductor's own
        return inductor_torch_key()
    return inductor_torch_key() if expected is not None and ours != expected else ours


def read_as(expected: str) -> bool:
    """Whether :func:`torch_key` found kernelpack's own reading of torch's sources equal to ``expected`` in this
    process (then inductor's own value needs no second computation: both read the same bytes the same way, which
    tests/test_torch_internals.py checks on every torch version kernelpack supports). torch 2.11-2.15."""
    return _source_key.cache_info().currsize > 0 and _source_key() == expected


def import_compiler() -> None:
    """Import what every compile and every precompiled load imports first: Dynamo and inductor's code cache (the
    rest, lowering and kernel templates, a precompiled function's first load imports). torch 2.11-2.15."""
    import torch._dynamo
    import torch._inductor.codecache  # noqa: F401


# What a precompiled function's first load imports after import_compiler(), by device type: the header of the wrapper
# module inductor generates (codegen/wrapper.py: select_algorithm's extern_kernels, which imports the lowering, the
# kernel templates and jinja2; async_compile; memory_planning; hooks), AOTAutograd's entry (networkx, through its
# partitioners), what the compiled graph's post-compile step reads (inductor's graph, AOTAutograd's subclass code)
# and, on CUDA, the header of every Triton kernel it loads (codegen/triton.py,
# gen_common_triton_imports). torch 2.11-2.15, Triton 3.x.
_LOAD_IMPORTS = (
    "torch._functorch.aot_autograd",
    "torch._inductor.hooks",
    "torch._inductor.codegen.memory_planning",
    "torch._inductor.async_compile",
    "torch._inductor.select_algorithm",
    "torch._inductor.graph",
    "torch._functorch._aot_autograd.subclass_codegen",
)
_LOAD_IMPORTS_CUDA = (
    "triton",
    "triton.language",
    "torch._inductor.runtime.hints",
    "torch._inductor.runtime.triton_helpers",
    "torch._inductor.runtime.triton_heuristics",
)


def import_loader(devices: Iterable[str]) -> None:
    """Import what a precompiled function's first load imports after :func:`import_compiler`, for functions of these
    device types ("cpu", "cuda"). A background start does this while the install writes the warm-up's files and
    Triton's key is hashed (both without the GIL), instead of after them inside the first load: 0.67 s of a 1.93 s
    first load on CPU (torch 2.13; the rest is the load's own work and its C++ toolchain probe). A module that this
    torch or Triton lacks, or that fails to import, is skipped: the load imports what it needs, and raises there.
    torch 2.11-2.15."""
    modules = _LOAD_IMPORTS + (_LOAD_IMPORTS_CUDA if "cuda" in devices else ())
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # ahead of time only: the load imports it again and says what failed
            continue


# The one vector-ISA check a process runs ahead (prefetch_vec_isa): two at once build probes under flags the other
# has half-changed (VecAVX512.__bool__ appends -mavx512bf16 to the instance's _arch_flags for its bf16 probe and puts
# them back after: torch 2.11-2.15), and compile whatever else reads them then (a kernel) under a path the artifact
# never shipped
_vec_isa_lock = threading.Lock()
_vec_isa_thread: threading.Thread | None = None


def prefetch_vec_isa(after: threading.Event, wanted: Callable[[], bool]) -> threading.Thread | None:
    """Start inductor's check of this CPU's vector instruction sets in a thread of its own once ``after`` is set (and
    only if ``wanted()`` then says so: the install did not fail), and return it: join it before anything else of
    torch's compiler runs, and before the start returns on any path (set ``after`` first where it failed).
    ``cpu_vec_isa.pick_vec_isa`` compiles a probe per instruction set the CPU claims into the inductor cache and
    ``dlopen``s each in a child Python, once per process (``valid_vec_isa_list`` is cached): on this project's 2-core
    machine 0.9 s with the probes' builds in the cache (an artifact ships its builder's: ``after`` is their install),
    83 % of a CPU function's first load under cProfile (torch 2.13, docs/BENCHMARKS.md). The thread waits on those
    children without the GIL, beside :func:`import_loader`. What it imports (the C++ builder,
    ``torch.utils.cpp_extension``) is imported here, in the caller's thread, so that the thread imports nothing beside
    the caller's imports (two threads importing torch's compiler stack at once can see a half-initialized module).
    Call it after :func:`import_compiler`. The check is not thread-safe (``_vec_isa_lock``'s comment): where this
    process's thread is still checking (a start before this one), that thread is returned, not a second; where the
    check is done, None. A failure is the load's to raise: the check is not cached then, and the load runs it again.
    torch 2.11-2.15; None where this torch has no ``pick_vec_isa``."""
    global _vec_isa_thread
    try:
        from torch._inductor import cpu_vec_isa

        importlib.import_module("torch._inductor.cpp_builder")
        importlib.import_module("torch.utils.cpp_extension")
        importlib.import_module("torch.utils._filelock")
        pick = cpu_vec_isa.pick_vec_isa
        checked = cpu_vec_isa.valid_vec_isa_list.cache_info
    except (ImportError, AttributeError):
        return None

    def check() -> None:
        after.wait()
        if wanted():
            with contextlib.suppress(Exception):
                pick()

    with _vec_isa_lock:
        if _vec_isa_thread is not None and _vec_isa_thread.is_alive():
            return _vec_isa_thread
        if checked().currsize:
            return None
        _vec_isa_thread = threading.Thread(target=check, name="kernelpack-vec-isa", daemon=True)
        _vec_isa_thread.start()
        return _vec_isa_thread


def inductor_torch_key() -> str:
    """torch 2.11-2.15: ``torch._inductor.codecache.torch_key`` (computed once per process)."""
    from torch._inductor.codecache import torch_key as key

    return key().hex()  # type: ignore[no-any-return]


# The files besides torch's modules that torch_key hashes (codecache.torch_key's extra_files), by the torch minor that
# added them: 2.14 added codegen/aoti_runtime/streams.h (in 2.11-2.13 that file is not hashed, even where it exists)
_EXTRA_FILES = (
    ((2, 11), "codegen/aoti_runtime/interface.cpp"),
    ((2, 14), "codegen/aoti_runtime/streams.h"),
    ((2, 11), "script.ld"),
)


@functools.cache
def _source_key() -> str:
    """torch 2.11-2.15's ``torch_key`` (OSS build): sha256 over torch's version, then every module of the torch
    package in ``pkgutil`` order (its name and its source bytes, packages recursively; ``build_code_hash``), then
    the extra files. 0.14-0.7 s (docs/BENCHMARKS.md)."""
    import hashlib
    import os

    import torch

    root = os.path.dirname(torch.__file__)
    hasher = hashlib.sha256()
    hasher.update(torch.__version__.encode("utf-8"))
    _hash_modules([root], "", hasher)
    minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    for since, rel in _EXTRA_FILES:
        path = os.path.join(root, "_inductor", rel)
        if minor >= since and os.path.exists(path):
            with open(path, "rb") as f:
                hasher.update(f.read())
    return hasher.hexdigest()


def _hash_modules(roots: list[str], prefix: str, hasher: Any) -> None:
    """torch 2.11-2.15: ``torch._inductor.codecache.build_code_hash``."""
    import pkgutil

    for lib in sorted(pkgutil.iter_modules(roots, prefix), key=lambda x: x.name):
        spec = lib.module_finder.find_spec(lib.name, None)  # type: ignore[call-arg]
        if spec is None or spec.origin is None:
            raise unsupported(f"torch._inductor.codecache.torch_key over a module without a source file ({lib.name})")
        with open(spec.origin, "rb") as f:
            hasher.update(spec.name.encode("utf-8"))
            hasher.update(f.read())
        if lib.ispkg:
            _hash_modules(list(spec.submodule_search_locations or ()), f"{spec.name}.", hasher)


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


def key_settings_cheap() -> bool:
    """Whether :func:`key_settings` is cheap now: the job imported both config modules already (importing either
    imports Dynamo, a second of a job's start). torch 2.11-2.15: ``torch._inductor.config`` and
    ``torch._functorch.config``."""
    import sys

    return "torch._inductor.config" in sys.modules and "torch._functorch.config" in sys.modules


def _stable_repr(value: Any) -> str:
    # a function or object repr carries its address, different in every process: its type stands in
    text = repr(value)
    return f"<{type(value).__qualname__}>" if " at 0x" in text or " object at " in text else text


def watch_cpp_builds_when_imported(on_build: Callable[[bool], None]) -> None:
    """:func:`watch_cpp_builds` once inductor's C++ builder is imported: now if it is, else right after its import
    (:mod:`kernelpack._imports`), before any C++ build can run. torch 2.11-2.15."""
    after_import("torch._inductor.cpp_builder", lambda _: watch_cpp_builds(on_build))


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


# ------------------------------------------------------------------------------------------------ workarounds

_SPLIT_NAMES = ("kp_flex_q_split_size_", "kp_flex_kv_split_size_")


def fix_cpu_flex_split_names() -> None:
    """Make inductor's CPU flex-attention template compile a mask that closes over ints a dynamic graph keeps
    symbolic (DFlash's context length), and compute it right.

    The template names its two split-size placeholders like any kernel size (``ks{n}``, n the number of size
    arguments so far) and renames them with a plain ``str.replace`` over the generated C++, while a closure int's
    symbol ``s57`` is named ``ks57``: the replace of ``ks5`` also rewrites it to ``cur_kvSplitSize7``. gcc then fails
    (``'cur_kvSplitSize7' was not declared in this scope``), or, when a symbol's name equals ``ks{n}`` exactly, the
    mask silently reads the split size instead of the user's value (max error 0.3-0.76 against eager flex on 2.11,
    2.13, 2.14.1, 2.15.0; ``bench/cpu_flex_split_names.py``). Which masks hit it is arbitrary: symbol ids are a hash of
    the closure cell's source. Not reported upstream as of 2026-12-01 (the closest, pytorch#136914, is CUDA).

    The fix gives the placeholders names that no ``ks<digits>`` name contains, before the template renames them.
    Idempotent; costs inductor's import once. torch 2.11-2.15: ``CppFlexAttentionTemplate.modification``, its
    ``block_vars``, ``codegen.cpp.KernelGroup`` (which modification() imports at call time)."""
    try:
        import torch._inductor.lowering  # noqa: F401  (imported first: the template module's imports are circular)
        from torch._inductor.codegen import cpp
        from torch._inductor.codegen import cpp_flex_attention_template as template
    except ImportError as e:
        raise unsupported("inductor's CPU flex-attention template moved (codegen.cpp_flex_attention_template)") from e
    cls = template.CppFlexAttentionTemplate
    original = cls.modification
    if getattr(original, "kernelpack_split_names", False):
        return

    @functools.wraps(original)
    def modification(self: Any, *args: Any, **kwargs: Any) -> Any:
        split = tuple(getattr(self, "block_vars", None) or ())
        group = cpp.KernelGroup
        if len(split) != 2:
            return original(self, *args, **kwargs)

        class NamedSplits(group):  # type: ignore[misc, valid-type]
            def __init__(kernel_group: Any, *a: Any, **k: Any) -> None:
                super().__init__(*a, **k)
                for symbol, name in zip(split, _SPLIT_NAMES, strict=True):
                    kernel_group.args.sizevars[symbol] = name

        cpp.KernelGroup = NamedSplits  # type: ignore[misc]
        try:
            return original(self, *args, **kwargs)
        finally:
            cpp.KernelGroup = group  # type: ignore[misc]

    modification.kernelpack_split_names = True  # type: ignore[attr-defined]
    cls.modification = modification  # type: ignore[method-assign]


# What torch's C++ build command cannot carry in a path: inductor joins the kernel's source and output paths (in the
# cache dir) into one command line unquoted and splits it with shlex (torch/_inductor/cpp_builder.py, 2.11-2.15)
CPP_UNSAFE_PATH_CHARS = frozenset(" \t\n\r\f\v'\"\\")


def compile_workers() -> int:
    """How many subprocesses inductor's compile pool has started in this process (0: none; kernels compile here,
    where the Triton listener sees them). Read without starting the pool: ``AsyncCompile.process_pool`` is an
    ``lru_cache(1)`` staticmethod, filled once the pool exists, and ``get_compile_threads()`` sizes it
    (torch/_inductor/async_compile.py, torch 2.11-2.15)."""
    if "torch._inductor.async_compile" not in sys.modules:
        return 0
    from torch._inductor import async_compile

    try:
        started = async_compile.AsyncCompile.process_pool.cache_info().currsize > 0
        return async_compile.get_compile_threads() if started else 0
    except AttributeError as e:
        raise unsupported(f"torch._inductor.async_compile has no process_pool cache ({e})") from e
