"""Job start and the runtime guard: the one module that changes the process kernelpack runs in.

Job start (every door goes through :func:`_start`):

- :func:`install` / :func:`install_from`: install an artifact (a path, or a registry's artifact for this environment,
  downloaded once per node) and point this process at it: ``TORCHINDUCTOR_CACHE_DIR`` and Dynamo's recompile floor
  (:func:`_configure_process`, the only place that does). ``kernelpack.install`` and ``kernelpack.install_from``.
- :func:`activate`: the same, plus the warm-up and the guard. Call it once at job start, in the main thread.

The guard (:func:`activate`, then every :func:`flex_attention` call) makes a first step safe in threads:

- The warm-up (:class:`Warmup`) makes the first call of every covered signature before training, so that no flex
  call traces during training: a Dynamo trace of a training graph runs make_fx and ``torch.autograd.grad`` with
  torch.fx's process-global tracing flag set, and waits for the autograd engine's device thread, which may be
  running another thread's backward whose checkpoint recompute calls flex: a deadlock whatever lock order we pick.
  After it, Dynamo's own guards tell a served call from one that would trace; the latter is refused
  (:class:`NotWarmedError`).
- Without a warm-up (``activate(warmup=False)``, or no artifact), the first call of each call signature runs alone at
  the gate of :mod:`kernelpack.compiled`; steady-state calls run in parallel; a call inside a backward pass never
  waits there for long.
- Strict mode refuses a call the artifact does not cover (:class:`NotPrecompiledError`, from
  :meth:`Manifest.covers`) instead of cold-compiling.
- The dense math path is refused (:class:`DenseFallbackError`), detected where torch runs it (:mod:`evidence`).
- :func:`report` says what each first call cost and whether it compiled anything.

Observers (:func:`observe_calls`, what ``kernelpack record`` uses) see every flex_attention call of the three paths:
kernelpack's entry (and the transformers integration through it) as it is made, the user's own
``torch.compile(flex_attention)`` as Dynamo compiles it.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import logging
import os
import re
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from . import closures, evidence, functions, precompiled, settings
from ._imports import importing_alone
from ._torch.dynamo import compiled_already
from ._torch.dynamo import imported as dynamo_imported
from ._torch.dynamo import when_imported as when_dynamo_imported
from ._torch.inductor import (
    CONFIG_HINT,
    compile_workers,
    import_compiler,
    inductor_torch_key,
    key_settings_cheap,
)
from ._torch.inductor import read_as as torch_key_read_as
from ._torch.triton import prefetch_key as prefetch_triton_key
from .artifact import BuiltConfig, Coverage, Manifest
from .canonical import arguments as canonical_arguments
from .canonical import call as canonical_call
from .canonical import grad_output, make_inputs
from .compiled import (
    apply_thread_config,
    compiled_flex_attention,
    dynamo_hit,
    ensure_recompile_limit,
    gate,
    guard_failure,
    in_backward,
    key_settings_differences,
    recompile_floor_for,
    serving_entry,
    trace_settings,
    wait_for_foreign_fx_trace,
)
from .errors import (
    DEVICE_HINT,
    KernelpackError,
    KernelpackWarning,
    KeyMismatchError,
    NotPrecompiledError,
    NotWarmedError,
)
from .installer import TIER1_ONLY, Installing, InstallResult, begin_install, check_cache_dir, resolve_cache_dir
from .masks import block_mask_for, mask_for, modules_for, score_mod_for
from .recipe import Config
from .signature import CallSignature, graph_of, mask_key, mod_graph, score_mod_key, signature_of
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

    Refuses (:class:`KeyMismatchError`) an artifact built for another torch/triton/CUDA/GPU unless ``allow_mismatch``;
    warns when this process's settings that enter inductor's cache keys differ from the builder's.
    """
    installing = _start(artifact, cache_dir, allow_mismatch=allow_mismatch, device_index=device_index, background=False)
    result = installing.result()
    _check_key_settings(result.manifest, strict=False)
    return result


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
    result = _start(
        None,
        cache_dir,
        registry=registry,
        recipe=recipe,
        lock=lock,
        storage_options=storage_options,
        device_index=device_index,
        background=False,
    ).result()
    _check_key_settings(result.manifest, strict=False)
    return result


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
    background: bool,
) -> Installing:
    """Every job-start door: fetch (a registry's artifact), install, configure this process. ``background``: only
    checks the artifact and the cache dir before it points the process there; the install is finished in the
    background start's thread (a failure is raised by the first guarded call). Otherwise it installs first, so that
    a failed install leaves the process as it was."""
    if registry is not None:
        if recipe is None:
            raise KernelpackError("a registry needs recipe=", hint="activate(registry=URL, recipe=NAME)")
        pulled = pull(registry, recipe, lock=lock, storage_options=storage_options, device_index=device_index)
        artifact, sha256 = pulled.path, pulled.entry.sha256
    else:
        sha256 = None
    assert artifact is not None
    installing = begin_install(
        artifact, cache_dir, allow_mismatch=allow_mismatch, device_index=device_index, sha256=sha256
    )
    if not background:
        installing.finish()
    _configure_process(installing)
    return installing


def _check_key_settings(manifest: Manifest, strict: bool, *, allow_mismatch: bool = False) -> None:
    """The settings that enter inductor's cache keys (inductor and functorch config, deterministic algorithms,
    matmul precision, CPU threads: :func:`kernelpack.compiled.key_settings`) as the builder had them: otherwise every
    entry misses. Strict: refused, naming each; else a warning."""
    if not manifest.key_settings:
        return
    differ = key_settings_differences(manifest.key_settings, manifest.build_key.device_type)
    if not differ:
        return
    lines = [f"  {name}: built with {built}, here {here}" for name, built, here in differ[:12]]
    if len(differ) > 12:
        lines.append(f"  ... and {len(differ) - 12} more")
    message = (
        f"{manifest.name} was built under other settings that enter inductor's cache keys; calls would miss its "
        "FX-graph or AOTAutograd entries:\n" + "\n".join(lines)
    )
    hint = (
        f"set them as the builder had them before activate() ({CONFIG_HINT}, "
        "torch.set_num_threads(N), TORCHINDUCTOR_* variables), or rebuild the recipe under this process's settings"
    )
    if strict and not allow_mismatch:
        raise KernelpackError(message, hint=hint + "; activate(allow_mismatch=True) only warns")
    warnings.warn(f"kernelpack: {message}\n{hint}", KernelpackWarning, stacklevel=3)


def _configure_process(result: Installing) -> None:
    """The one place kernelpack changes this process for an installed artifact: inductor reads the cache it was
    installed into, and Dynamo's recompile limit covers every (config, device) of it (at Dynamo's default of 8 it
    would fall back to eager, i.e. the dense path)."""
    target = Path(result.cache_dir)
    current = settings.inductor_cache_dir()
    if current is not None and current != target and compiled_already():
        warnings.warn(
            f"torch already compiled in this process with TORCHINDUCTOR_CACHE_DIR={current}; the artifact is "
            f"installed into {target} and TORCHINDUCTOR_CACHE_DIR now points there. Graphs compiled before this "
            "call were not affected: install before the first compiled call (kernelpack install at job start).",
            KernelpackWarning,
            stacklevel=4,
        )
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(target)
    floor = recompile_floor_for(len(result.manifest.signatures))
    # when Dynamo is imported (now, if it is): importing it here would cost the job's start a second (issue 36)
    when_dynamo_imported(lambda: ensure_recompile_limit(floor))


# ------------------------------------------------------------------------------------------------ activation


@dataclass(frozen=True, slots=True)
class FirstCall:
    signature: CallSignature
    config_id: str | None  # the artifact's config that covers it; None when not covered
    thread: str
    seconds: float
    counters: dict[str, int]
    warmup: bool = False  # made by activate()'s warm-up, not by the job
    tier: str = "inductor-cache"  # what served it: "precompiled" (tier 2) or "inductor-cache" (tier 1)

    @property
    def compiled(self) -> list[str]:
        return evidence.compiled_anything(self.counters)


@dataclass(frozen=True, slots=True)
class Activation:
    artifact: str | None
    strict: bool
    # None: activated without an artifact (non-strict); a background start's install finishes in its thread
    installing: Installing | None = None
    warmup: Warmup | None = None  # None: no warm-up, first calls trace at the gate
    # the compile modes of the artifact's dynamic range configs: kernelpack.flex_attention serves a call one of them
    # covers with the dynamic graph
    dynamic_modes: frozenset[str] = frozenset()

    @property
    def install(self) -> InstallResult | None:
        """What the install wrote; after a background start, once its thread has installed (waits for it, bounded
        by KERNELPACK_WARMUP_WAIT_SECONDS; raises what failed)."""
        if self.installing is None:
            return None
        return self.installing.result(None if self.installing.finished else settings.warmup_wait_seconds())

    @property
    def cache_dir(self) -> str | None:
        """The cache dir the artifact is (being) installed into."""
        return self.installing.cache_dir if self.installing is not None else None

    @property
    def manifest(self) -> Manifest | None:
        return self.installing.manifest if self.installing is not None else None

    @property
    def covered(self) -> tuple[CallSignature, ...]:
        """Every (config, device, graph) signature the artifact serves."""
        return self.manifest.signatures if self.manifest is not None else ()

    @property
    def devices(self) -> tuple[int, ...]:
        return self.manifest.devices if self.manifest is not None else ()

    def covers(self, signature: CallSignature) -> Coverage:
        return self.manifest.covers(signature) if self.manifest is not None else Coverage(signature, None)

    def wait(self) -> Activation:
        """Until a background start (activate()'s default) is done: installed, imported, warmed. Raises what it
        failed with, as a guarded call would. Returns this activation (``activate(...).wait()``); at once after
        ``warmup=True`` or ``False``. For a job that measures from a finished start, or wants a failure here."""
        if self.warmup is not None and self.warmup.background:
            self.warmup.wait()
        return self

    def describe(self) -> str:
        warm = "no warm-up" if self.warmup is None else self.warmup.describe()
        return (
            f"kernelpack active: {len(self.covered)} (config, device, graph) signatures from "
            f"{self.artifact or 'no artifact'}, devices {list(self.devices)}, "
            f"{'strict' if self.strict else 'non-strict'}, {warm}"
        )


