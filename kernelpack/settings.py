"""Every environment variable kernelpack reads, read at call time and validated in one place.

A bad value is a :class:`SettingError` naming the variable, its value and what is expected, never a bare
``ValueError`` from ``float()``. Nothing here is cached: a job (or a test) may change a variable between calls.

| variable                         | default                                   | used by                         |
|----------------------------------|-------------------------------------------|---------------------------------|
| ``KERNELPACK_ARTIFACT``          | none                                      | ``runtime.activate()``          |
| ``KERNELPACK_BACKWARD_WAIT_SECONDS`` | ``10``                                | the runtime guard, in backward  |
| ``KERNELPACK_DEBUG``             | ``0``                                     | the CLI (tracebacks)            |
| ``KERNELPACK_DOWNLOAD_DIR``      | ``$XDG_CACHE_HOME/kernelpack/downloads``  | registry pulls                  |
| ``KERNELPACK_FX_WAIT_SECONDS``   | ``300``                                   | the runtime guard               |
| ``KERNELPACK_INSTALL_LOCK``      | ``1``                                     | install (``0``: no node lock)   |
| ``KERNELPACK_INSTALL_PROCESS``   | ``1``                                     | install (``0``: in a thread)    |
| ``KERNELPACK_LOCK_TIMEOUT``      | ``600``                                   | every file lock                 |
| ``KERNELPACK_MAX_EXPANDED_BYTES``| ``68719476736`` (64 GiB)                  | reading artifacts               |
| ``KERNELPACK_START_SWITCH_INTERVAL`` | ``0.0005``                            | a background start's imports    |
| ``KERNELPACK_WARMUP_WAIT_SECONDS`` | ``900``                                 | calls during a background warm-up |
| ``KERNELPACK_WORKER_EVENTS``     | none (set by kernelpack for its workers)  | a worker's progress events      |

and the variables of others that kernelpack honours: ``LOCAL_RANK`` (torchrun), ``SOURCE_DATE_EPOCH``
(reproducible builds), ``XDG_CACHE_HOME``, ``CUDA_VISIBLE_DEVICES``, ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR`` (torch's own), ``PYTHONPATH`` (as build's workers will see it), ``GITHUB_STEP_SUMMARY``
(GitHub Actions: ``verify`` appends its table). Only :mod:`kernelpack.runtime` *sets* variables (at job start).
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import SettingError


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None  # an empty variable means unset, as in most shells' `VAR= cmd`


def _seconds(name: str, default: float, most: float | None = None) -> float:
    value = _get(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    most = _MAX_SECONDS if most is None else most
    if not 0 <= seconds <= most:  # refuses non-numbers, nan, negatives and inf (a wait of inf seconds is
        # an OverflowError in threading's waits, at every call)
        raise SettingError(name, value, f"a number of seconds from 0 to {most:.0f}")
    return seconds


_MAX_SECONDS = 365 * 24 * 3600.0


def _count(name: str, expected: str, *, hint: str | None = None) -> int | None:
    value = _get(name)
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()):
        raise SettingError(name, value, expected, hint=hint)
    return int(value)


def _flag(name: str, default: bool) -> bool:
    value = _get(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise SettingError(name, value, "0 or 1")
    return value == "1"


RECORD_MARKER = ".kernelpack-record"


def record_dir() -> Path | None:
    """KERNELPACK_RECORD_DIR: set by ``kernelpack record`` for the job it runs (each process writes the calls it
    makes there); None when the job is not being recorded. The directory must hold the marker record writes:
    activate() installs and refuses nothing while a job is recorded, so a variable left set outside record (an
    exported shell variable, a copied job environment) must not silently switch the guard off."""
    value = _get("KERNELPACK_RECORD_DIR")
    if not value:
        return None
    if not (Path(value) / RECORD_MARKER).is_file():
        raise SettingError(
            "KERNELPACK_RECORD_DIR",
            value,
            "the directory of a running `kernelpack record`",
            hint="unset KERNELPACK_RECORD_DIR: `kernelpack record -- CMD` sets it for the command it records (with "
            "it set, activate() would install nothing and refuse nothing)",
        )
    return Path(value)


def record_compute() -> str:
    """KERNELPACK_RECORD_COMPUTE: how a recorded job's flex_attention calls run (``kernelpack record --compute``)."""
    return _get("KERNELPACK_RECORD_COMPUTE") or "skip"


