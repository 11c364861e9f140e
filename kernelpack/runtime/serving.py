"""What serves a flex_attention call: one chain of servers, tried in order, each returning what runs the call or a
:class:`~.refusals.Rejection` saying why not; a call none serves is refused with the chain's rejections
(:func:`.refusals.refused`), never with reasons worked out again. (huggingface/kernels' ``resolver.py`` tries its
resolvers so, and ``variants.py`` turns the trace of rejected variants into its error.)

After activate()'s warm-up (:data:`WARMED`):

1. tier 2, the call as made: the precompiled function of its signature (loaded at its first call), if torch's
   remaining guards pass and its mask_mod and score_mod run the warmed functions' code (torch drops the identity
   guards from a saved function; the signature, which names what the functions compute, and the code check stand in);
2. tier 2 with the warmed mask_mod or score_mod of the same graph in place of the call's own;
3. a Dynamo entry the warm-up was served by, whose guards pass for the call: the static graphs first, then the
   artifact's dynamic range graphs (strict mode: only at lengths the artifact covers);
4. a warmed Dynamo entry, with the warmed mask_mod or score_mod of the same graph in place of the call's own.

Nothing in the chain traces: a call it does not serve is refused (a trace during training can deadlock against the
autograd engine). Without a warm-up (``activate(warmup=False)``, or no artifact) the chain is one server,
:func:`at_the_gate`: a signature's first call traces alone at the gate, later calls run side by side.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .. import evidence, functions, settings
from ..compiled import (
    apply_thread_config,
    compiled_flex_attention,
    dynamo_hit,
    gate,
    guard_failure,
    in_backward,
    serving_entry,
    trace_settings,
    wait_for_foreign_fx_trace,
)
from ..manifest import Manifest
from ..signature import CallSignature, mod_graph
from .attribution import LOAD_PATH, SERVED, Call, measure
from .calls import FlexCall
from .refusals import Rejection, refusal, refused
from .session import Activation, FirstCall, State, Warmup
from .warmup import precompiled_function


@dataclass(frozen=True, slots=True)
class Served:
    """What a server found for a call: how to run it, and what the report counts it under (the warmed signature,
    the tier)."""

    run: Callable[[], Any]
    signature: Any  # the warmed signature it runs as (a Dynamo entry, where the warm-up knows none)
    tier: str  # "precompiled" or "inductor-cache"


class Serving:
    """One call being served: the call, the activation serving it, and what its servers share (the call with the
    warmed mask_mod or score_mod of the same graph, made once and only if a server asks)."""

    __slots__ = ("_substitutes", "active", "call", "state", "warm")

    def __init__(self, state: State, active: Activation, warm: Warmup | None, call: FlexCall) -> None:
        self.state, self.active, self.warm, self.call = state, active, warm, call
        self._substitutes: list[FlexCall] | None = None

    @property
    def substitutes(self) -> list[FlexCall]:
        if self._substitutes is None:
            assert self.warm is not None
            self._substitutes = [self.call.replaced(a) for a in _substitutes(self.warm, self.call.arguments)]
        return self._substitutes


Server = Callable[[Serving], "Served | Rejection"]


def serve(state: State, active: Activation | None, call: FlexCall) -> Any:
    """The call, run by the first server of the chain that serves it; refused with the chain's rejections when none
    does. Run in the call's context (:meth:`FlexCall.context`: Dynamo's guards read grad mode)."""
    warm = active.warmup if active is not None else None
    chain: Sequence[Server] = WARMED if warm is not None else (at_the_gate,)
    serving = Serving(state, active, warm, call)  # type: ignore[arg-type]
    if warm is not None:
        warm.wait()
        # First: while another thread FX-traces, torch.fx has patched math.* and other autowrapped functions, which
        # Dynamo guards on by identity, so the guards would fail (and a compiled call would raise or run dense).
        wait_for_foreign_fx_trace(settings.backward_wait_seconds() if in_backward() else None)
    trace: list[Rejection] = []
    for server in chain:
        got = server(serving)
        if isinstance(got, Rejection):
            trace.append(got)
            continue
        if got.tier:
            _count_served(state, got.signature, call.lengths, got.tier)
        return got.run()
    assert active is not None  # at_the_gate serves every call without an activation
    error, why = refused(call, trace, active, warm)
    with state.lock:
        state.refused.append((call.signature, why))
    raise error


# ------------------------------------------------------------------------------------------------ tier 2


def tier2_as_made(s: Serving) -> Served | Rejection:
    """Tier 2: the precompiled function of the call's signature."""
    return _tier2(s, (s.call,), "tier 2 (the call as made)")


