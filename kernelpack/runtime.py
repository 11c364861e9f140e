"""The canonical compiled entry point, and the runtime guard around it.

A worker only hits what the builder compiled if it runs the very same traced graph: the same callable
(``torch.compile(flex_attention)`` with the same options), the same mask_mod (:mod:`kernelpack.masks`) and inputs of
the same shape, dtype, device and requires_grad. So kernelpack owns the compiled callable and everyone calls it.

The guard (:func:`activate`, then every :func:`flex_attention` call) makes a first step safe in threads:

- The first call of each (config, device) runs alone, under a process-wide gate; steady-state calls run in parallel.
  Alone matters: while one thread compiles, AOTAutograd's make_fx sets torch.fx's *process-global* tracing flag, and
  a compiled call entered by another thread at that moment raises "Detected that you are using FX to symbolically
  trace a dynamo-optimized function" or, with ``error_on_nested_fx_trace=False``, silently runs uncompiled (dense).
- Strict mode refuses a call the artifact does not cover (:class:`NotPrecompiledError`) instead of cold-compiling.
- The dense math path is refused (:class:`DenseFallbackError`), detected where torch runs it (:mod:`evidence`).
- :func:`report` says what each first call cost and whether it compiled anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import KernelpackError, NotPrecompiledError

if TYPE_CHECKING:
    from .install import InstallResult
    from .recipe import Config

log = logging.getLogger(__name__)

# Dynamo's default (8) is far below a recipe's shape count with dynamic=False, and hitting it makes Dynamo run
# flex_attention eagerly, i.e. the dense math path. Raised, never lowered.
DEFAULT_RECOMPILE_LIMIT = 64
_recompile_floor = DEFAULT_RECOMPILE_LIMIT

_create_lock = threading.Lock()
_compiled: dict[tuple[str, bool], Callable[..., Any]] = {}


def ensure_recompile_limit(n: int = DEFAULT_RECOMPILE_LIMIT) -> None:
    """Raise Dynamo's per-code-object recompile limit to at least ``n`` in every thread that calls kernelpack.

    Since torch 2.12 a Dynamo config assignment is a per-thread ContextVar override: set in the main thread, it is
    not seen by worker threads. So the floor is kept here and applied by each :func:`flex_attention` call in the
    calling thread (:func:`_apply_thread_config`), which provably reaches every thread that compiles through us.
    """
    global _recompile_floor
    _recompile_floor = max(_recompile_floor, n)
    _apply_thread_config()


def _apply_thread_config() -> None:
    import torch._dynamo.config as dconfig

    # ``cache_size_limit`` before torch 2.7; ``recompile_limit`` (with the old name as an alias) since.
    name = "recompile_limit" if hasattr(dconfig, "recompile_limit") else "cache_size_limit"
    if getattr(dconfig, name) < _recompile_floor:
        setattr(dconfig, name, _recompile_floor)
        acc = "accumulated_recompile_limit" if hasattr(dconfig, "accumulated_recompile_limit") else None
        if acc and getattr(dconfig, acc) < 4 * _recompile_floor:
            setattr(dconfig, acc, 4 * _recompile_floor)


def compiled_flex_attention(mode: str = "default", dynamic: bool = False) -> Callable[..., Any]:
    """``torch.compile(flex_attention, dynamic=..., mode=...)``, one object per option set for the whole process.

    ``dynamic=False`` (the default) gives one static graph per shape, so the cache keys a process needs do not depend
    on the order in which it meets its shapes (torch's default automatic-dynamic recompiles the second shape it sees
    as a dynamic graph: a different key). Calling the returned object directly bypasses the guard; use
    :func:`flex_attention` (default options) or :func:`guarded` for other options.
    """
    key = (mode, dynamic)
    fn = _compiled.get(key)
    if fn is None:
        with _create_lock:
            fn = _compiled.get(key)
            if fn is None:
                import torch
                from torch.nn.attention.flex_attention import flex_attention as eager_flex

                fn = torch.compile(eager_flex, dynamic=dynamic, mode=None if mode == "default" else mode)
                _compiled[key] = fn
    return fn


# ------------------------------------------------------------------------------------------------ call signatures


@dataclass(frozen=True, slots=True)
class CallSignature:
    """Everything about a call that selects a compiled graph: the unit of coverage and of first-call serialization.

    It is a :class:`Config` whose mask is named by what the mask_mod computes (:func:`mask_key`, the window folded
    in), plus the device index.
    """

    config: Config
    device_index: int | None

    @classmethod
    def of_config(cls, config: Config, device_index: int | None, mask_mod: Callable[..., Any]) -> CallSignature:
        normalized = dataclasses.replace(config, mask=mask_key(mask_mod), window=None)
        return cls(normalized, device_index if config.device == "cuda" else None)

    def describe(self) -> str:
        c = self.config
        device = c.device if self.device_index is None else f"{c.device}:{self.device_index}"
        lens = f"seq={c.q_len}" if c.q_len == c.kv_len else f"q_len={c.q_len} kv_len={c.kv_len}"
        return (
            f"[{device} {c.mask} B={c.batch} Hq={c.q_heads} Hkv={c.kv_heads} {lens} D={c.head_dim} {c.dtype} "
            f"{'fwd+bwd' if c.backward else 'fwd'}]"
        )

    def differences(self, other: CallSignature) -> list[str]:
        a, b = self.config.to_dict(), other.config.to_dict()
        diffs = [f"{k} {a[k]!r} vs {b[k]!r}" for k in a if a[k] != b[k]]
        if self.device_index != other.device_index:
            diffs.append(f"device_index {self.device_index!r} vs {other.device_index!r}")
        return diffs


_mask_keys: weakref.WeakKeyDictionary[Callable[..., Any], str] = weakref.WeakKeyDictionary()


def mask_key(mask_mod: Callable[..., Any] | None) -> str:
    """A name for what a mask_mod computes: ``sliding_window(1024)`` for kernelpack's masks, else a hash of its code
    and closure values (names and file do not enter the cache key either, see masks.py)."""
    if mask_mod is None:
        return "none"
    tag = getattr(mask_mod, "kernelpack_mask", None)
    if tag is not None:
        return str(tag)
    try:
        return _mask_keys[mask_mod]
    except (KeyError, TypeError):
        pass
    code = getattr(mask_mod, "__code__", None)
    if code is None:
        return f"{type(mask_mod).__qualname__}@{id(mask_mod):x}"
    cells = []
    for cell in getattr(mask_mod, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            value = None
        cells.append(repr(value) if isinstance(value, (int, float, bool, str, type(None))) else type(value).__name__)
    digest = hashlib.sha256(code.co_code + repr((code.co_consts, cells)).encode()).hexdigest()[:12]
    key = f"{getattr(mask_mod, '__qualname__', 'mask_mod')}#{digest}"
    with contextlib.suppress(TypeError):
        _mask_keys[mask_mod] = key
    return key


def signature_of(query: Any, key: Any, block_mask: Any, kernel_options: Any, mode: str, dynamic: bool) -> CallSignature:
    """The signature of a call; enable_gqa is implied by the head counts (torch refuses a mismatch)."""
    import torch

    from .recipe import Config

    b, hq, q_len, d = query.shape
    device = query.device
    config = Config(
        device=device.type,
        mask=mask_key(getattr(block_mask, "mask_mod", None)),
        window=None,
        batch=b,
        q_heads=hq,
        kv_heads=key.shape[1],
        q_len=q_len,
        kv_len=key.shape[2],
        head_dim=d,
        dtype=str(query.dtype).removeprefix("torch."),
        backward=torch.is_grad_enabled() and (query.requires_grad or key.requires_grad),
        kernel_options=tuple(sorted((kernel_options or {}).items())),
        mode=mode,
        dynamic=dynamic,
    )
    return CallSignature(config, device.index if device.type == "cuda" else None)


# ---------------------------------------------------------------------------------------------------- the gate


class _Gate:
    """Many steady-state calls at once, or one first call alone (a writer-preferring readers-writer lock)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