def record_factories() -> dict[str, dict[str, str]]:
    """KERNELPACK_RECORD_FACTORIES: the factories ``kernelpack record --mask-factory/--score-factory`` names, as
    JSON ``{"mask": {qualname: "pkg.mod:factory"}, "score": {...}}``."""
    import json

    value = _get("KERNELPACK_RECORD_FACTORIES")
    try:
        parsed = json.loads(value) if value else {}
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict) or set(parsed) - {"mask", "score"}:
        raise SettingError(
            "KERNELPACK_RECORD_FACTORIES", value or "", "a JSON object of 'mask' and 'score' tables (set by record)"
        )
    return parsed


def default_artifact() -> str | None:
    """``KERNELPACK_ARTIFACT``: the artifact ``activate()`` installs when given none."""
    return _get("KERNELPACK_ARTIFACT")


def backward_wait_seconds() -> float:
    """``KERNELPACK_BACKWARD_WAIT_SECONDS``: how long a guarded call made inside a backward pass (a checkpoint
    recompute) waits for another thread's first call or FX trace before raising: that thread may be waiting for this
    one (the autograd engine runs backward on one thread per device)."""
    return _seconds("KERNELPACK_BACKWARD_WAIT_SECONDS", 10.0)


def debug() -> bool:
    """``KERNELPACK_DEBUG=1``: the CLI shows tracebacks, like ``-v``."""
    return _get("KERNELPACK_DEBUG") == "1"


def download_dir() -> Path:
    """Node-local download cache: ``$KERNELPACK_DOWNLOAD_DIR``, else ``$XDG_CACHE_HOME/kernelpack/downloads``."""
    explicit = _get("KERNELPACK_DOWNLOAD_DIR")
    if explicit is not None:
        return Path(explicit)
    base = _get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "kernelpack", "downloads")


def fx_wait_seconds() -> float:
    """``KERNELPACK_FX_WAIT_SECONDS``: how long a guarded call waits out another thread's FX trace."""
    return _seconds("KERNELPACK_FX_WAIT_SECONDS", 300.0)


def install_lock() -> bool:
    """``KERNELPACK_INSTALL_LOCK=0`` turns the node-wide install lock off (it only saves work)."""
    return _flag("KERNELPACK_INSTALL_LOCK", True)


def install_in_process() -> bool:
    """``KERNELPACK_INSTALL_PROCESS=0``: a background start writes the artifact's files in a thread of the job's
    process, not in a child process of its own (:func:`kernelpack.installer._extract_in_child` says why it does)."""
    return _flag("KERNELPACK_INSTALL_PROCESS", True)


def install_used_parts() -> bool:
    """``KERNELPACK_INSTALL``: ``used`` (the default): a background start installs the files of the signature its
    warm-up loads, and each other signature's files at its first call (a part of the artifact: its kernels and
    generated code, not the inductor cache's own entries unless the signature is traced): install time and disk
    grow with what the job calls, not with the artifact. ``all``: the start installs every part in the background,
    after the warm-up's."""
    raw = os.environ.get("KERNELPACK_INSTALL", "")
    value = raw.strip().lower() or "used"
    if value not in ("used", "all"):
        raise SettingError("KERNELPACK_INSTALL", raw, "used or all")
    return value == "used"


def serve_precompiled() -> bool:
    """``KERNELPACK_PRECOMPILED=0``: serve every call from the inductor cache (tier 1), loading no precompiled
    function (tier 2); the report says so for each call."""
    return _flag("KERNELPACK_PRECOMPILED", True)


def load_precompiled_lazily() -> bool:
    """``KERNELPACK_LOAD``: ``lazy`` (the default): activate()'s warm-up loads and calls one precompiled function
    (what every load imports and initializes is paid once, by the first), and each other one loads at its
    signature's first call (loading traces nothing, so any thread may, the autograd engine's included): start-up
    grows with what the job calls, not with the artifact. ``eager``: the warm-up loads and calls every
    one, and a signature whose function fails to load is served by the inductor cache (traced then) instead of
    refused at its first call."""
    raw = os.environ.get("KERNELPACK_LOAD", "")
    value = raw.strip().lower() or "lazy"
    if value not in ("lazy", "eager"):
        raise SettingError("KERNELPACK_LOAD", raw, "lazy or eager")
    return value == "lazy"