def _forked_child() -> None:
    """In a child forked while a background warm-up ran: that thread does not exist here, so a guarded call would
    wait for it until KERNELPACK_WARMUP_WAIT_SECONDS (900 s by default) ran out. It fails at once instead, saying
    why. (The Event is replaced: the warm-up thread may have held its lock at the fork.)"""
    for warm in list(_background_warmups):
        if not warm.done.is_set():
            warm.error = KernelpackError(
                "this process was forked while activate()'s background warm-up ran in its parent; the warm-up "
                "thread does not exist here",
                hint="fork before activate(), or activate(warmup=True) so that it ends before the fork, or call "
                "activate() again in the child",
            )
            warm.done = threading.Event()
            warm.done.set()


_background_warmups: weakref.WeakSet[Warmup] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked_child)


class Warmup:
    """activate()'s warm-up: the first call of every covered signature this process can make, before training.

    After it, a call served by one of the Dynamo entries the warm-up's calls were served by (checked with Dynamo's
    own guards, :func:`kernelpack.compiled.dynamo_hit`) runs at once, and nothing traces during training; any other
    call is refused (:class:`NotWarmedError`). Run in the activating thread, or in a background thread that every
    guarded call waits for; never on an autograd engine thread."""

    def __init__(self, background: bool) -> None:
        self.background = background
        self.done = threading.Event()
        self.thread: int | None = None  # a background start's thread (threading.get_ident)
        self.settings_checked = False  # activate() checked the key settings itself
        if background:
            _background_warmups.add(self)
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.signatures: set[CallSignature] = set()
        self.skipped: dict[CallSignature, str] = {}  # covered but not warmed here, and why
        self.entries: dict[CallSignature, Any] = {}  # the Dynamo entry (guard manager) that served each warm call
        self.served_by: frozenset[Any] = frozenset()  # those entries: what may serve a call during training
        self.masks: dict[str, list[Any]] = {}  # the warmed mask functions, by the key of their graph
        self.score_mods: dict[str, list[Any]] = {}  # the warmed score_mods, likewise
        self.by_entry: dict[Any, CallSignature] = {}  # served_by's entries -> the signature each was warmed for
        # tier 2: the loaded precompiled function of each signature it serves, and for every other warmed signature
        # why the inductor cache (tier 1) serves it instead
        self.precompiled: dict[CallSignature, precompiled.Loaded] = {}
        self.tier1_why: dict[CallSignature, str] = {}
        self.mods: list[Any] = []  # every warmed mask_mod and score_mod: the code tier 2 may run (_runs_warmed_code)
        # tier 2, loaded lazily (KERNELPACK_LOAD=lazy): signature -> its config, until its first call loads
        # it; one load at a time (torch's code cache is process-wide), never a trace
        self.lazy: dict[CallSignature, BuiltConfig] = {}
        self.load_lock = threading.Lock()
        self.unrun: set[CallSignature] = set()  # loaded lazily, not yet called: its first run is the load's
        # a background start's phases, each its end (time.perf_counter()): what a benchmark splits the start by
        self.timeline: dict[str, float] = {}

    def describe(self) -> str:
        if not self.done.is_set():
            return "background start running (install, torch's compiler imports, warm-up)"
        if self.error is not None:
            return f"warm-up failed: {type(self.error).__name__}: {self.error}"
        dynamic = sum(s.dynamic for s in self.signatures)
        ranges = f" ({dynamic} of them dynamic graphs, each serving its range)" if dynamic else ""
        tiers = f", {len(self.precompiled)} served by precompiled functions" if self.precompiled else ""
        lazy = f", {len(self.lazy)} precompiled functions load at their first call" if self.lazy else ""
        return f"{len(self.signatures)} signatures warmed in {self.seconds:.2f} s{ranges}{tiers}{lazy}"

    def wait(self) -> None:
        """Until the warm-up is done (bounded); raises if it failed."""
        if not self.done.is_set():
            inside = in_backward()
            limit = settings.backward_wait_seconds() if inside else settings.warmup_wait_seconds()
            if not self.done.wait(limit):
                variable = "KERNELPACK_BACKWARD_WAIT_SECONDS" if inside else "KERNELPACK_WARMUP_WAIT_SECONDS"
                raise KernelpackError(
                    f"kernelpack's background warm-up has not finished after {limit:.0f} s",
                    hint=f"raise {variable}, or activate(warmup=True) to warm before activate() returns",
                )
        error = self.error
        if error is not None:
            text = error.message if isinstance(error, KernelpackError) else str(error)
            raise KernelpackError(
                f"activate()'s {'background start' if self.background else 'warm-up'} failed: "
                f"{type(error).__name__}: {text}",
                hint=_failed_hint(error),
            ) from error


def _failed_hint(error: BaseException) -> str:
    own = getattr(error, "hint", None)
    if isinstance(error, KernelpackError) and own:
        return f"{own} (the error is chained to this one)"
    return "the error is chained to this one; activate(warmup=True) raises it from activate() itself"


@dataclass
class _State:
    active: Activation | None = None
    ready: set[CallSignature] = field(default_factory=set)
    first_calls: list[FirstCall] = field(default_factory=list)
    refused: list[tuple[CallSignature, str]] = field(default_factory=list)
    warned: set[CallSignature] = field(default_factory=set)
    warned_sites: set[str] = field(default_factory=set)  # call sites warned of a compile kernelpack only observed
    since: int = 0  # evidence records from this mark on are this activation's
    lock: threading.Lock = field(default_factory=threading.Lock)
    # after a warm-up, per (warmed signature, tier): [calls served, q min, q max, kv min, kv max]
    served: dict[tuple[CallSignature, str], list[int]] = field(default_factory=dict)
    # torch's own process-wide counters when this activation began ({}: the process's start): what torch counted
    # that kernelpack holds no record of (compiled before it watched) is said in the report, never counted as 0
    counters_at: dict[str, int] = field(default_factory=dict)


_state = _State()