_gate = _Gate()


def outside_first_calls() -> contextlib.AbstractContextManager[None]:
    """Run torch tracing work (e.g. create_block_mask) alongside steady-state calls but never during a first call."""
    return _gate.shared()


def _wait_for_foreign_fx_trace() -> None:
    """torch.fx's tracing flag is process-global: if another thread is FX-tracing right now, a compiled call would
    raise or (error_on_nested_fx_trace=False) run uncompiled. Wait for it, bounded."""
    from torch.fx import _symbolic_trace

    if not _symbolic_trace._is_fx_tracing_flag:
        return
    limit = float(os.environ.get("KERNELPACK_FX_WAIT_SECONDS", "300"))
    deadline = time.monotonic() + limit
    while _symbolic_trace._is_fx_tracing_flag:
        if time.monotonic() > deadline:
            raise KernelpackError(
                f"another thread has been FX-tracing for over {limit:.0f} s; a compiled call now would run "
                "flex_attention uncompiled",
                hint="do not FX-trace (torch.fx.symbolic_trace, make_fx) in parallel with the first steps, or raise "
                "KERNELPACK_FX_WAIT_SECONDS",
            )
        time.sleep(0.001)


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
        from .evidence import compiled_anything

        return compiled_anything(self.counters)


@dataclass(frozen=True, slots=True)
class Activation:
    artifact: str | None
    strict: bool
    covered: dict[CallSignature, str]  # signature -> config id
    devices: tuple[int, ...]
    install: InstallResult | None = None

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
    storage_options: dict[str, Any] | None = None,
) -> Activation:
    """Call once at job start, in the main thread, before any worker thread or first forward.

    Installs the artifact (``source``: a .kpack path, default ``$KERNELPACK_ARTIFACT``; or ``registry`` + ``recipe``
    [+ ``lock``]: the registry's artifact for this environment, downloaded once per node) into the cache dir inductor
    will use, points this process at it, raises the recompile limit to cover it in every thread, refuses the dense
    path from now on, and (``strict``) refuses calls the artifact does not cover. Returns what is covered.
    """
    from . import evidence
    from .artifact import read_manifest
    from .install import install
    from .masks import mask_for
    from .recipe import Config

    if registry is not None:
        if recipe is None:
            raise KernelpackError("activate(registry=...) needs recipe=", hint="activate(registry=URL, recipe=NAME)")
        from .store import pull

        source = pull(registry, recipe, lock=lock, storage_options=storage_options, device_index=device_index).path
    source = source if source is not None else os.environ.get("KERNELPACK_ARTIFACT") or None
    evidence.install_hooks(refuse_dense=True)
    if source is None:
        if strict:
            raise KernelpackError(
                "activate(strict=True) needs an artifact", hint="pass activate(path) or set KERNELPACK_ARTIFACT"
            )
        activation = Activation(artifact=None, strict=False, covered={}, devices=())
    else:
        result = install(source, cache_dir, allow_mismatch=allow_mismatch, device_index=device_index)
        manifest = read_manifest(str(source)).data
        devices = tuple(int(d) for d in manifest.get("devices", [manifest.get("device_index", 0)]))
        covered: dict[CallSignature, str] = {}
        for c in manifest["configs"]:
            config = Config.from_dict(c["params"])
            mask_mod = mask_for(config)
            for dev in c.get("devices", devices):
                covered[CallSignature.of_config(config, int(dev), mask_mod)] = config.id
        ensure_recompile_limit(2 * len(covered) + 8)
        activation = Activation(artifact=str(source), strict=strict, covered=covered, devices=devices, install=result)
    _state.active = activation
    log.info(activation.describe())
    return activation