def tier2_warmed_mods(s: Serving) -> Served | Rejection:
    """Tier 2, with the warmed mask_mod or score_mod of the same graph in place of the call's own (its exact
    signature, which names what the functions compute, stands in for the identity guards torch dropped)."""
    warm = s.warm
    assert warm is not None
    if not (warm.precompiled or warm.lazy):
        return Rejection("tier 2 (warmed mods)", "none")
    return _tier2(s, s.substitutes, "tier 2 (warmed mods)")


def _tier2(s: Serving, candidates: Sequence[FlexCall], name: str) -> Served | Rejection:
    warm, active = s.warm, s.active
    assert warm is not None
    if not (warm.precompiled or warm.lazy):
        return Rejection(name, "none")
    first: Rejection | None = None
    for candidate in candidates:
        sig, found = candidate.resolve()
        loaded = precompiled_function(s.state, warm, active, sig)
        if loaded is None and found is not None and found[1] is not sig and candidate.mode in active.dynamic_modes:
            # a length of a dynamic range config's range (strict: in the range, by the manifest): its function,
            # traced at the range's middle, whose guards hold over the range (torch's checks run in serves())
            sig = found[1]
            loaded = precompiled_function(s.state, warm, active, sig)
        code_runs = loaded is not None and runs_warmed_code(warm, candidate.arguments)
        if loaded is not None and code_runs and loaded.serves(candidate.arguments):
            return Served(_tier2_runner(warm, loaded, sig, candidate), sig, "precompiled")
        if first is None:
            first = _tier2_rejection(name, warm, loaded, sig, candidate, code_runs)
    return first or Rejection(name, "none")


def _tier2_runner(warm: Warmup, loaded: Any, sig: CallSignature, call: FlexCall) -> Callable[[], Any]:
    def run() -> Any:
        if sig not in warm.unrun:
            with evidence.tagged(SERVED):
                return call.finish(loaded(call.arguments))
        # a lazily loaded function's first run: torch records it as a compile (cache hits only), which is the
        # load's, whichever thread or candidate makes it
        with evidence.tagged(Call(LOAD_PATH, sig)):
            out = loaded(call.arguments)
        warm.unrun.discard(sig)
        return call.finish(out)

    return run


def _tier2_rejection(
    name: str, warm: Warmup, loaded: Any, sig: CallSignature, call: FlexCall, code_runs: bool
) -> Rejection:
    if loaded is None:
        why = warm.skipped.get(sig)
        return Rejection(name, "not warmed", lambda: why) if why else Rejection(name, "none")
    arguments = call.arguments

    def failed() -> str:
        text = loaded.guard_failure(arguments)
        if not code_runs:  # after what Dynamo says: its guard names the cause
            text = (f"{text}; " if text else "") + (
                "the mask_mod or score_mod runs other code than the warmed one's (Dynamo's identity guard on "
                "the mask_mod's code object, which kernelpack checks for a precompiled function)"
            )
        return text

    return Rejection(name, "guards", failed)


def runs_warmed_code(warm: Warmup, arguments: Mapping[str, Any]) -> bool:
    """The call's mask_mod and score_mod run the code of warmed ones: what Dynamo's ID_MATCH guards on code objects
    checked, which torch drops from a saved function (the signature alone trusts a ``kernelpack_mask`` tag)."""
    mask_mod = getattr(arguments.get("block_mask"), "mask_mod", None)
    score_mod = arguments.get("score_mod")
    return all(fn is None or _runs_warmed(warm, fn) for fn in (mask_mod, score_mod))


def _runs_warmed(warm: Warmup, fn: Any) -> bool:
    try:
        if warm.runs_warmed.get(fn):
            return True
        remembered = True
    except TypeError:  # not weakly referable: walked at every call
        remembered = False
    # ``fn`` is a warmed function, or runs one's code: the same code objects throughout (a mask built by and_masks
    # or padded() of other masks); the values are the guards' (functions.same(values=False), by its one value)
    found = functions.code_shape(fn) in _warmed_shapes(warm)
    if found and remembered:
        warm.runs_warmed[fn] = True
    return found


