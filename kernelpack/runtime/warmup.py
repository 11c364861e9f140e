"""The start's work after activate() returns, and the warm-up: the background start's thread (the install in parts,
torch's compiler imports, the checks), the warm-up's canonical call of every covered signature that must trace, and
tier 2: precompiled functions, loaded at the warm-up or at their signature's first call.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from .. import evidence, precompiled, settings
from .._imports import importing_alone
from .._torch.inductor import CONFIG_HINT, import_compiler, import_loader, inductor_torch_key, prefetch_vec_isa
from .._torch.inductor import read_as as torch_key_read_as
from .._torch.triton import prefetch_key as prefetch_triton_key
from ..canonical import arguments as canonical_arguments
from ..canonical import call as canonical_call
from ..canonical import grad_output, make_inputs
from ..compiled import (
    apply_thread_config,
    compiled_flex_attention,
    gate,
    key_settings_differences,
    serving_entry,
    trace_settings,
)
from ..errors import KernelpackError, KernelpackWarning, KeyMismatchError
from ..installer import Installing
from ..manifest import BuiltConfig, Manifest, owner
from ..masks import block_mask_for, mask_for, score_mod_for
from ..signature import CallSignature, mod_graph, score_mod_key
from .attribution import LOAD_PATH, Call, measure, record_first_call
from .session import Activation, State, Warmup

log = logging.getLogger(__name__)


def check_key_settings(manifest: Manifest, strict: bool, *, allow_mismatch: bool = False) -> None:
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


# What a background start imports in its thread while the job's threads wait before importing any of it (kernelpack.
# _imports.importing_alone says why): torch's compiler stack and the libraries it imports on the way
_COMPILER_STACK = ("torch", "triton", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "filelock", "numpy")


def start_in_background(state: State, activation: Activation, allow_mismatch: bool) -> None:
    """``activate(warmup="background")``'s thread (the default start): what activate() leaves to it, while the job
    builds its model: the install's files (hash, extract, marker), in a thread of their own that overlaps the imports
    (zstd and the writes release the GIL; the imports hold it), and what imports Dynamo and inductor (1.5-5 s of a
    job's start); then the warm-up, once both are done. The job's threads wait for these imports
    (:func:`kernelpack._imports.importing_alone`) and every guarded call for the warm-up; an error here is raised by
    each guarded call."""
    warm, manifest, installing = activation.warmup, activation.manifest, activation.installing
    assert warm is not None and manifest is not None and installing is not None
    warm.thread = threading.get_ident()
    with importing_alone(_COMPILER_STACK, settings.warmup_wait_seconds()):
        first_part, failed = threading.Event(), threading.Event()
        vec_isa: threading.Thread | None = None
        try:
            with _switching_often(settings.start_switch_interval()):
                # started inside the window: a thread the window's thread starts is not held at its imports; decided
                # here: the install's thread is exempt from the gate, and must import nothing of torch beside it
                split = tier2_unavailable() is None
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
                    check_key_settings(manifest, activation.strict, allow_mismatch=allow_mismatch)
                # the warm-up needs the files precompiled functions load; the inductor cache's own entries (tier 1) come
                # after, and the warm-up waits for them only before it traces (_warm_one)
                warm.timeline["checks"] = time.perf_counter()
                # what the first load (or trace) imports besides, while the install and Triton's key need no GIL: the
                # wait for them was idle (0.4 s of a Mistral job's start on an H100, docs/BENCHMARKS.md); and a CPU
                # function's first load checks the CPU's vector instruction sets in child processes, with the probes'
                # builds the first part installs: beside these imports, once they are there
                devices = {c.config.device for c in manifest.configs}
                if "cpu" in devices:
                    wanted = lambda: installing.error is None and not failed.is_set()  # noqa: E731
                    vec_isa = prefetch_vec_isa(first_part, wanted)
                import_loader(devices)
                warm.timeline["load_imports"] = time.perf_counter()
                first_part.wait()
                warm.timeline["first_part"] = time.perf_counter()
                if installing.error is not None:
                    installing.result(timeout=0)  # raises what the install raised
                if triton_key is not None:
                    triton_key.join(settings.warmup_wait_seconds())
                warm.timeline["triton_key"] = time.perf_counter()
                if vec_isa is not None:
                    # unbounded, as the load's own check would be: with a bound the warm-up's load could check beside
                    # it (prefetch_vec_isa says why it must not); a guarded call waits KERNELPACK_WARMUP_WAIT_SECONDS
                    vec_isa.join()
                    warm.timeline["vec_isa"] = time.perf_counter()
        except BaseException as e:
            # nothing of the start outlives it: a check left running would race whatever compiles next in this
            # process (another start's check, or the job's own torch.compile after this error)
            failed.set()
            first_part.set()
            if vec_isa is not None:
                vec_isa.join()
            warm.error = e
            warm.done.set()
            return
        warm_up(state, activation)


@contextlib.contextmanager
def _switching_often(interval: float) -> Iterator[None]:
    """Python's thread switch interval lowered to ``interval`` seconds for the block, then put back (unless something
    else changed it meanwhile). The start's imports want the GIL all the time, while Triton's key hashes libtriton.so
    beside them (and the install writes files, where it runs in a thread): each releases the GIL for every 1 MiB
    chunk and must win it back from the importing thread, which yields it only once per switch interval (5 ms by
    default). On an H100 at 5 ms the warm-up waited 0.18 s for the key after the loader's imports (0.4 s alone, and
    started before them); at 0.5 ms 0.06 s, and the first step ended 0.15 s sooner (docs/BENCHMARKS.md,
    2026-12-05, night). ``0`` (``KERNELPACK_START_SWITCH_INTERVAL=0``) leaves it alone."""
    previous = sys.getswitchinterval()
    if not 0 < interval < previous:
        yield
        return
    sys.setswitchinterval(interval)
    ours = sys.getswitchinterval()  # as Python stores it (whole microseconds)
    try:
        yield
    finally:
        if sys.getswitchinterval() == ours:
            sys.setswitchinterval(previous)


def _install_in_parts(installing: Installing, first_part: threading.Event, split: bool, in_child: bool) -> None:
    """The install's thread: first the files of the precompiled function the warm-up loads (the first config's, on
    its first device: a part of the artifact; with KERNELPACK_LOAD=eager every config's), which the warm-up waits
    for; every other part installs at the first call of a signature that needs it (:meth:`Installing.ensure`), or,
    with KERNELPACK_INSTALL=all, here after the first. Not ``split`` (tier 2 off): every part, first. The outcome
    is kept for :meth:`Installing.result` and report(), not raised here."""
    manifest = installing.manifest
    try:
        if split:
            pairs = manifest.pairs() if not settings.load_precompiled_lazily() else manifest.pairs()[:1]
            installing.start([owner(c.id, d) for c, d in pairs], everything=False, in_child=in_child)
        else:
            installing.start((), everything=True, in_child=in_child)
    finally:
        first_part.set()
    if split and installing.error is None and not settings.install_used_parts():
        try:
            installing.finish(in_child=in_child)
        except BaseException as e:  # the first guarded call or report() says it; a tier-1 warm-up raises it
            log.warning("kernelpack: installing %s failed: %s: %s", installing.artifact, type(e).__name__, e)


def warm_up(state: State, activation: Activation) -> None:
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
                        # once, by the first, here); the others load at their first call (precompiled_function)
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


def tier2_unavailable() -> str | None:
    """Why no call is served by a precompiled function in this process, or None."""
    if not settings.serve_precompiled():
        return "KERNELPACK_PRECOMPILED=0"
    return precompiled.load_unavailable()


def precompiled_function(
    state: State, warm: Warmup, activation: Activation, sig: CallSignature
) -> precompiled.Loaded | None:
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
        assert entry is not None and activation.cache_dir is not None and activation.installing is not None
        try:
            with measure(Call(LOAD_PATH, sig)) as measured:
                # its files first, if no call installed them yet (a part of the artifact: reads and writes files,
                # traces nothing)
                activation.installing.ensure(owner(built.id, sig.device_index or 0))
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
    record_first_call(state, sig, built.config.id, measured, warmup=False, tier="precompiled")
    return loaded


def _tier2_why(built: BuiltConfig, sig: CallSignature, mask_mod: Any, score_mod: Any) -> str | None:
    """Why a precompiled function cannot serve this signature here (the inductor cache serves it), or None."""
    why = tier2_unavailable()
    if why is None and built.precompiled_for(sig.device_index or 0, sig.graph) is None:
        why = built.not_precompiled or "the artifact has no precompiled function for it"
    for kind, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        read = precompiled.reads_globals(fn) if why is None else None
        if read:  # torch drops guards on globals from a saved function: the job could change the value unseen
            why = f"its {kind} reads the global {read}, whose guards torch drops from a precompiled function"
    return why


def _load_precompiled(
    state: State,
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
        with measure(Call("kernelpack warm-up", sig)) as measured:
            if activation.installing is not None:
                activation.installing.ensure(owner(built.id, sig.device_index or 0))
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
    record_first_call(state, sig, config.id, measured, warmup=True, tier="precompiled")
    return True


def _warm_one(state: State, warm: Warmup, built: BuiltConfig, sig: CallSignature, device: str, bm: Any) -> None:
    import torch

    active = state.active
    if active is not None and active.installing is not None:
        # its inductor-cache entries too (tier 1's parts): a trace reads them
        active.installing.ensure(owner(built.id, sig.device_index or 0), tier1=True)
    config = built.config
    inputs = make_inputs(config, device, sig.graph, random=False)
    dout = grad_output(inputs[0], random=False) if sig.graph == "fwd+bwd" else None
    # traced as the builder traced it: its marks symbolic, the rest static (the builder's cache entry)
    with gate.exclusive(), trace_settings(config.dynamic, canonical_arguments(config, inputs, bm), built.marks):
        with measure(Call("kernelpack warm-up", sig)) as measured:
            canonical_call(compiled_flex_attention(config.mode, config.dynamic), config, sig.graph, inputs, bm, dout)
            if config.device == "cuda":
                torch.cuda.synchronize(device)
        with torch.set_grad_enabled(sig.graph == "fwd+bwd"):
            # the entry Dynamo now serves this call from (None: none passes, it would trace again)
            warm.entries[sig] = serving_entry(canonical_arguments(config, inputs, bm), config.mode, config.dynamic)
    warm.signatures.add(sig)
    record_first_call(state, sig, config.id, measured, warmup=True, tier="inductor-cache")
