"""What torch compiled, and for whom: every compile is attributed to the code path and the call that made it
(the tag kernelpack's own paths set, :class:`Call`), first calls are measured from torch's per-compile records, and
observers (``kernelpack record``) see every flex_attention call of the three paths.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import evidence
from .._torch.dynamo import imported as dynamo_imported
from ..errors import KernelpackWarning
from ..signature import CallSignature
from . import session
from .calls import FlexCall, frame_call
from .refusals import refusal
from .session import FirstCall, State

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Call:
    """What kernelpack was doing in a thread (an :func:`evidence.tagged` tag): the code path and the call."""

    path: str
    signature: CallSignature | None  # None: a served call (its signature is computed only if torch compiles it)


SERVED = Call("kernelpack.flex_attention", None)


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
class Measured:
    seconds: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def measure(tag: Call) -> Any:
    """Time a call and count what it compiled from torch's per-compile records of the compiles it made (tagged in
    this thread; a lazy backward compile on the autograd engine's thread carries its forward's tag), so that a
    compile another thread makes meanwhile is not charged to it. Where torch does not count per compile, the
    process-wide counter delta stands in."""
    measured = Measured()
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


def record_first_call(
    state: State, sig: CallSignature, config_id: str | None, measured: Measured, *, warmup: bool, tier: str
) -> None:
    """A first call made in this thread: the warm-up's, a lazy load's, or one at the gate."""
    with state.lock:
        state.first_calls.append(
            FirstCall(
                sig, config_id, threading.current_thread().name, measured.seconds, measured.counters, warmup, tier
            )
        )


# Called with (path, arguments, mode, dynamic) for every flex_attention call (arguments None for an eager call, which
# torch does not hand over); may return a function that makes the call's outputs instead (record's stand-in).
CallObserver = Callable[[str, "Mapping[str, Any] | None", str, bool], "Callable[[Mapping[str, Any]], Any] | None"]


observers: list[CallObserver] = []


observers_lock = threading.Lock()


@contextlib.contextmanager
def observe_calls(observer: CallObserver) -> Any:
    """Call ``observer`` for every flex_attention call made while the block runs, in the thread that makes it:
    calls through :data:`flex_attention` (and :func:`guarded`) as they are made, calls of the user's own
    ``torch.compile(flex_attention)`` as Dynamo compiles them (with the defaults for their compile options, which
    are not in the frame), eager calls as ``"flex_attention (eager)"`` with no arguments. Works with or without
    :func:`activate`."""
    evidence.install_hooks()
    evidence.watch_compiles(on_compile, refuse_foreign_compile)
    with observers_lock:
        observers.append(observer)
    try:
        yield observer
    finally:
        with observers_lock:
            observers.remove(observer)


def notify(path: str, arguments: Mapping[str, Any] | None, mode: str, dynamic: bool) -> Any:
    stand_in = None
    for observer in list(observers):
        stand_in = observer(path, arguments, mode, dynamic) or stand_in
    return stand_in


def observe(state: State, record: evidence.CompileRecord, frame: Mapping[str, Any] | None) -> Observed:
    call = _frame_call(frame)
    if isinstance(record.tag, Call):
        sig: CallSignature | None = record.tag.signature
        if sig is None and call is not None:
            sig = _signature_or_none(call)
        path = record.tag.path
    elif isinstance(record.note, Observed):  # a lazy backward: its forward's
        return record.note
    elif call is not None:
        sig, path = _signature_or_none(call), "torch.compile(flex_attention)"
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


def _frame_call(frame: Mapping[str, Any] | None) -> FlexCall | None:
    """The flex_attention call a compiled frame makes, or None (another frame, or one kernelpack cannot read)."""
    if frame is None:
        return None
    try:
        return frame_call(frame)
    except Exception:
        log.debug("no call for a compiled flex_attention frame", exc_info=True)
        return None


def _signature_or_none(call: FlexCall) -> CallSignature | None:
    # the user's own torch.compile: its mode and dynamic are not in the frame; the defaults stand in. Its mask is
    # keyed as the artifact keys masks (a dynamic config's free values by type), so the report names the right miss
    try:
        return call.signature
    except Exception:
        log.debug("no call signature for a compiled flex_attention frame", exc_info=True)
        return None


def on_compile(record: evidence.CompileRecord, frame: Mapping[str, Any] | None) -> None:
    """Every compile torch makes after activate() (evidence's callback, in the compiling thread): attributed to
    its code path and call; one that compiled something outside kernelpack's own entry warns, once per call site.
    Observers see the user's own torch.compile(flex_attention) calls here, with or without activate()."""
    if observers and record.forward and not isinstance(record.tag, Call):
        if _frame_call(frame) is not None:
            notify("torch.compile(flex_attention)", frame, "default", False)
        elif "flex_attention.py" in record.code:
            notify("flex_attention (eager)", None, "default", False)
    state = session.current()
    if state.active is None or record.seq < state.since:
        return
    record.note = observed = observe(state, record, frame)
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


def refuse_foreign_compile(frame: Mapping[str, Any] | None) -> None:
    """As Dynamo starts compiling a flex_attention call outside kernelpack's entry (the user's own
    ``torch.compile(flex_attention)``): install every part of the artifact (that compile reads the inductor cache),
    then, in strict mode, refuse an uncovered call before it compiles. Dynamo re-raises the error as
    ``InternalTorchDynamoError("NotPrecompiledError: ...")``. Best effort: torch runs this callback only for the
    first of compiles in flight at once; the rest are reported and warned of."""
    state = session.current()
    active = state.active
    call = _frame_call(frame)
    if active is None or active.manifest is None or call is None:
        return
    installing = active.installing
    if installing is not None and not installing.complete:
        # The user's own compile reads the inductor cache (tier 1: its FX-graph and AOTAutograd entries, and the
        # kernels they name), which a start installs only for the signatures kernelpack's entry calls: the whole
        # artifact is installed here, in the compiling thread, before Dynamo looks up the entry. A failure leaves the
        # compile to miss, which the report shows; the start's own error is what guarded calls raise.
        try:
            installing.finish()
        except Exception as e:
            log.warning("kernelpack: installing %s for torch.compile(flex_attention) failed: %s", active.artifact, e)
    if not active.strict:
        return
    sig = _signature_or_none(call)
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


def torch_counters() -> dict[str, int]:
    """torch's process-wide counters now; {} (all zero) while Dynamo is not imported: nothing has compiled, and
    importing it costs the job's start a second."""
    return evidence.snapshot() if dynamo_imported() else {}