def precompile_at_build() -> bool:
    """``KERNELPACK_PRECOMPILE=0`` at build time: build tier 1 only (no aot-compiled functions in the artifact)."""
    return _flag("KERNELPACK_PRECOMPILE", True)


def lock_timeout() -> float:
    """``KERNELPACK_LOCK_TIMEOUT``: seconds any kernelpack file lock is waited for."""
    return _seconds("KERNELPACK_LOCK_TIMEOUT", 600.0)


def mask_chunk_elements() -> int:
    """KERNELPACK_MASK_CHUNK_ELEMENTS: how many (b, h, q, kv) points kernelpack's BlockMask builder evaluates the
    mask_mod over at once (default 2**24: 128 MiB per int64 intermediate)."""
    value = _count("KERNELPACK_MASK_CHUNK_ELEMENTS", "a positive number of elements")
    return 1 << 24 if not value else value


def max_expanded_bytes() -> int:
    """``KERNELPACK_MAX_EXPANDED_BYTES``: artifacts declaring more are refused (decompression-bomb cap)."""
    value = _count("KERNELPACK_MAX_EXPANDED_BYTES", "a byte count, e.g. 68719476736")
    return 64 << 30 if value is None else value


def warmup_wait_seconds() -> float:
    """``KERNELPACK_WARMUP_WAIT_SECONDS``: how long a guarded call waits for ``activate(warmup="background")``."""
    return _seconds("KERNELPACK_WARMUP_WAIT_SECONDS", 900.0)


def start_switch_interval() -> float:
    """``KERNELPACK_START_SWITCH_INTERVAL``: seconds of Python's thread switch interval (``sys.setswitchinterval``)
    while a background start imports torch's compiler beside the threads that hash Triton's key and write the
    install; ``0`` leaves the process's own (Python's default is 0.005). Restored when the imports are done."""
    # at most 1 s: Python takes up to ~4294 s, but anything near a second only starves the start's other threads
    return _seconds("KERNELPACK_START_SWITCH_INTERVAL", 0.0005, most=1.0)


def local_rank() -> int | None:
    """``LOCAL_RANK`` as torchrun sets it; None when unset."""
    return _count("LOCAL_RANK", "a rank (a non-negative integer)", hint="run under torchrun")


def source_date_epoch() -> int | None:
    """``SOURCE_DATE_EPOCH`` (reproducible-builds convention): fixes the build time, so rebuilds are identical."""
    return _count("SOURCE_DATE_EPOCH", "seconds since the epoch")


def cuda_visible_devices() -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list of entries (indices or UUIDs); None when unset."""
    value = _get("CUDA_VISIBLE_DEVICES")
    return None if value is None else [d.strip() for d in value.split(",") if d.strip()]


def inductor_cache_dir() -> Path | None:
    """``TORCHINDUCTOR_CACHE_DIR`` when set (absolute); None means torch's default."""
    value = _get("TORCHINDUCTOR_CACHE_DIR")
    return Path(value).absolute() if value is not None else None


def triton_cache_dir() -> Path | None:
    """``TRITON_CACHE_DIR`` when set (absolute): inductor puts Triton's files there instead of under its own dir."""
    value = _get("TRITON_CACHE_DIR")
    return Path(value).absolute() if value is not None else None


def worker_events() -> str | None:
    """The file a worker appends its progress events to (:func:`kernelpack._worker.emit`); set by its parent."""
    return _get("KERNELPACK_WORKER_EVENTS")


def worker_parent() -> str | None:
    """The pid of the process that started this worker (:func:`kernelpack._worker.child_main`); set by it."""
    return _get("KERNELPACK_WORKER_PARENT")


def github_step_summary() -> str | None:
    """GitHub Actions' job summary file, where ``kernelpack verify`` appends its per-config table."""
    return _get("GITHUB_STEP_SUMMARY")


def pythonpath() -> list[str]:
    """``PYTHONPATH`` as it is now (a job may set it after start): the entries build's workers will import from."""
    value = _get("PYTHONPATH")
    return [] if value is None else [p for p in value.split(os.pathsep) if p]
