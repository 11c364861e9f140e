"""The activation's state: what :func:`activate` started (its artifact, install and warm-up), and the first
calls and refusals seen since. The other runtime modules read it through :func:`current`; only :func:`begin`
replaces it.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import evidence, precompiled, settings
from ..compiled import in_backward
from ..config import Config
from ..errors import KernelpackError
from ..installer import Installing, InstallResult
from ..manifest import BuiltConfig, Coverage, Manifest
from ..signature import CallSignature


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
        self.mods: list[Any] = []  # every warmed mask_mod and score_mod: the code tier 2 may run (runs_warmed_code)
        # the functions found to run a warmed one's code, by object: a mask rebuilt every step is walked once, not at
        # its forward and again at its checkpointed recompute (a positive answer holds as mods grows)
        self.runs_warmed: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self.mod_shapes: tuple[int, frozenset[tuple[Any, ...]]] | None = None  # (len(mods), their code shapes)
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
class State:
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


_current = State()


def current() -> State:
    """The activation in force (a fresh :class:`State` before any :func:`activate`)."""
    return _current


def begin(state: State) -> None:
    """Make ``state`` the activation in force: :func:`activate` once it has succeeded, :func:`deactivate`."""
    global _current
    _current = state


def active() -> Activation | None:
    """The activation in force (what :func:`kernelpack.runtime.activate` returned), or None: what an integration
    reads to pick the entry for the artifact's compile options."""
    return _current.active


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
    active = current().active
    manifest = active.manifest if active is not None else None
    if manifest is None:
        raise KernelpackError(
            "padded_length() reads the buckets of the active artifact, and none is active",
            hint="call kernelpack.runtime.activate(artifact) first, or ask the Manifest: "
            "kernelpack.artifact.read_manifest(path).padded_lengths(q_len, kv_len)",
        )
    return manifest.padded_lengths(q_len, kv_len, tied=tied, where=where)
