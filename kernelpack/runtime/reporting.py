"""What this process compiled and ran since :func:`activate`: :func:`report` and its JSON form (docs/REPORT.md)."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from .. import evidence, settings
from .._torch.dynamo import imported as dynamo_imported
from .._torch.inductor import compile_workers
from ..signature import CallSignature
from . import session
from .attribution import Call, Observed, observe
from .session import Activation, FirstCall, State, Warmup


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
    if isinstance(record.tag, Call):
        return record.tag.path
    note = getattr(record, "note", None)
    if isinstance(note, Observed):
        return note.path
    return "flex_attention (eager)" if isinstance(record, evidence.DenseRecord) else "other compiled code"


def _compile_dict(r: evidence.CompileRecord) -> dict[str, Any]:
    note = r.note if isinstance(r.note, Observed) else None
    signature = note.signature if note is not None else r.tag.signature if isinstance(r.tag, Call) else None
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


def _unseen(state: State, compiles: list[evidence.CompileRecord]) -> list[str]:
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
    state = session.current()
    warm = state.active.warmup if state.active is not None else None
    if warm is not None and warm.background and warm.thread != threading.get_ident():
        # a background start's outcome belongs in the report: wait for it (bounded), raise nothing (the report
        # says what failed; the next guarded call raises it)
        warm.done.wait(settings.warmup_wait_seconds())
    since = state.since if state.active is not None else 0
    compiles = evidence.compile_records(since)
    for record in compiles:  # compiles made before the runtime saw them (watch installed late): attribute now
        if record.note is None and not isinstance(record.tag, Call):
            record.note = observe(state, record, None)
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
