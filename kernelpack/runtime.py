"""Job start and the runtime guard: the one module that changes the process kernelpack runs in.

Job start (every door goes through :func:`_start`):

- :func:`install` / :func:`install_from`: install an artifact (a path, or a registry's artifact for this environment,
  downloaded once per node) and point this process at it: ``TORCHINDUCTOR_CACHE_DIR`` and Dynamo's recompile floor
  (:func:`_configure_process`, the only place that does). ``kernelpack.install`` and ``kernelpack.install_from``.
- :func:`activate`: the same, plus the guard. Call it once at job start, in the main thread.

The guard (:func:`activate`, then every :func:`flex_attention` call) makes a first step safe in threads:

- The first call of each call signature runs alone at the gate of :mod:`kernelpack.compiled`; steady-state calls run
  in parallel.
- Strict mode refuses a call the artifact does not cover (:class:`NotPrecompiledError`, from
  :meth:`Manifest.covers`) instead of cold-compiling.
- The dense math path is refused (:class:`DenseFallbackError`), detected where torch runs it (:mod:`evidence`).
- :func:`report` says what each first call cost and whether it compiled anything.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import evidence, settings
from .artifact import Coverage, Manifest
from .compiled import (
    apply_thread_config,
    compiled_flex_attention,
    ensure_recompile_limit,
    gate,
    recompile_floor_for,
    wait_for_foreign_fx_trace,
)
from .errors import KernelpackError, KernelpackWarning, NotPrecompiledError
from .installer import InstallResult, install_artifact
from .signature import CallSignature, signature_of
from .store import pull

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ job start


def install(
    artifact: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    allow_mismatch: bool = False,
    device_index: int = 0,
) -> InstallResult:
    """Install ``artifact`` into ``cache_dir`` (default: the directory inductor uses in this process) and point this
    process at it: TORCHINDUCTOR_CACHE_DIR, and Dynamo's recompile limit raised to cover the artifact. A warning says
    so if torch already compiled with another directory. No runtime guard: :func:`activate` adds it.

    Refuses (:class:`KeyMismatchError`) an artifact built for another torch/triton/CUDA/GPU unless ``allow_mismatch``.
    """
    return _start(artifact, cache_dir, allow_mismatch=allow_mismatch, device_index=device_index)


def install_from(
    registry: str,
    recipe: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    lock: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    device_index: int = 0,
) -> InstallResult:
    """:func:`install` of the registry's artifact of ``recipe`` built for this environment (downloaded once per node;
    with ``lock``, only the pinned sha256)."""
    return _start(
        None,
        cache_dir,
        registry=registry,
        recipe=recipe,
        lock=lock,
        storage_options=storage_options,
        device_index=device_index,
    )


def _start(
    artifact: str | os.PathLike[str] | None,
    cache_dir: str | os.PathLike[str] | None,
    *,
    registry: str | None = None,
    recipe: str | None = None,
    lock: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    allow_mismatch: bool = False,
    device_index: int = 0,
) -> InstallResult:
    """Every job-start door: fetch (a registry's artifact), install, configure this process."""
    if registry is not None:
        if recipe is None:
            raise KernelpackError("a registry needs recipe=", hint="activate(registry=URL, recipe=NAME)")
        artifact = pull(registry, recipe, lock=lock, storage_options=storage_options, device_index=device_index).path
    assert artifact is not None
    result = install_artifact(artifact, cache_dir, allow_mismatch=allow_mismatch, device_index=device_index)
    _configure_process(result)
    return result


def _configure_process(result: InstallResult) -> None:
    """The one place kernelpack changes this process for an installed artifact: inductor reads the cache it was
    installed into, and Dynamo's recompile limit covers every (config, device) of it (at Dynamo's default of 8 it
    would fall back to eager, i.e. the dense path)."""
    target = Path(result.cache_dir)
    current = settings.inductor_cache_dir()
    if current is not None and current != target and _torch_compiled_already():
        warnings.warn(
            f"torch already compiled in this process with TORCHINDUCTOR_CACHE_DIR={current}; the artifact is "
            f"installed into {target} and TORCHINDUCTOR_CACHE_DIR now points there. Graphs compiled before this "
            "call were not affected: install before the first compiled call (kernelpack install at job start).",
            KernelpackWarning,
            stacklevel=4,
        )
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(target)
    ensure_recompile_limit(recompile_floor_for(len(result.manifest.pairs())))


def _torch_compiled_already() -> bool:
    if "torch._dynamo" not in sys.modules:
        return False
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"] > 0 or bool(counters["inductor"])


# ------------------------------------------------------------------------------------------------ activation


@dataclass(frozen=True, slots=True)
class FirstCall:
    signature: CallSignature
    config_id: str | None  # the artifact's config that covers it; None when not covered
    thread: str
    seconds: float
    counters: dict[str, int]

    @property
    def compiled(self) -> list[str]:
        return evidence.compiled_anything(self.counters)


@dataclass(frozen=True, slots=True)
class Activation:
    artifact: str | None
    strict: bool
    install: InstallResult | None = None  # None: activated without an artifact (non-strict)

    @property
    def manifest(self) -> Manifest | None:
        return self.install.manifest if self.install is not None else None

    @property
    def covered(self) -> tuple[CallSignature, ...]:
        """Every (config, device) signature the artifact serves."""
        return self.manifest.signatures if self.manifest is not None else ()

    @property
    def devices(self) -> tuple[int, ...]:
        return self.manifest.devices if self.manifest is not None else ()

    def covers(self, signature: CallSignature) -> Coverage:
        return self.manifest.covers(signature) if self.manifest is not None else Coverage(signature, None)

    def describe(self) -> str:
        return (
            f"kernelpack active: {len(self.covered)} (config, device) pairs from {self.artifact or 'no artifact'}, "
            f"devices {list(self.devices)}, {'strict' if self.strict else 'non-strict'}"
        )


@dataclass
class _State:
    active: Activation | None = None
    ready: set[CallSignature] = field(default_factory=set)
    first_calls: list[FirstCall] = field(default_factory=list)
    warned: set[CallSignature] = field(default_factory=set)


_state = _State()


def activate(
    source: str | os.PathLike[str] | None = None,
    *,
    strict: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    device_index: int = 0,
    allow_mismatch: bool = False,
    registry: str | None = None,
    recipe: str | None = None,
    lock: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Activation:
    """Call once at job start, in the main thread, before any worker thread or first forward.

    Installs the artifact (``source``: a .kpack path, default ``$KERNELPACK_ARTIFACT``; or ``registry`` + ``recipe``
    [+ ``lock``]: the registry's artifact for this environment, downloaded once per node) into the cache dir inductor
    will use and points this process at it (:func:`install`); then refuses the dense path from now on, and
    (``strict``) every call the artifact does not cover. Returns what is covered.
    """
    evidence.install_hooks(refuse_dense=True)
    if source is None and registry is None:
        source = settings.default_artifact()
    if source is None and registry is None:
        if strict:
            raise KernelpackError(
                "activate(strict=True) needs an artifact", hint="pass activate(path) or set KERNELPACK_ARTIFACT"
            )
        activation = Activation(artifact=None, strict=False)
    else:
        result = _start(
            source,
            cache_dir,
            registry=registry,
            recipe=recipe,
            lock=lock,
            storage_options=storage_options,
            allow_mismatch=allow_mismatch,
            device_index=device_index,
        )
        activation = Activation(artifact=result.artifact, strict=strict, install=result)
    _state.active = activation
    log.info(activation.describe())
    return activation


def deactivate() -> None:
    """Forget the activation and the first calls seen (for tests and notebooks). Hooks stay installed."""
    global _state
    _state = _State()
    evidence.set_refuse_dense(False)


# ------------------------------------------------------------------------------------------------ the guard


def guarded(mode: str = "default", dynamic: bool = False) -> Callable[..., Any]:
    """The guarded entry point compiled with these options: :data:`flex_attention` for the defaults, this for a
    recipe with a non-default ``[compile]`` section."""

    def flex_attention(
        query: Any,
        key: Any,
        value: Any,
        score_mod: Callable[..., Any] | None = None,
        block_mask: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_lse: bool = False,
        kernel_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Same signature as ``torch.nn.attention.flex_attention.flex_attention``, compiled by kernelpack and
        guarded (see kernelpack.runtime). Safe to call from many threads at once."""
        return _guarded_call(
            mode,
            dynamic,
            query,
            key,
            value,
            score_mod,
            block_mask,
            scale,
            enable_gqa,
            return_lse,
            kernel_options,
            kwargs,
        )

    return flex_attention


flex_attention = guarded()


def _guarded_call(
    mode: str,
    dynamic: bool,
    query: Any,
    key: Any,
    value: Any,
    score_mod: Any,
    block_mask: Any,
    scale: Any,
    enable_gqa: bool,
    return_lse: bool,
    kernel_options: Any,
    kwargs: dict[str, Any],
) -> Any:
    apply_thread_config()
    fn = compiled_flex_attention(mode, dynamic)

    def call() -> Any:
        return fn(
            query,
            key,
            value,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=enable_gqa,
            return_lse=return_lse,
            kernel_options=kernel_options,
            **kwargs,
        )

    import torch

    if isinstance(query, torch.fx.Proxy):  # this thread is FX-tracing us: torch decides (raise or inline)
        return call()
    sig = signature_of(query, key, block_mask, kernel_options, mode, dynamic)
    state = _state
    if sig in state.ready:
        with gate.shared():
            wait_for_foreign_fx_trace()
            return call()
    with gate.exclusive():
        if sig in state.ready:  # another thread made this first call while we waited
            return call()
        active = state.active
        config_id = None
        if active is not None:
            coverage = active.covers(sig)
            if coverage.entry is not None:
                config_id = coverage.entry.id
            elif active.strict:
                raise refusal(coverage, active.artifact)
            elif sig not in state.warned:
                state.warned.add(sig)
                warnings.warn(
                    f"kernelpack: {sig.describe()} is not in {active.artifact}; compiling it here (non-strict mode)",
                    stacklevel=3,
                )
        wait_for_foreign_fx_trace()
        before = evidence.snapshot()
        start = time.perf_counter()
        out = call()
        if sig.device_index is not None:
            torch.cuda.synchronize(query.device)
        state.first_calls.append(
            FirstCall(
                sig,
                config_id,
                threading.current_thread().name,
                time.perf_counter() - start,
                evidence.delta(before, evidence.snapshot()),
            )
        )
        state.ready.add(sig)
        return out


def refusal(coverage: Coverage, artifact: str | None) -> NotPrecompiledError:
    """Strict mode's error for an uncovered call: the call, the nearest covered signatures with what differs, and
    whether the device index is all that differs (then the fix is pinning or --devices, not the recipe)."""
    return NotPrecompiledError(
        coverage.signature.describe(),
        [n.describe() for n in coverage.nearest],
        artifact=artifact,
        device_only=coverage.device_only,
    )


# ---------------------------------------------------------------------------------------------------- report


@dataclass(frozen=True, slots=True)
class RuntimeReport:
    first_calls: list[FirstCall]

    @property
    def compiled(self) -> list[FirstCall]:
        return [c for c in self.first_calls if c.compiled]

    @property
    def first_call_seconds(self) -> float:
        return sum(c.seconds for c in self.first_calls)

    def summary(self) -> str:
        kernels = sum(
            c.counters.get("triton_compiled", 0) + c.counters.get("cpp_compiled", 0) for c in self.first_calls
        )
        misses = sum(c.counters.get("inductor.fxgraph_cache_miss", 0) for c in self.first_calls)
        return (
            f"{kernels} kernels compiled, {misses} FX-graph misses over {len(self.first_calls)} first calls "
            f"({self.first_call_seconds:.2f} s)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "first_calls": [
                {
                    "call": c.signature.describe(),
                    "config": c.config_id,
                    "thread": c.thread,
                    "seconds": c.seconds,
                    "compiled": c.compiled,
                    "counters": {k: v for k, v in c.counters.items() if v},
                }
                for c in self.first_calls
            ],
        }


def report() -> RuntimeReport:
    """What every first call cost and whether it compiled anything, from torch's counters (see :mod:`evidence`)."""
    return RuntimeReport(list(_state.first_calls))


# ---------------------------------------------------------------------------------------------------- GPUs


def pin_local_gpu(local_rank: int | None = None) -> str:
    """Make this process see only its own GPU, as ``cuda:0`` (what ``torchrun --virtual-local-rank`` does).

    Inductor's cache keys contain the device index (pytorch#170123): an artifact built on cuda:0 misses on cuda:5.
    Pinning each rank's GPU as cuda:0 lets one single-GPU artifact hit on every rank. Must run before CUDA
    initializes; ``local_rank`` defaults to $LOCAL_RANK. Returns the CUDA_VISIBLE_DEVICES entry now in force.
    """
    if local_rank is None:
        local_rank = settings.local_rank()
        if local_rank is None:
            raise KernelpackError("pin_local_gpu: LOCAL_RANK is not set", hint="pass local_rank= or run under torchrun")
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_initialized():
            raise KernelpackError(
                "pin_local_gpu: CUDA is already initialized in this process; CUDA_VISIBLE_DEVICES no longer applies",
                hint="call kernelpack.runtime.pin_local_gpu() at the very top of the worker, before any CUDA call",
            )
    devices = settings.cuda_visible_devices()
    if devices is not None and local_rank >= len(devices):
        raise KernelpackError(
            f"pin_local_gpu: LOCAL_RANK={local_rank} but CUDA_VISIBLE_DEVICES={','.join(devices)!r} lists "
            f"{len(devices)}",
            hint="start one process per visible GPU",
        )
    chosen = devices[local_rank] if devices is not None else str(local_rank)
    os.environ["CUDA_VISIBLE_DEVICES"] = chosen
    return chosen