def _warmed_shapes(warm: Warmup) -> frozenset[tuple[Any, ...]]:
    """The code shapes (:func:`kernelpack.functions.code_shape`) of the warmed mask_mods and score_mods, made again
    only when the warm-up added one (the warm-up keeps them alive, so the objects their shapes name stay theirs)."""
    mods = list(warm.mods)
    made = warm.mod_shapes
    if made is None or made[0] != len(mods):
        made = (len(mods), frozenset(functions.code_shape(w) for w in mods))
        warm.mod_shapes = made
    return made[1]


# ------------------------------------------------------------------------------------------------ tier 1


def dynamo_as_made(s: Serving) -> Served | Rejection:
    """Tier 1: a Dynamo entry the warm-up was served by, whose guards pass for the call (Dynamo's own guards decide:
    they see strides, grad mode, the mask function's code, ...)."""
    return _dynamo(s, (s.call,), "a warmed Dynamo entry (the call as made)", as_made=True)


def dynamo_warmed_mods(s: Serving) -> Served | Rejection:
    """Tier 1 with the warmed mask_mod or score_mod of the same graph (:func:`kernelpack.signature.mod_graph`,
    recorded once per function, never by FX tracing) in place of the call's own: Dynamo guards on the function's
    code object, so the user's own would be traced; the warmed one computes the same thing by construction (a mask
    over the same block tables)."""
    return _dynamo(s, s.substitutes, "a warmed Dynamo entry (warmed mods)", as_made=False)


def _dynamo(s: Serving, candidates: Sequence[FlexCall], name: str, *, as_made: bool) -> Served | Rejection:
    warm, active, call = s.warm, s.active, s.call
    assert warm is not None
    # Tier 1 runs through Dynamo: this thread's recompile limit matters from here (tier 2 never consults it)
    apply_thread_config()
    # the static graphs first (faster kernels), then the dynamic ones of the artifact's range configs
    options = [(call.mode, call.dynamic)]
    if not call.dynamic and call.mode in active.dynamic_modes:
        options.append((call.mode, True))
    beyond: CallSignature | None = None
    for mode, dynamic in options:
        for candidate in candidates:
            hit = dynamo_hit(candidate.arguments, warm.served_by, mode, dynamic)
            if hit and dynamic and active.strict and candidate.resolve(mode, True)[1] is None:
                # A dynamic graph's guards hold far beyond the recipe's range (no upper bound on a length, a
                # symbolic batch): strict mode serves only what the artifact covers. One signature per such call,
                # not per static one.
                beyond = candidate.resolve(mode, True)[0]
                continue
            if hit:
                fn = compiled_flex_attention(mode, dynamic)
                return Served(_dynamo_runner(fn, candidate), warm.by_entry.get(hit, hit), "inductor-cache")
    if beyond is not None:
        return Rejection(name, "range", lambda: f"{beyond.describe()} is outside the artifact's ranges")
    return _dynamo_rejection(name, warm, call) if as_made else Rejection(name, "none")


def _dynamo_runner(fn: Any, call: FlexCall) -> Callable[[], Any]:
    def run() -> Any:
        with evidence.tagged(SERVED):
            return call.run(fn)

    return run


def _dynamo_rejection(name: str, warm: Warmup, call: FlexCall) -> Rejection:
    """Why no warmed entry serves the call as made: the guard the entry warmed for its signature fails, or that
    signature was not warmed here."""
    found = call.resolve()[1]
    if found is None:
        return Rejection(name, "none")
    warmed = found[1]  # what the warm-up knows it by: a dynamic range config's traced call
    if warmed in warm.skipped:
        why = warm.skipped[warmed]
        return Rejection(name, "not warmed", lambda: why)
    entry = warm.entries.get(warmed)
    if entry is None:
        return Rejection(name, "none")
    arguments = call.arguments
    return Rejection(name, "guards", lambda: guard_failure(entry, arguments))