def deactivate() -> None:
    """Forget the activation and the first calls seen (for tests and notebooks). Hooks stay installed."""
    from . import evidence

    global _state
    _state = _State()
    evidence.set_refuse_dense(False)


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
    _apply_thread_config()
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
        with _gate.shared():
            _wait_for_foreign_fx_trace()
            return call()
    with _gate.exclusive():
        if sig in state.ready:  # another thread made this first call while we waited
            return call()
        active = state.active
        config_id = active.covered.get(sig) if active else None
        if active is not None and config_id is None:
            if active.strict:
                raise refusal(sig, active)
            if sig not in state.warned:
                state.warned.add(sig)
                warnings.warn(
                    f"kernelpack: {sig.describe()} is not in {active.artifact}; compiling it here (non-strict mode)",
                    stacklevel=3,
                )
        _wait_for_foreign_fx_trace()
        from . import evidence

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


def refusal(sig: CallSignature, active: Activation, n: int = 3) -> NotPrecompiledError:
    """Strict mode's error for an uncovered call: the call, the ``n`` nearest covered signatures with what differs,
    and whether the device index is all that differs (then the fix is pinning or --devices, not the recipe)."""
    ranked = sorted(active.covered, key=lambda c: (len(c.differences(sig)), c.describe()))
    nearest = [f"{c.describe()} (differs in: {', '.join(c.differences(sig))})" for c in ranked[:n]]
    best = ranked[0].differences(sig) if ranked else []
    device_only = len(best) == 1 and best[0].startswith("device_index")
    return NotPrecompiledError(sig.describe(), nearest, artifact=active.artifact, device_only=device_only)


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
        value = os.environ.get("LOCAL_RANK")
        if value is None:
            raise KernelpackError("pin_local_gpu: LOCAL_RANK is not set", hint="pass local_rank= or run under torchrun")
        local_rank = int(value)
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_initialized():
            raise KernelpackError(
                "pin_local_gpu: CUDA is already initialized in this process; CUDA_VISIBLE_DEVICES no longer applies",
                hint="call kernelpack.runtime.pin_local_gpu() at the very top of the worker, before any CUDA call",
            )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    if devices is not None and local_rank >= len(devices):
        raise KernelpackError(
            f"pin_local_gpu: LOCAL_RANK={local_rank} but CUDA_VISIBLE_DEVICES={visible!r} lists {len(devices)}",
            hint="start one process per visible GPU",
        )
    chosen = devices[local_rank] if devices is not None else str(local_rank)
    os.environ["CUDA_VISIBLE_DEVICES"] = chosen
    return chosen
