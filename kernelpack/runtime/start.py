"""Job start, every door: :func:`install` and :func:`install_from` (the artifact installed, this process pointed
at it), :func:`activate` (the same, plus the warm-up and the guard), :func:`deactivate`.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from .. import closures, evidence, settings
from .._torch.dynamo import compiled_already
from .._torch.dynamo import when_imported as when_dynamo_imported
from .._torch.inductor import key_settings_cheap
from ..compiled import ensure_recompile_limit, recompile_floor_for
from ..errors import KernelpackError, KernelpackWarning
from ..installer import Installing, InstallResult, begin_install, check_cache_dir, resolve_cache_dir
from ..masks import modules_for
from ..store import pull
from . import session
from . import warmup as _warmup
from .attribution import on_compile, refuse_foreign_compile, torch_counters
from .session import Activation, State, Warmup
from .warmup import check_key_settings

log = logging.getLogger(__name__)


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
    check_key_settings(result.manifest, strict=False)
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
    check_key_settings(result.manifest, strict=False)
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
    # when Dynamo is imported (now, if it is): importing it here would cost the job's start a second
    when_dynamo_imported(lambda: ensure_recompile_limit(floor))


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
        recording = Activation(artifact=None, strict=False)
        session.begin(State(active=recording, since=evidence.next_seq()))
        _register_integrations()
        log.warning("kernelpack record: activate() installs nothing and refuses nothing while the job is recorded")
        return recording
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
            # a bad value is refused here, not in the start's thread
            for read in (
                settings.install_in_process,
                settings.install_used_parts,
                settings.load_precompiled_lazily,
                settings.start_switch_interval,
            ):
                read()
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
            check_key_settings(installing.manifest, strict, allow_mismatch=allow_mismatch)
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
    state = State(active=activation, since=evidence.next_seq(), counters_at=torch_counters())
    session.begin(state)
    evidence.watch_compiles(on_compile, refuse_foreign_compile)
    _register_integrations()
    if activation.warmup is not None:
        if activation.warmup.background:
            # in a copy of this thread's context: from torch 2.13 an inductor config value the job set (CONFIG_HINT)
            # is a ContextVar override, which a new thread does not see (measured: CPU, torch 2.13 and 2.15;
            # 2.11's is process-wide), and the warm-up must read and compile under the job's settings
            threading.Thread(
                target=contextvars.copy_context().run,
                args=(_warmup.start_in_background, state, activation, allow_mismatch),
                name="kernelpack-warmup",
                daemon=True,
            ).start()
        else:
            _warmup.warm_up(state, activation)
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
    session.begin(State())
    evidence.set_refuse_dense(False)