def activate(
    source: str | os.PathLike[str] | None = None,
    *,
    strict: bool = True,
    warmup: bool | Literal["background"] = "background",
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

    ``warmup`` (with an artifact): ``"background"`` (the default) returns once the artifact's manifest, build key
    and the cache dir are checked (tenths of a second); a thread then installs the files, imports torch's compiler
    stack and warms up while the job builds its model, and the first guarded call waits for it (an error there is
    raised by that call, and :func:`report` says it). ``True``: all of it before activate() returns, so that every
    error is raised here.  Either way the warm-up makes the first call of every covered signature on every visible
    device of the artifact that must trace; precompiled functions load at their signature's first call.
    After it, no flex call traces during training: a call that would (not covered, or not as warmed: another mask
    function, other strides, autocast) raises :class:`NotWarmedError`, in non-strict mode too. ``False``: first
    calls trace at the gate during the job, as before; only safe where no other thread runs backward meanwhile (no
    threads, or no gradient checkpointing), and non-strict mode then compiles uncovered calls with a warning.
    """
    if warmup not in (True, False, "background"):
        raise KernelpackError(f"activate(warmup={warmup!r})", hint='warmup is True, False or "background"')
    if settings.record_dir() is not None:
        # `kernelpack record` runs this job to see its calls: nothing to install or refuse, and no call may be
        # refused for not being covered (that is what is being recorded)
        global _state
        _state = _State(active=Activation(artifact=None, strict=False), since=evidence.next_seq())
        _register_integrations()
        log.warning("kernelpack record: activate() installs nothing and refuses nothing while the job is recorded")
        return _state.active  # type: ignore[return-value]
    if cache_dir is not None or settings.inductor_cache_dir() is not None:
        # before torch's inductor is imported: importing Dynamo makes TORCHINDUCTOR_CACHE_DIR (_torch.dynamo.imported),
        # and a file or an unwritable directory there would surface as a raw torch traceback
        check_cache_dir(resolve_cache_dir(cache_dir))
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
        background = warmup == "background"
        if background:
            settings.install_in_process()  # a bad value is refused here, not in the start's thread
        installing = _start(
            source,
            cache_dir,
            registry=registry,
            recipe=recipe,
            lock=lock,
            storage_options=storage_options,
            allow_mismatch=allow_mismatch,
            device_index=device_index,
            background=background,
        )
        settings_now = not background or key_settings_cheap()
        if settings_now:
            # reading inductor's and functorch's config imports Dynamo: a background start reads them in its thread,
            # unless the job imported them already (then a mismatch is refused here, where it is cheap)
            _check_key_settings(installing.manifest, strict, allow_mismatch=allow_mismatch)
        warm = Warmup(background=background) if warmup else None
        if warm is not None:
            warm.settings_checked = settings_now
        if background:
            for module in sorted({m for built in installing.manifest.configs for m in modules_for(built.config)}):
                closures.import_module(module, "a mask or score_mod of the artifact")  # masks.modules_for: why
        manifest = installing.manifest
        dynamic_modes = frozenset(c.config.mode for c in manifest.configs if c.config.q_range is not None)
        activation = Activation(
            artifact=installing.artifact, strict=strict, installing=installing, warmup=warm, dynamic_modes=dynamic_modes
        )
    # only now: a failed activate() leaves the previous one in force
    _state = state = _State(active=activation, since=evidence.next_seq(), counters_at=_torch_counters())
    evidence.watch_compiles(_observed, _refuse_foreign_compile)
    _register_integrations()
    if activation.warmup is not None:
        if activation.warmup.background:
            # in a copy of this thread's context: from torch 2.13 an inductor config value the job set (CONFIG_HINT)
            # is a ContextVar override, which a new thread does not see (measured: CPU, torch 2.13 and 2.15;
            # 2.11's is process-wide), and the warm-up must read and compile under the job's settings
            threading.Thread(
                target=contextvars.copy_context().run,
                args=(_start_in_background, state, activation, allow_mismatch),
                name="kernelpack-warmup",
                daemon=True,
            ).start()
        else:
            _warm_up(state, activation)
    log.info(activation.describe())
    return activation


# library -> the kernelpack integration activate() registers when the job has imported that library (never
# imported here: transformers costs seconds). By name, as fsspec's known_implementations: an integration is a client
# of this module (it calls the guarded entry), a layer above it.
INTEGRATIONS = {"transformers": "kernelpack.integrations.transformers"}


def _register_integrations() -> None:
    import importlib

    for library, module_name in INTEGRATIONS.items():
        if library not in sys.modules:
            continue
        try:
            importlib.import_module(module_name).register()
        except Exception as e:  # an untested version must not stop the job's start; the name is then unknown
            warnings.warn(
                f"kernelpack: could not register kernelpack with {library}: {type(e).__name__}: {e}",
                KernelpackWarning,
                stacklevel=3,
            )


def deactivate() -> None:
    """Forget the activation and the first calls seen (for tests and notebooks). Hooks stay installed."""
    global _state
    _state = _State()
    evidence.set_refuse_dense(False)


# What a background start imports in its thread while the job's threads wait before importing any of it (kernelpack.
# _imports.importing_alone says why): torch's compiler stack and the libraries it imports on the way
_COMPILER_STACK = ("torch", "triton", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "filelock", "numpy")


def _start_in_background(state: _State, activation: Activation, allow_mismatch: bool) -> None:
    """``activate(warmup="background")``'s thread (the default start): what activate() leaves to it, while the job
    builds its model: the install's files (hash, extract, marker), in a thread of their own that overlaps the imports
    (zstd and the writes release the GIL; the imports hold it), and what imports Dynamo and inductor (1.5-5 s of a
    job's start, issue 36); then the warm-up, once both are done. The job's threads wait for these imports
    (:func:`kernelpack._imports.importing_alone`) and every guarded call for the warm-up; an error here is raised by
    each guarded call."""
    warm, manifest, installing = activation.warmup, activation.manifest, activation.installing
    assert warm is not None and manifest is not None and installing is not None
    warm.thread = threading.get_ident()
    with importing_alone(_COMPILER_STACK, settings.warmup_wait_seconds()):
        first_part = threading.Event()
        try:
            # started inside the window: a thread the window's thread starts is not held at its imports; decided
            # here: the install's thread is exempt from the gate, and must import nothing of torch beside it
            split = _tier2_unavailable() is None
            threading.Thread(
                target=_install_in_parts,
                args=(installing, first_part, split, settings.install_in_process()),
                name="kernelpack-install",
                daemon=True,
            ).start()
            triton_key = prefetch_triton_key()  # hashing libtriton.so beside the imports (GIL-free)
            import_compiler()
            warm.timeline["imports"] = time.perf_counter()
            # activate() checked the artifact's torch_key against kernelpack's reading of torch's sources; where
            # that reading was not what matched, inductor's own decides what hits. Where it matched, inductor's is
            # not computed again: 0.2-0.7 s of hashing on the job's path that a precompiled load never asks for
            # (its torch_key stays uncomputed: CPU, torch 2.13), and a tier-1 trace computes it itself
            key = manifest.build_key.torch_key
            if not torch_key_read_as(key) and (here := inductor_torch_key()) != key and not allow_mismatch:
                raise KeyMismatchError(str(activation.artifact), [("torch_key", key, here)])
            if not warm.settings_checked:
                _check_key_settings(manifest, activation.strict, allow_mismatch=allow_mismatch)
            # the warm-up needs the files precompiled functions load; the inductor cache's own entries (tier 1) come
            # after, and the warm-up waits for them only before it traces (_warm_one)
            warm.timeline["checks"] = time.perf_counter()
            first_part.wait()
            warm.timeline["first_part"] = time.perf_counter()
            if installing.error is not None:
                installing.result(timeout=0)  # raises what the install raised
            if triton_key is not None:
                triton_key.join(settings.warmup_wait_seconds())
            warm.timeline["triton_key"] = time.perf_counter()
        except BaseException as e:
            warm.error = e
            warm.done.set()
            return
        _warm_up(state, activation)


def _install_in_parts(installing: Installing, first_part: threading.Event, split: bool, in_child: bool) -> None:
    """The install's thread: first the files precompiled functions need (every file but the inductor cache's own
    FX-graph and AOTAutograd entries, which only a Dynamo trace reads: issue 36's "install only the tier that
    serves"), then the rest and the marker. Not ``split`` (tier 2 off): all in one part. The outcome is kept for
    :meth:`Installing.result` and report(), not raised here."""
    try:
        if split:
            installing.finish_first(lambda rel: not rel.startswith(TIER1_ONLY), in_child=in_child)
    finally:
        first_part.set()
    try:
        installing.finish(in_child=in_child)
    except BaseException as e:  # the first guarded call or report() says it; a tier-1 warm-up raises it
        log.warning("kernelpack: installing %s failed: %s: %s", installing.artifact, type(e).__name__, e)


def _warm_up(state: _State, activation: Activation) -> None:
    """The canonical calls (:mod:`kernelpack.canonical`) of every covered signature on the visible devices, each
    alone at the gate, recorded as first calls with the Dynamo entries that served them."""
    warm, manifest = activation.warmup, activation.manifest
    assert warm is not None and manifest is not None
    start = time.perf_counter()
    try:
        import torch

        apply_thread_config()
        lazy = settings.load_precompiled_lazily()
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for built in manifest.configs:
            config = built.config
            for index in built.devices:
                sigs = built.signatures(index)
                if config.device == "cuda" and index >= visible:
                    for sig in sigs:
                        warm.skipped[sig] = f"cuda:{index} is not visible in this process ({visible} GPUs)"
                    continue
                device = "cpu" if config.device == "cpu" else f"cuda:{index}"
                # factories make their example tensors on the current device: this one, as in the builder's worker
                on_device = torch.cuda.device(index) if config.device == "cuda" else contextlib.nullcontext()
                with on_device:
                    mask_mod = mask_for(config, device)
                    score_mod = score_mod_for(config)
                if built.mask_key_of(mask_mod) != built.mask_key:
                    for sig in sigs:
                        warm.skipped[sig] = (
                            f"its mask computes {built.mask_key_of(mask_mod)!r} here, {built.mask_key!r} in the builder"
                        )
                    continue
                if built.score_key and score_mod_key(score_mod) != built.score_key:
                    for sig in sigs:
                        warm.skipped[sig] = (
                            f"its score_mod computes {score_mod_key(score_mod)!r} here, {built.score_key!r} in the "
                            "builder"
                        )
                    continue
                _remember(warm.masks, mask_mod, "mask")
                _remember(warm.score_mods, score_mod, "score")
                warm.mods += [f for f in (mask_mod, score_mod) if f is not None and f not in warm.mods]
                bm = None  # the canonical call's BlockMask, made only for a signature that is called now
                for sig in sigs:
                    why = _tier2_why(built, sig, mask_mod, score_mod)
                    if why is None and lazy and warm.precompiled:
                        # one function is loaded and called now (what every load imports and initializes is paid
                        # once, by the first, here); the others load at their first call (_loaded)
                        warm.lazy[sig] = built
                        continue
                    if bm is None:
                        with on_device:
                            bm = block_mask_for(config, device, mask_mod)
                    if why is not None:
                        warm.tier1_why[sig] = why
                    elif _load_precompiled(state, warm, activation, built, sig, device, bm):
                        continue
                    _warm_one(state, warm, built, sig, device, bm)
        warm.served_by = frozenset(e for e in warm.entries.values() if e is not None)
        warm.by_entry = {e: sig for sig, e in warm.entries.items() if e is not None}
    except BaseException as e:
        warm.error = e
        if not warm.background:
            raise
    finally:
        warm.seconds = time.perf_counter() - start
        warm.timeline["warm_up"] = time.perf_counter()
        warm.done.set()
    if warm.skipped:
        log.info("warm-up skipped %d signatures: %s", len(warm.skipped), sorted(set(warm.skipped.values())))
    compiled = [c for c in state.first_calls if c.warmup and c.compiled]
    if compiled:
        totals: dict[str, int] = {}
        for c in compiled:
            for name, n in c.counters.items():
                totals[name] = totals.get(name, 0) + n
        warnings.warn(
            f"kernelpack: activate()'s warm-up compiled {len(compiled)} of {len(warm.signatures)} signatures "
            f"({', '.join(evidence.compiled_anything(totals))}): {activation.artifact} does not serve this "
            "environment fully; kernelpack verify says why",
            KernelpackWarning,
            stacklevel=3,
        )


def _remember(warmed: dict[str, list[Any]], fn: Callable[..., Any] | None, kind: Literal["mask", "score"]) -> None:
    graph = mod_graph(fn, kind) if fn is not None else None
    if graph is not None and fn not in warmed.setdefault(graph.key, []):
        warmed[graph.key].append(fn)


def _tier2_unavailable() -> str | None:
    """Why no call is served by a precompiled function in this process, or None."""
    if not settings.serve_precompiled():
        return "KERNELPACK_PRECOMPILED=0"
    return precompiled.load_unavailable()


def _loaded(state: _State, warm: Warmup, activation: Activation, sig: CallSignature) -> precompiled.Loaded | None:
    """The precompiled function of ``sig``: loaded already, or now if it loads lazily (at its first call; the
    warm-up loads and calls one, so that what every load imports and initializes is paid there). Loading checks
    the file against the manifest's sha256, unpickles the function and imports its generated code: it traces
    nothing and waits for no other thread's call, so it is safe in a training thread and on the autograd engine's
    thread (a reentrant checkpoint's recompute). A function that fails to load serves nothing: its calls are
    refused, saying why (with KERNELPACK_LOAD=eager the inductor cache serves such a signature, traced at
    activate())."""
    loaded = warm.precompiled.get(sig)
    if loaded is not None or sig not in warm.lazy:
        return loaded
    with warm.load_lock:  # one load at a time: torch's code cache is process-wide
        loaded = warm.precompiled.get(sig)
        built = warm.lazy.get(sig)
        if loaded is not None or built is None:
            return loaded
        entry = built.precompiled_for(sig.device_index or 0, sig.graph)
        assert entry is not None and activation.cache_dir is not None
        try:
            with _measured(_Call(LOAD_PATH, sig)) as measured:
                loaded = precompiled.load(Path(activation.cache_dir, entry.path), built.config.device, entry.sha256)
        except Exception as e:
            why = f"its precompiled function failed to load at its first call: {type(e).__name__}: {e}"[:1000]
            warm.skipped[sig] = why + " (KERNELPACK_LOAD=eager: the inductor cache serves such a signature)"
            del warm.lazy[sig]
            log.warning("kernelpack: %s: %s", sig.describe(), why)
            return None
        warm.unrun.add(sig)
        warm.precompiled[sig] = loaded
        warm.signatures.add(sig)
        del warm.lazy[sig]
    _record_first_call(state, sig, built.config.id, measured, warmup=False, tier="precompiled")
    return loaded


def _tier2_why(built: BuiltConfig, sig: CallSignature, mask_mod: Any, score_mod: Any) -> str | None:
    """Why a precompiled function cannot serve this signature here (the inductor cache serves it), or None."""
    why = _tier2_unavailable()
    if why is None and built.precompiled_for(sig.device_index or 0, sig.graph) is None:
        why = built.not_precompiled or "the artifact has no precompiled function for it"
    for kind, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        read = precompiled.reads_globals(fn) if why is None else None
        if read:  # torch drops guards on globals from a saved function: the job could change the value unseen
            why = f"its {kind} reads the global {read}, whose guards torch drops from a precompiled function"
    return why


def _load_precompiled(
    state: _State,
    warm: Warmup,
    activation: Activation,
    built: BuiltConfig,
    sig: CallSignature,
    device: str,
    bm: Any,
) -> bool:
    """Tier 2 for one warmed signature, loaded now (KERNELPACK_LOAD=eager): load its precompiled function from the
    installed cache and make the canonical call through it (kernel loading happens here, not in the job's first
    step). On any failure the inductor cache serves the signature (the caller warms it) and
    :attr:`Warmup.tier1_why` says why. Runs in the warm-up's thread: never at the first-call gate, never on an
    autograd engine thread."""
    import torch

    config = built.config
    assert activation.cache_dir is not None
    entry = built.precompiled_for(sig.device_index or 0, sig.graph)
    assert entry is not None
    try:
        with _measured(_Call("kernelpack warm-up", sig)) as measured:
            loaded = precompiled.load(Path(activation.cache_dir, entry.path), config.device, entry.sha256)
            inputs = make_inputs(config, device, sig.graph, random=False)
            dout = grad_output(inputs[0], random=False) if sig.graph == "fwd+bwd" else None
            canonical_call(loaded.checked, config, sig.graph, inputs, bm, dout)
            if config.device == "cuda":
                torch.cuda.synchronize(device)
    except Exception as e:  # tier 1 serves it, and the report says why
        warm.tier1_why[sig] = f"its precompiled function failed to load or run: {type(e).__name__}: {e}"[:1000]
        log.warning("kernelpack: %s: %s; the inductor cache serves it", sig.describe(), warm.tier1_why[sig])
        return False
    warm.precompiled[sig] = loaded
    warm.signatures.add(sig)
    _record_first_call(state, sig, config.id, measured, warmup=True, tier="precompiled")
    return True


def _warm_one(state: _State, warm: Warmup, built: BuiltConfig, sig: CallSignature, device: str, bm: Any) -> None:
    import torch

    active = state.active
    if active is not None and active.installing is not None and not active.installing.finished:
        # a background start's inductor-cache entries (the install's second part): a trace reads them
        active.installing.result(settings.warmup_wait_seconds())
    config = built.config
    inputs = make_inputs(config, device, sig.graph, random=False)
    dout = grad_output(inputs[0], random=False) if sig.graph == "fwd+bwd" else None
    # traced as the builder traced it: its marks symbolic, the rest static (the builder's cache entry)
    with gate.exclusive(), trace_settings(config.dynamic, canonical_arguments(config, inputs, bm), built.marks):
        with _measured(_Call("kernelpack warm-up", sig)) as measured:
            canonical_call(compiled_flex_attention(config.mode, config.dynamic), config, sig.graph, inputs, bm, dout)
            if config.device == "cuda":
                torch.cuda.synchronize(device)
        with torch.set_grad_enabled(sig.graph == "fwd+bwd"):
            # the entry Dynamo now serves this call from (None: none passes, it would trace again)
            warm.entries[sig] = serving_entry(canonical_arguments(config, inputs, bm), config.mode, config.dynamic)
    warm.signatures.add(sig)
    _record_first_call(state, sig, config.id, measured, warmup=True, tier="inductor-cache")


def _record_first_call(
    state: _State, sig: CallSignature, config_id: str | None, measured: _Measured, *, warmup: bool, tier: str
) -> None:
    """A first call made in this thread: the warm-up's, a lazy load's, or one at the gate."""
    with state.lock:
        state.first_calls.append(
            FirstCall(
                sig, config_id, threading.current_thread().name, measured.seconds, measured.counters, warmup, tier
            )
        )


# ------------------------------------------------------------------------------------------------ lengths


def padded_length(n: int, *, where: Callable[[Config], bool] | None = None) -> int:
    """The length to pad a sequence of ``n`` tokens to (q_len == kv_len) so that the active artifact serves it:
    ``n`` itself when a dynamic range covers it, else the smallest bucket at or above ``n`` (``seq_len = { min, max,
    multiple }``). Pad q, k and v at the end (the README's "Varying lengths" shows a training step), and drop the
    padded query rows of the output. Raises :class:`KernelpackError` when nothing covers ``n``. ``where``: only the
    artifact's configs it accepts (an artifact of several calls whose buckets differ, e.g.
    ``where=lambda c: c.head_dim == 128``)."""
    return padded_lengths(n, n, tied=True, where=where)  # type: ignore[no-any-return]


def padded_lengths(
    q_len: int, kv_len: int, *, tied: bool = False, where: Callable[[Config], bool] | None = None
) -> Any:
    """(q_len, kv_len) padded to what the active artifact serves: themselves when a dynamic range covers them, else
    the smallest covered (bucket q_len, bucket kv_len) at or above them. ``tied``: only q_len == kv_len points, and
    return the one length. ``where``: only the configs it accepts."""
    manifest = _state.active.manifest if _state.active is not None else None
    if manifest is None:
        raise KernelpackError(
            "padded_length() reads the buckets of the active artifact, and none is active",
            hint="call kernelpack.runtime.activate(artifact) first",
        )
    for n in (q_len, kv_len):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise KernelpackError(f"padded_length({n!r}): a length is a positive int", hint="pass the batch's length")
    fits: list[tuple[int, int]] = []  # the static buckets that hold the lengths
    longest = 0
    for built in manifest.configs:
        c = built.config
        if where is not None and not where(c):
            continue
        if c.q_range is not None and c.kv_range is not None:
            if c.covers_lengths(q_len, kv_len):
                return q_len if tied else (q_len, kv_len)
            longest = max(longest, c.q_range[1])
            continue
        if tied and c.q_len != c.kv_len:
            continue
        longest = max(longest, c.q_len)
        if c.q_len >= q_len and c.kv_len >= kv_len:
            fits.append((c.q_len, c.kv_len))
    if not fits:
        asked = f"{q_len} tokens (q_len == kv_len)" if tied else f"q_len {q_len}, kv_len {kv_len}"
        longest_text = f"the longest covered q_len is {longest}" if longest else "it covers no such length"
        raise KernelpackError(
            f"{manifest.name} has no bucket or range that holds {asked} ({longest_text})",
            hint="truncate or drop longer sequences, or raise the recipe's max and rebuild; for q_len != kv_len "
            "(kv_len = { offset = ... }) ask padded_lengths(q_len, kv_len)",
        )
    best = min(fits, key=lambda qk: (qk[0] * qk[1], qk[0]))  # the least padded work
    return best[0] if tied else best


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
        arguments = {
            "query": query,
            "key": key,
            "value": value,
            "score_mod": score_mod,
            "block_mask": block_mask,
            "scale": scale,
            "enable_gqa": enable_gqa,
            "return_lse": return_lse,
            "kernel_options": kernel_options,
            **kwargs,
        }
        return _guarded_call(mode, dynamic, arguments)

    return flex_attention


flex_attention = guarded()


def _guarded_call(mode: str, dynamic: bool, arguments: dict[str, Any]) -> Any:
    import torch

    warm = _state.active.warmup if _state.active is not None else None
    if warm is not None and not warm.done.is_set():
        # a background start first: a thread started after activate() is not held at its imports, and this path
        # imports parts of torch (kernelpack._imports.importing_alone)
        warm.wait()
    apply_thread_config()
    evidence.ensure_watching()
    query = arguments["query"]
    if isinstance(query, torch.fx.Proxy):  # this thread is FX-tracing us: torch decides (raise or inline)
        return compiled_flex_attention(mode, dynamic)(**arguments)
    if _observers:  # the call as the user made it (before the forward-only detach below)
        stand_in = _notify("kernelpack.flex_attention", arguments, mode, dynamic)
        if stand_in is not None:
            return stand_in(arguments)
    qkv = (query, arguments["key"], arguments["value"])
    if (
        graph_of(*qkv) == "fwd"
        and _closes_over_no_tensor(arguments["score_mod"])
        and (torch.is_grad_enabled() or any(t.requires_grad for t in qkv))
    ):
        # A call autograd does not record (grad mode off, or no input requires grad): the same call on detached
        # inputs under no_grad, as the canonical forward-only call is made. Dynamo guards on grad mode and on each
        # input's requires_grad, so this is what lets one warmed entry serve inference, a forward with grad mode on,
        # and reentrant checkpointing's forward (no_grad on inputs that require grad). Not with a score_mod that
        # closes over tensors: they may require grad.
        plain = {id(t): t.detach() for t in qkv}  # one tensor passed twice stays one (alias is in the signature)
        detached = dict(arguments, query=plain[id(qkv[0])], key=plain[id(qkv[1])], value=plain[id(qkv[2])])
        with torch.no_grad():
            return _guarded_call(mode, dynamic, detached)
    state = _state
    active = state.active
    if active is not None and active.warmup is not None:
        # the compiled callable only where tier 1 serves: creating the first one imports inductor (70 ms on CPU)
        return _serve(state, active, active.warmup, mode, dynamic, arguments)
    return _first_call_at_the_gate(state, active, compiled_flex_attention(mode, dynamic), mode, dynamic, arguments)


# ------------------------------------------------------------------------------------------------ observers

# Called with (path, arguments, mode, dynamic) for every flex_attention call (arguments None for an eager call, which
# torch does not hand over); may return a function that makes the call's outputs instead (record's stand-in).
CallObserver = Callable[[str, "Mapping[str, Any] | None", str, bool], "Callable[[Mapping[str, Any]], Any] | None"]
_observers: list[CallObserver] = []
_observers_lock = threading.Lock()


@contextlib.contextmanager
def observe_calls(observer: CallObserver) -> Any:
    """Call ``observer`` for every flex_attention call made while the block runs, in the thread that makes it:
    calls through :data:`flex_attention` (and :func:`guarded`) as they are made, calls of the user's own
    ``torch.compile(flex_attention)`` as Dynamo compiles them (with the defaults for their compile options, which
    are not in the frame), eager calls as ``"flex_attention (eager)"`` with no arguments. Works with or without
    :func:`activate`."""
    evidence.install_hooks()
    evidence.watch_compiles(_observed, _refuse_foreign_compile)
    with _observers_lock:
        _observers.append(observer)
    try:
        yield observer
    finally:
        with _observers_lock:
            _observers.remove(observer)


def _notify(path: str, arguments: Mapping[str, Any] | None, mode: str, dynamic: bool) -> Any:
    stand_in = None
    for observer in list(_observers):
        stand_in = observer(path, arguments, mode, dynamic) or stand_in
    return stand_in


def _closes_over_no_tensor(score_mod: Callable[..., Any] | None) -> bool:
    if score_mod is None:
        return True
    graph = mod_graph(score_mod, "score")
    return graph is not None and not graph.reads_tensors


def _signature(mode: str, dynamic: bool, arguments: Mapping[str, Any]) -> CallSignature:
    """The call's signature as the active artifact keys it: its mask by every value, or, where that is not covered,
    with the values a dynamic config's graph keeps symbolic by type (:attr:`BuiltConfig.mask_free`: DFlash's S),
    when that is covered."""
    sig = signature_of(arguments, mode, dynamic)
    active = _state.active
    manifest = active.manifest if active is not None else None
    mask_mod = getattr(arguments.get("block_mask"), "mask_mod", None)
    if manifest is None or mask_mod is None or not manifest.free_sets or manifest.entry_for(sig) is not None:
        return sig
    near = sig
    for free in manifest.free_sets:
        keyed = dataclasses.replace(sig, mask=mask_key(mask_mod, free))
        if manifest.entry_for(keyed) is not None:
            return keyed
        if near is sig and any(c.mask_key == keyed.mask for c in manifest.configs):
            near = keyed  # a config's mask, at lengths it does not cover: a refusal then names only the lengths
    return near


def _serve(
    state: _State,
    active: Activation,
    warm: Warmup,
    mode: str,
    dynamic: bool,
    arguments: dict[str, Any],
) -> Any:
    """After the warm-up: a call Dynamo serves from a graph it has runs at once, with no gate (nothing traces now);
    any other is refused. Dynamo's own guards decide (they see strides, grad mode, the mask function's code, ...);
    where torch cannot run them, the call signature stands in."""
    warm.wait()
    apply_thread_config()  # Dynamo is imported by now (the install's build key), and a tier-1 graph may serve
    # First: while another thread FX-traces, torch.fx has patched math.* and other autowrapped functions, which
    # Dynamo guards on by identity, so the guards would fail (and a compiled call would raise or run dense).
    wait_for_foreign_fx_trace(settings.backward_wait_seconds() if in_backward() else None)
    if warm.precompiled or warm.lazy:
        # The call as it is, then with the warmed mask_mod/score_mod of the same graph in place of its own (as tier 1
        # serves it): its exact signature, which names what those functions compute, stands in for the identity
        # guards torch dropped; torch's remaining guards run in serves().
        for candidate in (arguments, *_substitutes(warm, arguments)):
            sig = _signature(mode, dynamic, candidate)
            loaded = _loaded(state, warm, active, sig)
            if loaded is None and active.dynamic_modes and mode in active.dynamic_modes:
                # a length of a dynamic range config's range (strict: in the range, by the manifest): its function,
                # traced at the range's middle, whose guards hold over the range (torch's checks run in serves())
                coverage = active.covers(sig)
                if coverage.entry is not None and coverage.entry.config.q_range is not None:
                    sig = Manifest.traced(sig, coverage.entry)
                    loaded = _loaded(state, warm, active, sig)
            if loaded is not None and _runs_warmed_code(warm, candidate) and loaded.serves(candidate):
                _count_served(state, sig, arguments, "precompiled")
                if sig not in warm.unrun:
                    with evidence.tagged(_SERVED):
                        return loaded(candidate)
                # a lazily loaded function's first run: torch records it as a compile (cache hits only), which is
                # the load's, whichever thread or candidate makes it
                with evidence.tagged(_Call(LOAD_PATH, sig)):
                    out = loaded(candidate)
                warm.unrun.discard(sig)
                return out
    # the static graphs first (faster kernels), then the dynamic ones of the artifact's range configs
    options = [(mode, dynamic)] + ([(mode, True)] if not dynamic and mode in active.dynamic_modes else [])
    for m, d in options:
        hit = dynamo_hit(arguments, warm.served_by, m, d)
        if hit and d and active.strict and active.covers(_signature(m, d, arguments)).entry is None:
            # A dynamic graph's guards hold far beyond the recipe's range (no upper bound on a length, a symbolic
            # batch): strict mode serves only what the artifact covers. One signature per such call, not per
            # static one.
            hit = False
        if hit:
            _count_served(state, warm.by_entry.get(hit, hit), arguments, "inductor-cache")
            with evidence.tagged(_SERVED):
                return compiled_flex_attention(m, d)(**arguments)
    for m, d in options:
        same = _with_warmed_mods(warm, arguments, m, d)
        if same is not None and d and active.strict and active.covers(_signature(m, d, same[0])).entry is None:
            same = None
        if same is not None:
            candidate, entry = same
            _count_served(state, warm.by_entry.get(entry, entry), arguments, "inductor-cache")
            with evidence.tagged(_SERVED):
                return compiled_flex_attention(m, d)(**candidate)
    sig = _signature(mode, dynamic, arguments)
    coverage = active.covers(sig)
    error: KernelpackError
    if coverage.entry is None and active.strict:
        error = refusal(coverage, active.artifact, detail=_mask_detail(active, coverage, arguments))
        why = "not covered by the artifact (strict mode)"
    else:
        error = _not_warmed(warm, coverage, arguments, active)
        why = error.reason.splitlines()[0]
    with state.lock:
        state.refused.append((sig, why))
    raise error


def _count_served(state: _State, sig: Any, arguments: Mapping[str, Any], tier: str) -> None:
    """One served call, under the warmed signature and the tier that served it: which graph served which lengths
    (report)."""
    if not isinstance(sig, CallSignature):
        return
    q, kv = int(arguments["query"].shape[-2]), int(arguments["key"].shape[-2])
    with state.lock:
        seen = state.served.get((sig, tier))
        if seen is None:
            state.served[(sig, tier)] = [1, q, q, kv, kv]
        else:
            seen[0] += 1
            seen[1], seen[2], seen[3], seen[4] = min(seen[1], q), max(seen[2], q), min(seen[3], kv), max(seen[4], kv)


def _with_warmed_mods(
    warm: Warmup, arguments: dict[str, Any], mode: str, dynamic: bool
) -> tuple[dict[str, Any], Any] | None:
    """Masks and score_mods by graph: the user's own mask_mod or score_mod, computing what a warmed one computes
    (:func:`kernelpack.signature.mod_graph`, recorded once per function, never by FX tracing), is served with the
    warmed function in its place. Dynamo guards on the function's code object, so the user's own would be traced;
    the warmed one computes the same thing by construction (a mask over the same block tables). Returns the
    arguments that are served and the entry that serves them, or None."""
    for candidate in _substitutes(warm, arguments):
        entry = dynamo_hit(candidate, warm.served_by, mode, dynamic)
        if entry:
            return candidate, entry
    return None


def _runs_warmed_code(warm: Warmup, arguments: Mapping[str, Any]) -> bool:
    """The call's mask_mod and score_mod run the code of warmed ones: what Dynamo's ID_MATCH guards on code objects
    checked, which torch drops from a saved function (the signature alone trusts a ``kernelpack_mask`` tag)."""
    mask_mod = getattr(arguments.get("block_mask"), "mask_mod", None)
    score_mod = arguments.get("score_mod")
    return all(fn is None or any(_same_code(fn, w) for w in warm.mods) for fn in (mask_mod, score_mod))


def _same_code(fn: Any, warmed: Any) -> bool:
    """``fn`` is ``warmed``, or runs its code: the same code objects throughout (a mask built by and_masks or
    padded() of other masks); the values are the guards' (:func:`kernelpack.functions.same`)."""
    return functions.same(fn, warmed, values=False)


def _substitutes(warm: Warmup, arguments: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The call with warmed mask_mods and score_mods of the same graphs in place of its own (not the call as it is).
    A precompiled function's guards (closure cells) hold for the warmed functions' layout too."""
    block_mask = arguments.get("block_mask")
    mask_mods = _equivalents(warm.masks, getattr(block_mask, "mask_mod", None), "mask")
    score_mods = _equivalents(warm.score_mods, arguments.get("score_mod"), "score")
    for mask_mod in mask_mods:
        for score_mod in score_mods:
            if mask_mod is mask_mods[0] and score_mod is score_mods[0]:
                continue  # the call as it is
            candidate = dict(arguments, score_mod=score_mod)
            if block_mask is not None and mask_mod is not block_mask.mask_mod:
                candidate["block_mask"] = copy.copy(block_mask)
                candidate["block_mask"].mask_mod = mask_mod
            yield candidate


def _equivalents(warmed: dict[str, list[Any]], fn: Any, kind: Literal["mask", "score"]) -> list[Any]:
    """``fn`` itself, then the warmed functions with its graph. Not for a function that reads a tensor (a closure
    over per-batch anchors or document ids): its graph names the tensor by shape, not by value, so a warmed function
    would compute with the warm-up's example values. Such a mask is served as it is, when it comes from the recipe's
    factory (same code; Dynamo guards on the tensor's metadata only), and refused otherwise."""
    graph = mod_graph(fn, kind) if fn is not None else None
    if graph is None or graph.reads_tensors:
        return [fn]
    return [fn, *(w for w in warmed.get(graph.key, ()) if w is not fn)]


def _mask_differs(coverage: Coverage) -> bool:
    return bool(coverage.nearest) and "mask" in [d[0] for d in coverage.nearest[0].differences]


def _mask_detail(active: Activation, coverage: Coverage, arguments: Mapping[str, Any]) -> str:
    """For a refusal whose nearest covered signature differs in its mask: which of the mask's values differ from the
    artifact's (``window: 2048 built, None here``), or that it runs other code; "" when that cannot be told."""
    manifest = active.manifest
    mask_mod = getattr(arguments.get("block_mask"), "mask_mod", None)
    if manifest is None or mask_mod is None or not _mask_differs(coverage):
        return ""
    built = next((c for c in manifest.configs if c.id == coverage.nearest[0].config_id), None)
    if built is None:
        return ""
    try:
        covered = mask_for(built.config, arguments["query"].device)
    except Exception:  # a courtesy: the refusal stands without it
        return ""
    diffs = functions.differences(covered, mask_mod, built.mask_free)
    if not diffs:
        return ""
    if diffs[0][0] == "code":
        return (
            f"the call's mask_mod is {diffs[0][2]}, the artifact's {diffs[0][1]}: other code is another graph (build "
            "the BlockMask with the function the recipe names)"
        )
    shown = "; ".join(f"{path}: {a} built, {b} here" for path, a, b in diffs[:4])
    more = f" (and {len(diffs) - 4} more)" if len(diffs) > 4 else ""
    return f"the call's mask closes over other values than the artifact's: {shown}{more}"


def _not_warmed(
    warm: Warmup, coverage: Coverage, arguments: dict[str, Any], active: Activation | None = None
) -> NotWarmedError:
    sig = coverage.signature
    warmed = sig  # what the warm-up knows it by: a dynamic range config's traced call
    if coverage.entry is not None and coverage.entry.config.q_range is not None:
        warmed = Manifest.traced(sig, coverage.entry)
    hint = (
        "make the call as the recipe declares it (its [call] layout, scale and flags; the BlockMask from the "
        "recipe's mask function; its score_mod), as the warm-up did (kernelpack.canonical); or activate(warmup=False), "
        "where no other thread runs backward while a first call compiles"
    )
    if coverage.entry is None:
        reason = "the artifact does not cover it; nearest covered:\n" + "\n".join(
            f"  {n.describe()}" for n in coverage.nearest
        )
        detail = _mask_detail(active, coverage, arguments) if active is not None else ""
        if detail:
            reason += "\n" + detail
        hint = (
            "add it to the recipe and rebuild; non-strict mode compiles uncovered calls only with "
            "activate(warmup=False), where no other thread runs backward while a first call compiles"
        )
        if coverage.only is not None and coverage.only[0] == "device_index":
            hint = DEVICE_HINT
        lengths = length_hint(coverage)
        if lengths:
            hint = f"{lengths}; non-strict mode compiles uncovered calls only with activate(warmup=False)"
    elif warmed in warm.skipped:
        reason = f"the artifact covers it, but activate() did not warm it: {warm.skipped[warmed]}"
    else:
        entry = warm.entries.get(warmed)
        failed = guard_failure(entry, arguments) if entry is not None else ""
        if warmed in warm.precompiled:  # tier 2 serves this signature: its guards, or kernelpack's code check, said no
            failed = warm.precompiled[warmed].guard_failure(arguments)
            if not _runs_warmed_code(warm, arguments):  # after what Dynamo says: its guard names the cause
                failed = (f"{failed}; " if failed else "") + (
                    "the mask_mod or score_mod runs other code than the warmed one's (Dynamo's identity guard on "
                    "the mask_mod's code object, which kernelpack checks for a precompiled function)"
                )
        reason = (
            "the artifact covers it and activate() warmed it, but this call differs from the warm-up's in what "
            "Dynamo guards on: " + (failed or "(torch does not say which guard)")
        )
        hint = guard_hint(failed, sig) or hint
    return NotWarmedError(sig.describe(), reason, hint=hint)


def guard_hint(failed: str, sig: CallSignature) -> str | None:
    """The fix for the guard a warmed call fails (Dynamo's words, :func:`kernelpack.compiled.guard_failure`): a
    tensor's strides or sizes (q, k, v laid out otherwise than the warm-up's, or a BlockMask's tables), the mask
    function's code, a pytree node type registered late, global state. None when none of these is named."""
    tensor = re.search(r"tensor '(.+?)' (stride|size|dtype|device|requires_grad)", failed)
    if tensor is not None:  # first: a tensor guard is what failed, whatever else a code check says
        source, what = tensor.group(1), tensor.group(2)
        name = re.search(r"\['(\w+)'\]", source)
        argument = name.group(1) if name else source
        if argument in ("query", "key", "value"):
            return (
                f"{argument}'s {what}s differ from the warm-up's, which Dynamo guards on (this call's layout: "
                f"{sig.layout}; a size-1 dim's stride counts, and with dynamic shapes a view is guarded through its "
                "base): pass q, k, v as the recipe's layout says (kernelpack.signature.layout_of names a tensor's), "
                "or record the job (kernelpack record) for the layouts it really passes and rebuild"
            )
        return (
            f"{source}'s {what} differs from the warm-up's, which Dynamo guards on: build the BlockMask as the "
            "recipe's (its mask_dims, block_size; kernelpack.masks.block_mask_for makes the warm-up's)"
        )
    if "mask_mod" in failed:
        return (
            "build the BlockMask from the recipe's mask function (kernelpack.masks.sliding_window(W), or the "
            "recipe's factory): another function object with other code is another Dynamo entry, even when it "
            "computes the same"
        )
    if "SUPPORTED_NODES" in failed:
        # kernelpack's own graphs do not keep this guard (_torch.dynamo.guard_filter): a precompiled function
        # of an older build does, or a graph traced outside kernelpack
        return (
            "a pytree node type was registered after activate() (importing a transformers model module "
            "registers its output classes), and this graph keeps Dynamo's guard on their count: an artifact "
            "built before kernelpack dropped that guard (2026-12-02). Rebuild the artifact, or import your model "
            "code before kernelpack.runtime.activate()"
        )
    if "GLOBAL_STATE" in failed or "dispatch" in failed.lower():
        return (
            "this call runs under other global torch state than the warm-up (autocast, deterministic "
            "algorithms, inference_mode, ...), which Dynamo guards on: make the flex call outside autocast and "
            "inference_mode (its inputs are already in the recipe's dtype), with the settings in force at "
            "activate()"
        )
    return None


def _first_call_at_the_gate(
    state: _State,
    active: Activation | None,
    fn: Callable[..., Any],
    mode: str,
    dynamic: bool,
    arguments: dict[str, Any],
) -> Any:
    """Without a warm-up: the first call of each signature runs alone at the gate, steady-state calls in parallel.
    A call inside a backward pass waits only briefly (KERNELPACK_BACKWARD_WAIT_SECONDS), then raises: the thread
    making a first call may be waiting for it (make_fx's ``torch.autograd.grad`` needs the autograd engine thread)."""
    import torch

    sig = _signature(mode, dynamic, arguments)
    coverage = None
    if active is not None and active.dynamic_modes and sig not in state.ready:
        coverage = active.covers(sig)
        if coverage.entry is not None and coverage.entry.config.q_range is not None:
            # a dynamic range config covers it: its one dynamic graph, whose first call is the config's
            sig = Manifest.traced(sig, coverage.entry)
            fn, dynamic = compiled_flex_attention(mode, True), True
    limit = settings.backward_wait_seconds() if in_backward() else None

    def steady() -> bool:
        if sig not in state.ready:
            return False
        if sig.dynamic and coverage is not None:
            # another length of a range whose first call was made: steady state only if Dynamo's guards pass
            # (else it would trace outside the gate)
            return serving_entry(arguments, mode, True) is not None
        return True

    if steady():
        with gate.shared(limit), evidence.tagged(_Call("kernelpack.flex_attention", sig)):
            wait_for_foreign_fx_trace(limit)
            return fn(**arguments)
    with gate.exclusive(limit):
        if steady():  # another thread made this first call while we waited
            with evidence.tagged(_Call("kernelpack.flex_attention", sig)):
                return fn(**arguments)
        config_id = None
        if active is not None:
            coverage = coverage or active.covers(sig)
            if coverage.entry is not None:
                config_id = coverage.entry.id
            elif active.strict:
                raise refusal(coverage, active.artifact)
            elif sig not in state.warned:
                state.warned.add(sig)
                warnings.warn(
                    f"kernelpack: {sig.describe()} is not in {active.artifact}; compiling it here (non-strict mode)",
                    stacklevel=4,
                )
        wait_for_foreign_fx_trace(limit)
        # a dynamic range config's first call traces with its marks (the builder's); in the builder, nothing is
        # active and compiled.marking gives them
        marks = coverage.entry.marks if coverage is not None and coverage.entry is not None else None
        with (
            _measured(_Call("kernelpack.flex_attention", sig)) as measured,
            trace_settings(dynamic, arguments, marks),
        ):
            out = fn(**arguments)
            if sig.device_index is not None:
                torch.cuda.synchronize(arguments["query"].device)
        state.first_calls.append(
            FirstCall(sig, config_id, threading.current_thread().name, measured.seconds, measured.counters)
        )
        state.ready.add(sig)
        return out


def refusal(coverage: Coverage, artifact: str | None, *, detail: str = "") -> NotPrecompiledError:
    """Strict mode's error for an uncovered call: the call, the nearest covered signatures with what differs, and
    the one field that differs when only one does (device index: pinning; graph: the recipe's graphs; a length: the
    covered range and the fix)."""
    return NotPrecompiledError(
        coverage.signature.describe(),
        [n.describe() for n in coverage.nearest],
        artifact=artifact,
        only=coverage.only,
        detail=detail,
        hint=length_hint(coverage),
    )


def length_hint(coverage: Coverage) -> str | None:
    """The fix for a call the nearest covered config misses only in its lengths: the covered range (or lengths) and
    the three ways to serve it. None when something else differs too."""
    if not coverage.nearest:
        return None
    diffs = coverage.nearest[0].differences
    if not diffs or any(name not in ("q_len", "kv_len") for name, _, _ in diffs):
        return None
    told = ", ".join(f"{name} {value} (covered: {covered})" for name, covered, value in diffs)
    near = coverage.nearest[0].signature
    blocks = {"q_len": near.block_size[0], "kv_len": near.block_size[1]}
    small = [(n, v) for n, covered, v in diffs if isinstance(covered, str) and ".." in covered and v <= blocks[n]]
    if small:
        # torch specializes a length of one block or less (its BlockMask has one block): no dynamic range can hold it
        name, value = small[0]
        key = "seq_len" if len(small) == 2 and small[0][1] == small[1][1] else name
        return (
            f"{told}: a {name} of one block ({blocks[name]}) or less is its own static graph, never part of a dynamic "
            f"range: add a [[calls]] table with {key} = {value} (or record a step at that length) and rebuild, or pad "
            "the batch into the range (kernelpack.runtime.padded_lengths)"
        )
    return (
        f"{told}: widen the range (kernelpack record --lengths MIN:MAX, or the recipe's {{ min, max }}) and rebuild, "
        "pad the batch to a covered length (kernelpack.runtime.padded_lengths), or add a bucket for it"
    )


# ------------------------------------------------------------------------------------------- what torch compiled


@dataclass(frozen=True, slots=True)
class _Call:
    """What kernelpack was doing in a thread (an :func:`evidence.tagged` tag): the code path and the call."""

    path: str
    signature: CallSignature | None  # None: a served call (its signature is computed only if torch compiles it)


_SERVED = _Call("kernelpack.flex_attention", None)
# the path of a precompiled function's load at its signature's first call and of that call (KERNELPACK_LOAD=lazy)
LOAD_PATH = "kernelpack load"


@dataclass(frozen=True, slots=True)
class Observed:
    """What the runtime makes of a compile torch reported (:class:`evidence.CompileRecord`'s ``note``): which code
    path made it, the flex_attention call when it is one, and how it differs from the nearest covered signature."""

    # "kernelpack warm-up", "kernelpack load", "kernelpack.flex_attention", "torch.compile(flex_attention)",
    # "other compiled code"
    path: str
    signature: CallSignature | None = None
    covered_by: str | None = None  # the artifact's config that covers the call
    nearest: str | None = None  # the nearest covered signature, described
    differences: tuple[tuple[str, Any, Any], ...] = ()  # (field, this call's value, the nearest covered value)


@dataclass(slots=True)
class _Measured:
    seconds: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def _measured(tag: _Call) -> Any:
    """Time a call and count what it compiled from torch's per-compile records of the compiles it made (tagged in
    this thread; a lazy backward compile on the autograd engine's thread carries its forward's tag), so that a
    compile another thread makes meanwhile is not charged to it. Where torch does not count per compile, the
    process-wide counter delta stands in."""
    measured = _Measured()
    mark = evidence.next_seq()
    before = evidence.snapshot()
    start = time.perf_counter()
    with evidence.tagged(tag):
        yield measured
    measured.seconds = time.perf_counter() - start
    delta = evidence.delta(before, evidence.snapshot())
    records = [r for r in evidence.compile_records(mark) if r.tag is tag]
    # no record: nothing compiled for this call (another thread's compiles meanwhile are not its own)
    if evidence.per_compile_counts() and all(r.fx_hits is not None for r in records):
        counters = {k: 0 for k in delta}
        for r in records:
            for k, v in r.counters.items():
                counters[k] += v
        counters["dense_calls"] = sum(1 for d in evidence.dense_records(mark) if d.tag is tag)
        # torch's per-compile metrics do not count AOTAutograd bypasses: from the process counters (first calls
        # are alone at the gate)
        counters["aot_autograd.autograd_cache_bypass"] = delta.get("aot_autograd.autograd_cache_bypass", 0)
        measured.counters = counters
    else:
        measured.counters = delta


def _observe(state: _State, record: evidence.CompileRecord, frame: Mapping[str, Any] | None) -> Observed:
    if isinstance(record.tag, _Call):
        sig: CallSignature | None = record.tag.signature
        if sig is None and _is_flex_call(frame):
            assert frame is not None
            sig = _signature_or_none(frame)
        path = record.tag.path
    elif isinstance(record.note, Observed):  # a lazy backward: its forward's
        return record.note
    elif _is_flex_call(frame):
        assert frame is not None
        sig, path = _signature_or_none(frame), "torch.compile(flex_attention)"
    elif "flex_attention.py" in record.code:
        # flex_attention called eagerly: torch runs it through torch.compile(backend="eager"), then the dense path
        return Observed("flex_attention (eager)")
    else:
        return Observed("other compiled code")
    if sig is None or state.active is None:
        return Observed(path, sig)
    coverage = state.active.covers(sig)
    if coverage.entry is not None:
        return Observed(path, sig, covered_by=coverage.entry.id)
    nearest = coverage.nearest[0] if coverage.nearest else None
    return Observed(
        path,
        sig,
        nearest=nearest.signature.describe() if nearest else None,
        differences=tuple((f, call, covered) for f, covered, call in nearest.differences) if nearest else (),
    )


def _is_flex_call(frame: Mapping[str, Any] | None) -> bool:
    return frame is not None and all(n in frame for n in ("query", "key", "value", "block_mask", "score_mod"))


def _signature_or_none(frame: Mapping[str, Any]) -> CallSignature | None:
    # the user's own torch.compile: its mode and dynamic are not in the frame; the defaults stand in. Its mask is
    # keyed as the artifact keys masks (a dynamic config's free values by type), so the report names the right miss
    try:
        return _signature("default", False, frame)
    except Exception:
        log.debug("no call signature for a compiled flex_attention frame", exc_info=True)
        return None


def _observed(record: evidence.CompileRecord, frame: Mapping[str, Any] | None) -> None:
    """Every compile torch makes after activate() (evidence's callback, in the compiling thread): attributed to
    its code path and call; one that compiled something outside kernelpack's own entry warns, once per call site.
    Observers see the user's own torch.compile(flex_attention) calls here, with or without activate()."""
    if _observers and record.forward and not isinstance(record.tag, _Call):
        if _is_flex_call(frame):
            _notify("torch.compile(flex_attention)", frame, "default", False)
        elif "flex_attention.py" in record.code:
            _notify("flex_attention (eager)", None, "default", False)
    state = _state
    if state.active is None or record.seq < state.since:
        return
    record.note = observed = _observe(state, record, frame)
    if not record.missed or observed.path.startswith("kernelpack"):
        return  # kernelpack's own first calls are in report().first_calls, and warn there
    where = record.site or record.code
    with state.lock:
        if where in state.warned_sites:
            return
        state.warned_sites.add(where)
    if observed.path == "other compiled code":
        tail = "kernelpack serves flex_attention only; kernelpack.runtime.report() lists every compile"
    else:
        tail = f"{state.active.artifact} does not serve it; kernelpack.runtime.report() lists every such compile"
    warnings.warn(f"kernelpack: {_miss_text(record, observed)}. {tail}", KernelpackWarning, stacklevel=2)


def _miss_text(record: evidence.CompileRecord, observed: Observed) -> str:
    what = evidence.compiled_anything(record.counters)
    text = f"{observed.path} compiled {record.code} at {record.site or 'an unknown site'} ({', '.join(what)})"
    if observed.signature is not None:
        text += f" for {observed.signature.describe()}"
        if observed.covered_by is not None:
            text += f", which config {observed.covered_by} covers (torch keyed it otherwise: kernelpack verify)"
        elif observed.differences:
            diffs = ", ".join(f"{f} {call!r} vs {covered!r}" for f, call, covered in observed.differences)
            text += f"; the nearest covered call differs in {diffs}"
    return text


def _refuse_foreign_compile(frame: Mapping[str, Any] | None) -> None:
    """Strict mode, as Dynamo starts compiling a flex_attention call outside kernelpack's entry (the user's own
    ``torch.compile(flex_attention)``): refuse an uncovered call before it compiles. Dynamo re-raises the error as
    ``InternalTorchDynamoError("NotPrecompiledError: ...")``. Best effort: torch runs this callback only for the
    first of compiles in flight at once; the rest are reported and warned of."""
    state = _state
    active = state.active
    if active is None or not active.strict or active.manifest is None or not _is_flex_call(frame):
        return
    assert frame is not None
    sig = _signature_or_none(frame)
    if sig is None:
        return
    # the user's torch.compile options are not in the frame: covered under any options the artifact was built with
    options = {(c.config.mode, c.config.dynamic) for c in active.manifest.configs}
    if any(active.covers(dataclasses.replace(sig, mode=m, dynamic=d)).covered for m, d in options):
        return
    coverage = active.covers(sig)
    with state.lock:
        state.refused.append((sig, "not covered by the artifact (strict mode; torch.compile(flex_attention))"))
    raise refusal(
        coverage,
        active.artifact,
        detail="made by torch.compile(flex_attention) outside kernelpack's entry: kernelpack.flex_attention takes "
        "the same arguments and refuses before Dynamo wraps the error",
    )


# ---------------------------------------------------------------------------------------------------- report


@dataclass(frozen=True, slots=True)
class RuntimeReport:
    """What this process compiled and ran since :func:`activate`. ``to_dict()`` is its JSON form (docs/REPORT.md)."""

    first_calls: list[FirstCall]  # the warm-up's, then the job's (without warm-up)
    refused: list[tuple[CallSignature, str]] = field(default_factory=list)  # calls refused, and why
    warmup_seconds: float | None = None  # what activate()'s warm-up took; None without one
    compiles: list[evidence.CompileRecord] = field(default_factory=list)  # every compile torch made, any code path
    dense: list[evidence.DenseRecord] = field(default_factory=list)  # every dense flex_attention call
    compile_detection: str = ""  # how compiles were seen (evidence.compile_detection)
    # after a warm-up, which warmed graph served which calls: (the warmed signature, its config, calls, the lengths
    # served as (q min, q max, kv min, kv max), the tier: "precompiled" or "inductor-cache")
    served: list[tuple[CallSignature, str | None, int, tuple[int, int, int, int], str]] = field(default_factory=list)
    # the warmed signatures the inductor cache serves (tier 1) rather than a precompiled function, and why
    tier1: list[tuple[CallSignature, str]] = field(default_factory=list)
    precompiled: int = 0  # warmed signatures served by precompiled functions (tier 2)
    # what this report cannot see, said rather than counted as 0: compiles torch counted before kernelpack watched,
    # kernels compiled in inductor's compile worker processes
    unseen: list[str] = field(default_factory=list)
    # why activate()'s start failed (a background start's install, imports, settings check or warm-up): every
    # guarded call raises it; None when it did not fail
    start_error: str | None = None

    @property
    def compiled(self) -> list[FirstCall]:
        """The first calls that compiled something."""
        return [c for c in self.first_calls if c.compiled]

    @property
    def misses(self) -> list[evidence.CompileRecord]:
        """Every compile that compiled something (a cache miss or a kernel), whatever code path made it."""
        return [r for r in self.compiles if r.missed]

    @property
    def first_call_seconds(self) -> float:
        return sum(c.seconds for c in self.first_calls)

    def summary(self) -> str:
        misses = self.misses
        kernels = sum(r.triton_compiled + r.cpp_compiled for r in self.compiles)
        fx = sum(r.fx_misses or 0 for r in self.compiles)
        aot = sum(r.aot_misses or 0 for r in self.compiles)
        text = (
            f"{len(misses)} of {len(self.compiles)} compiles missed ({fx} FX-graph misses, {aot} AOTAutograd misses, "
            f"{kernels} kernels compiled)"
        )
        if any(r.fx_hits is None for r in self.compiles):
            text += " [this torch does not count cache misses per compile]"
        outside = [r for r in misses if not _path(r).startswith("kernelpack")]
        if outside:
            paths = sorted({_path(r) for r in outside})
            text += f", {len(outside)} outside kernelpack's entry ({', '.join(paths)})"
        warm = sum(c.warmup for c in self.first_calls)
        text += f"; {len(self.first_calls)} first calls ({self.first_call_seconds:.2f} s"
        text += f", {warm} by the warm-up)" if warm else ")"
        if self.precompiled or self.tier1:
            text += f"; {self.precompiled} signatures precompiled, {len(self.tier1)} from the inductor cache"
        if self.dense:
            text += f"; {len(self.dense)} dense flex_attention calls"
        if self.refused:
            text += f"; {len(self.refused)} calls refused"
        if self.unseen:
            text += " [not seen here: " + "; ".join(self.unseen) + "]"
        if self.start_error:
            text += f"; activate()'s start FAILED: {self.start_error}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": REPORT_SCHEMA,
            "summary": self.summary(),
            "compile_detection": self.compile_detection,
            "warmup_seconds": self.warmup_seconds,
            "first_calls": [
                {
                    "call": c.signature.describe(),
                    "config": c.config_id,
                    "thread": c.thread,
                    "warmup": c.warmup,
                    "tier": c.tier,
                    "seconds": c.seconds,
                    "compiled": c.compiled,
                    "counters": {k: v for k, v in c.counters.items() if v},
                }
                for c in self.first_calls
            ],
            "compiles": [_compile_dict(r) for r in self.compiles],
            "dense": [{**evidence.fields_of(d), "path": _path(d)} for d in self.dense],
            "refused": [{"call": sig.describe(), "why": why} for sig, why in self.refused],
            "served": [
                {
                    "graph": sig.describe(),
                    "config": config_id,
                    "dynamic": sig.dynamic,
                    "calls": calls,
                    "q_len": [lens[0], lens[1]],
                    "kv_len": [lens[2], lens[3]],
                    "tier": tier,
                }
                for sig, config_id, calls, lens, tier in self.served
            ],
            "precompiled": self.precompiled,
            "inductor_cache_tier": [{"call": sig.describe(), "why": why} for sig, why in self.tier1],
            "unseen": list(self.unseen),
            "start_error": self.start_error,
        }


REPORT_SCHEMA = 2  # docs/REPORT.md; bumped when a key changes meaning or goes away


def _start_error(active: Activation | None, warm: Warmup | None) -> str | None:
    """Why the start failed: its warm-up, or its install (whose second part may fail after the warm-up)."""
    error = warm.error if warm is not None else None
    if error is None and active is not None and active.installing is not None:
        error = active.installing.error
    return f"{type(error).__name__}: {error}" if error is not None else None


def _path(record: evidence.CompileRecord | evidence.DenseRecord) -> str:
    if isinstance(record.tag, _Call):
        return record.tag.path
    note = getattr(record, "note", None)
    if isinstance(note, Observed):
        return note.path
    return "flex_attention (eager)" if isinstance(record, evidence.DenseRecord) else "other compiled code"


def _compile_dict(r: evidence.CompileRecord) -> dict[str, Any]:
    note = r.note if isinstance(r.note, Observed) else None
    signature = note.signature if note is not None else r.tag.signature if isinstance(r.tag, _Call) else None
    return {
        **evidence.fields_of(r),
        "missed": r.missed,
        "compiled": evidence.compiled_anything(r.counters),
        "path": _path(r),
        "call": signature.describe() if signature is not None else None,
        "covered_by": note.covered_by if note is not None else None,
        "nearest": note.nearest if note is not None else None,
        "differences": [
            {"field": f, "call": _jsonable(call), "covered": _jsonable(covered)}
            for f, call, covered in (note.differences if note is not None else ())
        ],
    }


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def _torch_counters() -> dict[str, int]:
    """torch's process-wide counters now; {} (all zero) while Dynamo is not imported: nothing has compiled, and
    importing it costs the job's start a second."""
    return evidence.snapshot() if dynamo_imported() else {}


def _unseen(state: _State, compiles: list[evidence.CompileRecord]) -> list[str]:
    """What torch counted or did that the per-compile records do not hold (see :attr:`RuntimeReport.unseen`)."""
    unseen = []
    if dynamo_imported():
        now = evidence.snapshot()
        for key, what, seen in (
            ("inductor.fxgraph_cache_miss", "FX-graph", sum(r.fx_misses or 0 for r in compiles)),
            ("aot_autograd.autograd_cache_miss", "AOTAutograd", sum(r.aot_misses or 0 for r in compiles)),
        ):
            n = now.get(key, 0) - state.counters_at.get(key, 0) - seen
            if n > 0:
                unseen.append(
                    f"torch counted {n} {what} cache misses that have no record here (compiled before kernelpack "
                    "watched: call activate() before the first compiled call)"
                )
    workers = compile_workers()
    if workers and "triton" in sys.modules:
        unseen.append(
            f"Triton kernels compiled in inductor's {workers} compile worker processes are not counted (their "
            "FX-graph misses are)"
        )
    return unseen


def report() -> RuntimeReport:
    """What this process compiled since :func:`activate`, from torch's own per-compile records, whatever code path
    made it (:mod:`evidence`); what each first call cost; what the warm-up took; which calls were refused. What it
    cannot see it says (:attr:`RuntimeReport.unseen`): it never reports 0 for a process that compiled."""
    evidence.ensure_watching()
    state = _state
    warm = state.active.warmup if state.active is not None else None
    if warm is not None and warm.background and warm.thread != threading.get_ident():
        # a background start's outcome belongs in the report: wait for it (bounded), raise nothing (the report
        # says what failed; the next guarded call raises it)
        warm.done.wait(settings.warmup_wait_seconds())
    since = state.since if state.active is not None else 0
    compiles = evidence.compile_records(since)
    for record in compiles:  # compiles made before the runtime saw them (watch installed late): attribute now
        if record.note is None and not isinstance(record.tag, _Call):
            record.note = _observe(state, record, None)
    active = state.active
    with state.lock:
        served = [
            (
                sig,
                c.id if active is not None and (c := active.covers(sig).entry) is not None else None,
                seen[0],
                (seen[1], seen[2], seen[3], seen[4]),
                tier,
            )
            for (sig, tier), seen in state.served.items()
        ]
        done = warm is not None and warm.done.is_set()
        tier1 = sorted(warm.tier1_why.items(), key=lambda x: x[0].describe()) if done and warm is not None else []
        if active is not None and active.installing is not None and warm is None:
            tier1 = [(sig, "activate(warmup=False) loads no precompiled function") for sig in active.covered]
        return RuntimeReport(
            list(state.first_calls),
            list(state.refused),
            warm.seconds if warm is not None and warm.done.is_set() else None,
            compiles,
            evidence.dense_records(since),
            evidence.compile_detection,
            served,
            tier1,
            len(warm.precompiled) if done and warm is not None else 0,
            _unseen(state, compiles),
            _start_error(active, warm if done else None),
        )


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