def _count_served(state: State, sig: Any, lengths: tuple[int, int], tier: str) -> None:
    """One served call, under the warmed signature and the tier that served it: which graph served which lengths
    (report)."""
    if not isinstance(sig, CallSignature):
        return
    q, kv = lengths
    with state.lock:
        seen = state.served.get((sig, tier))
        if seen is None:
            state.served[(sig, tier)] = [1, q, q, kv, kv]
        else:
            seen[0] += 1
            seen[1], seen[2], seen[3], seen[4] = min(seen[1], q), max(seen[2], q), min(seen[3], kv), max(seen[4], kv)


# the chain after activate()'s warm-up: tier 2 first (no Dynamo at all), the call as made before the warmed mods
WARMED: tuple[Server, ...] = (tier2_as_made, tier2_warmed_mods, dynamo_as_made, dynamo_warmed_mods)


# ------------------------------------------------------------------------------------------------ mods of one graph


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


# ------------------------------------------------------------------------------------------------ without a warm-up


def at_the_gate(s: Serving) -> Served | Rejection:
    """Without a warm-up: the first call of each signature runs alone at the gate, steady-state calls in parallel.
    A call inside a backward pass waits only briefly (KERNELPACK_BACKWARD_WAIT_SECONDS), then raises: the thread
    making a first call may be waiting for it (make_fx's ``torch.autograd.grad`` needs the autograd engine thread).
    Strict mode rejects a call the active artifact does not cover; non-strict mode compiles it, warning once."""
    state, active, call = s.state, s.active, s.call
    # Dynamo's recompile limit in this thread (kernelpack.compiled.raise_recompile_limit): here, where a call may
    # trace, not on tier 2's path, which never consults it
    apply_thread_config()
    sig, mode, dynamic = call.signature, call.mode, call.dynamic
    coverage = None
    if active is not None and sig not in state.ready:
        coverage = call.coverage(active)
        if coverage.entry is None and active.strict:
            return Rejection("a first call at the gate", "uncovered")
        if active.dynamic_modes and coverage.entry is not None and coverage.entry.config.q_range is not None:
            # a dynamic range config covers it: its one dynamic graph, whose first call is the config's
            sig, dynamic = Manifest.traced(sig, coverage.entry), True
    return Served(lambda: _first_call(state, active, call, sig, coverage, mode, dynamic), None, "")


def _first_call(
    state: State,
    active: Activation | None,
    call: FlexCall,
    sig: CallSignature,
    coverage: Any,
    mode: str,
    dynamic: bool,
) -> Any:
    import torch

    fn = compiled_flex_attention(mode, dynamic)
    limit = settings.backward_wait_seconds() if in_backward() else None

    def steady() -> bool:
        if sig not in state.ready:
            return False
        if sig.dynamic and coverage is not None:
            # another length of a range whose first call was made: steady state only if Dynamo's guards pass
            # (else it would trace outside the gate)
            return serving_entry(call.arguments, mode, True) is not None
        return True

    if steady():
        with gate.shared(limit), evidence.tagged(Call("kernelpack.flex_attention", sig)):
            wait_for_foreign_fx_trace(limit)
            return call.run(fn)
    with gate.exclusive(limit):
        if steady():  # another thread made this first call while we waited
            with evidence.tagged(Call("kernelpack.flex_attention", sig)):
                return call.run(fn)
        config_id = None
        if active is not None:
            coverage = coverage or call.coverage(active)
            if coverage.entry is not None:
                config_id = coverage.entry.id
            elif active.strict:
                raise refusal(coverage, active.artifact)
            elif sig not in state.warned:
                state.warned.add(sig)
                warnings.warn(
                    f"kernelpack: {sig.describe()} is not in {active.artifact}; compiling it here (non-strict mode)",
                    stacklevel=6,
                )
        wait_for_foreign_fx_trace(limit)
        # a dynamic range config's first call traces with its marks (the builder's); in the builder, nothing is
        # active and compiled.marking gives them
        marks = coverage.entry.marks if coverage is not None and coverage.entry is not None else None
        with (
            measure(Call("kernelpack.flex_attention", sig)) as measured,
            trace_settings(dynamic, call.arguments, marks),
        ):
            out = call.run(fn)
            if sig.device_index is not None:
                torch.cuda.synchronize(call.arguments["query"].device)
        state.first_calls.append(
            FirstCall(sig, config_id, threading.current_thread().name, measured.seconds, measured.counters)
        )
        state.ready.add(sig)
        return out
