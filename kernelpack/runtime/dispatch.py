"""The guarded entry: :data:`flex_attention` and :func:`guarded`. After a warm-up a call is served by a
precompiled function or a warmed Dynamo entry, or refused; without one, first calls run alone at the gate.
"""

from __future__ import annotations

import copy
import itertools
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

from .. import evidence, settings
from ..compiled import (
    apply_thread_config,
    compiled_flex_attention,
    dynamo_hit,
    gate,
    in_backward,
    serving_entry,
    trace_settings,
    wait_for_foreign_fx_trace,
)
from ..errors import KernelpackError
from ..manifest import Manifest
from ..signature import CallSignature, graph_of, mod_graph
from . import session
from .attribution import LOAD_PATH, SERVED, Call, measure, notify, observers
from .refusals import mask_detail, not_warmed, refusal, runs_warmed_code
from .session import Activation, FirstCall, State, Warmup, call_signature, resolve_call
from .warmup import precompiled_function


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

    active = session.current().active
    warm = active.warmup if active is not None else None
    if warm is not None and not warm.done.is_set():
        # a background start first: a thread started after activate() is not held at its imports, and this path
        # imports parts of torch (kernelpack._imports.importing_alone)
        warm.wait()
    evidence.ensure_watching()
    query = arguments["query"]
    if isinstance(query, torch.fx.Proxy):  # this thread is FX-tracing us: torch decides (raise or inline)
        apply_thread_config()
        return compiled_flex_attention(mode, dynamic)(**arguments)
    if observers:  # the call as the user made it (before the forward-only detach below)
        apply_thread_config()
        stand_in = notify("kernelpack.flex_attention", arguments, mode, dynamic)
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
    state = session.current()
    active = state.active
    if active is not None and active.warmup is not None:
        # the compiled callable only where tier 1 serves: creating the first one imports inductor (70 ms on CPU)
        return _serve(state, active, active.warmup, mode, dynamic, arguments)
    # Dynamo's recompile limit in this thread (kernelpack.compiled.raise_recompile_limit): here, where a call may
    # trace, not on tier 2's path, which never consults it
    apply_thread_config()
    return _first_call_at_the_gate(state, active, compiled_flex_attention(mode, dynamic), mode, dynamic, arguments)


def _closes_over_no_tensor(score_mod: Callable[..., Any] | None) -> bool:
    if score_mod is None:
        return True
    graph = mod_graph(score_mod, "score")
    return graph is not None and not graph.reads_tensors


def _serve(
    state: State,
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
    # First: while another thread FX-traces, torch.fx has patched math.* and other autowrapped functions, which
    # Dynamo guards on by identity, so the guards would fail (and a compiled call would raise or run dense).
    wait_for_foreign_fx_trace(settings.backward_wait_seconds() if in_backward() else None)
    if warm.precompiled or warm.lazy:
        # The call as it is, then with the warmed mask_mod/score_mod of the same graph in place of its own (as tier 1
        # serves it): its exact signature, which names what those functions compute, stands in for the identity
        # guards torch dropped; torch's remaining guards run in serves().
        # the substitutes only when the call as it is is not served (each names its mask by graph: a recording)
        for candidate in itertools.chain((arguments,), _substitutes(warm, arguments)):
            sig, found = resolve_call(mode, dynamic, candidate)
            loaded = precompiled_function(state, warm, active, sig)
            if loaded is None and found is not None and found[1] is not sig and mode in active.dynamic_modes:
                # a length of a dynamic range config's range (strict: in the range, by the manifest): its function,
                # traced at the range's middle, whose guards hold over the range (torch's checks run in serves())
                sig = found[1]
                loaded = precompiled_function(state, warm, active, sig)
            if loaded is not None and runs_warmed_code(warm, candidate) and loaded.serves(candidate):
                _count_served(state, sig, arguments, "precompiled")
                if sig not in warm.unrun:
                    with evidence.tagged(SERVED):
                        return loaded(candidate)
                # a lazily loaded function's first run: torch records it as a compile (cache hits only), which is
                # the load's, whichever thread or candidate makes it
                with evidence.tagged(Call(LOAD_PATH, sig)):
                    out = loaded(candidate)
                warm.unrun.discard(sig)
                return out
    # Tier 1 runs through Dynamo: this thread's recompile limit matters from here (tier 2 never consults it)
    apply_thread_config()
    # the static graphs first (faster kernels), then the dynamic ones of the artifact's range configs
    options = [(mode, dynamic)] + ([(mode, True)] if not dynamic and mode in active.dynamic_modes else [])
    for m, d in options:
        hit = dynamo_hit(arguments, warm.served_by, m, d)
        if hit and d and active.strict and active.covers(call_signature(m, d, arguments)).entry is None:
            # A dynamic graph's guards hold far beyond the recipe's range (no upper bound on a length, a symbolic
            # batch): strict mode serves only what the artifact covers. One signature per such call, not per
            # static one.
            hit = False
        if hit:
            _count_served(state, warm.by_entry.get(hit, hit), arguments, "inductor-cache")
            with evidence.tagged(SERVED):
                return compiled_flex_attention(m, d)(**arguments)
    for m, d in options:
        same = _with_warmed_mods(warm, arguments, m, d)
        if same is not None and d and active.strict and active.covers(call_signature(m, d, same[0])).entry is None:
            same = None
        if same is not None:
            candidate, entry = same
            _count_served(state, warm.by_entry.get(entry, entry), arguments, "inductor-cache")
            with evidence.tagged(SERVED):
                return compiled_flex_attention(m, d)(**candidate)
    sig = call_signature(mode, dynamic, arguments)
    coverage = active.covers(sig)
    error: KernelpackError
    if coverage.entry is None and active.strict:
        error = refusal(coverage, active.artifact, detail=mask_detail(active, coverage, arguments))
        why = "not covered by the artifact (strict mode)"
    else:
        error = not_warmed(warm, coverage, arguments, active)
        why = error.reason.splitlines()[0]
    with state.lock:
        state.refused.append((sig, why))
    raise error


def _count_served(state: State, sig: Any, arguments: Mapping[str, Any], tier: str) -> None:
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


def _first_call_at_the_gate(
    state: State,
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

    sig = call_signature(mode, dynamic, arguments)
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
        with gate.shared(limit), evidence.tagged(Call("kernelpack.flex_attention", sig)):
            wait_for_foreign_fx_trace(limit)
            return fn(**arguments)
    with gate.exclusive(limit):
        if steady():  # another thread made this first call while we waited
            with evidence.tagged(Call("kernelpack.flex_attention", sig)):
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
            measure(Call("kernelpack.flex_attention", sig)) as measured,
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
