"""``kernelpack record`` and ``kernelpack.recording``: the recipe of the calls a job really makes.

A :class:`Recorder` observes every flex_attention call (:func:`kernelpack.runtime.observe_calls`): through
``kernelpack.flex_attention`` and the transformers integration as they are made, through the user's own
``torch.compile(flex_attention)`` as Dynamo compiles them. It keeps one entry per distinct call, with the graphs it
needs (``fwd`` under no_grad or with no input requiring grad, ``fwd+bwd`` when autograd records it: reentrant
checkpointing needs both), its compile options and the device indices it ran on, and names the mask and score_mod
so that the builder can make them again: kernelpack's built-in masks by name, any other function by
``module:qualname`` and its closure values (:mod:`kernelpack.closures`), or by a factory the user names. What cannot
be named so (a mask over a tensor, a function of the script itself) is a problem: the recipe is not written, and the
error says what to write instead, with a template.

Record needs the calls, not the kernels: with ``compute="skip"`` (the default) a call through kernelpack's entry
returns zeros of the right shapes and dtypes (gradients too) instead of compiling or running attention, so a
recorded step compiles nothing and allocates no score matrix. The job's numbers are then meaningless (record one or
two steps); a job whose control flow depends on attention's values records with ``compute="compile"``, which makes
the real calls (compiling them, as torch would). The user's own ``torch.compile(flex_attention)`` always compiles:
Dynamo hands over its call only as it compiles it.

:func:`recording` records in-process and writes the recipe when the block ends. ``kernelpack record -- CMD`` runs a
command with :func:`start_from_env` hooked into every Python process it starts (``sitecustomize``), each process
appending its calls to a file of ``KERNELPACK_RECORD_DIR``; :func:`recipe_text` merges them into one recipe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from . import _toml as _toml_writer
from . import closures, evidence, runtime, settings
from ._fs import check_replaceable, write_bytes
from .errors import ConfigError, KernelpackError, RecipeError
from .recipe import BUILTIN_MASKS, SCORE_MODS, Config, Recipe, check_name, parse_recipe
from .signature import DEFAULT_BLOCK_SIZE, GRAPHS, CallSignature, signature_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

COMPUTE = ("skip", "compile")


class RecordError(KernelpackError):
    """Recording found calls it cannot write as a recipe, or none at all."""


@dataclasses.dataclass(frozen=True, slots=True)
class Factories:
    """Factories the user names for functions record cannot name by reference (``--mask-factory``): qualname (or
    module:qualname) -> "pkg.module:factory"."""

    mask: Mapping[str, str] = dataclasses.field(default_factory=dict)
    score: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def lookup(self, fn: Any, kind: str) -> str | None:
        table = self.mask if kind == "mask" else self.score
        qualname = getattr(fn, "__qualname__", None)
        return table.get(f"{getattr(fn, '__module__', '')}:{qualname}") or table.get(str(qualname))


class Recorder:
    """A call observer (:data:`kernelpack.runtime.CallObserver`) that keeps the distinct calls it sees as events
    (JSON-able dicts): ``{"call": ...}``, ``{"problem": ...}``, ``{"note": ...}``. With ``sink``, each event is also
    appended to that file as a JSON line as it happens (a job killed later keeps what it recorded)."""

    def __init__(self, compute: str = "skip", *, sink: Path | None = None, factories: Factories | None = None) -> None:
        if compute not in COMPUTE:
            raise KernelpackError(f"record: compute={compute!r}", hint=f"one of {', '.join(COMPUTE)}")
        self.compute = compute
        self.sink = sink
        self.factories = factories or Factories()
        self.events: list[dict[str, Any]] = []
        self._seen: set[CallSignature] = set()
        self._notes: set[str] = set()
        self._compiled_shapes: set[tuple[int, int, int]] = set()  # met by the user's own torch.compile
        self._lock = threading.Lock()
        self.stopped = False  # a process that outlived `kernelpack record`: nothing is recorded or stood in for

    def _stop(self, why: str) -> None:
        """Recording must never raise into the job: a process of the command that outlives record (a detached
        child, a straggling rank) finds record's directory gone."""
        if not self.stopped:
            self.stopped, self.sink = True, None
            print(f"kernelpack record: stopped recording this process ({why})", file=sys.stderr)

    def __call__(self, path: str, arguments: Mapping[str, Any] | None, mode: str, dynamic: bool) -> Any:
        if self.sink is not None and not self.sink.parent.is_dir():
            self._stop("its directory is gone: `kernelpack record` has ended")
        if self.stopped:  # the call runs for real: zeros would be silently wrong results now
            return None
        stand_in = _stand_in if self.compute == "skip" and path == "kernelpack.flex_attention" else None
        if arguments is None:
            self._note(
                f"an eager flex_attention call at {evidence.user_site() or 'an unknown site'} ran the dense math "
                "path: no artifact can serve it; call kernelpack.flex_attention (or torch.compile it)"
            )
            return None
        try:
            sig = signature_of(arguments, mode, dynamic)
        except Exception as e:  # a call record cannot read: say so, never break the job
            self._note(f"a flex_attention call kernelpack could not read ({type(e).__name__}: {e})")
            return stand_in
        with self._lock:
            if sig in self._seen:
                return stand_in
            self._seen.add(sig)
        try:
            event = _event(sig, arguments, path, evidence.user_site(), self.factories)
        except Exception as e:  # record must neither break the job nor lose a call without saying so
            event = {
                "problem": {
                    "call_signature": sig.describe(),
                    "path": path,
                    "site": evidence.user_site(),
                    "reason": f"kernelpack could not record this call: {type(e).__name__}: {e}",
                    "hint": "run with KERNELPACK_DEBUG=1 for the traceback, and report it",
                }
            }
        self._add(event)
        if path == "torch.compile(flex_attention)":
            self._automatic_dynamic(sig)
        return stand_in

    def _automatic_dynamic(self, sig: CallSignature) -> None:
        """The user's own torch.compile(flex_attention) meeting a second shape: with torch.compile's default
        ``dynamic=None``, Dynamo compiles that one as a dynamic graph (automatic dynamic shapes), which the recorded
        static configs do not serve. Its options are not in the frame, so record says so rather than guess."""
        with self._lock:
            self._compiled_shapes.add((sig.batch, sig.q_len, sig.kv_len))
            several = len(self._compiled_shapes) > 1
        if several:
            self._note(
                "torch.compile(flex_attention) met several shapes: if it leaves dynamic at its default, torch compiles "
                "every shape after the first as a dynamic graph, which these static configs do not serve, and record "
                "sees no call that graph serves; call kernelpack.flex_attention instead (a transformers model, or "
                "SpecForge: kernelpack.integrations.transformers.register(takeover=True) in the job, also while it "
                "is recorded), then record again: one dynamic config serves every length"
            )

    def _note(self, text: str) -> None:
        with self._lock:
            if text in self._notes:
                return
            self._notes.add(text)
        self._add({"note": text})

    def _add(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.events.append(event)
            if self.sink is not None:
                try:
                    with open(self.sink, "a", encoding="utf-8") as f:
                        f.write(json.dumps(event) + "\n")
                except OSError as e:
                    self._stop(str(e))


@contextlib.contextmanager
def recording(
    path: str | os.PathLike[str],
    *,
    compute: str = "skip",
    name: str | None = None,
    factories: Factories | None = None,
    lengths: Lengths | str | None = None,
) -> Iterator[Recorder]:
    """Record every flex_attention call made inside the block (any thread) and write their recipe to ``path`` when
    it ends: ``with kernelpack.recording("recipe.toml"): train_one_step()``. Nothing is written when the block
    raises, or when a call cannot be written as a recipe (:class:`RecordError` says which and what to write
    instead). ``compute``: "skip" (calls through kernelpack's entry return zeros, compile nothing) or "compile".
    ``lengths``: the range to write for lengths that varied, ``"MIN:MAX[:MULTIPLE]"`` (see :func:`recipe_text`)."""
    lengths = Lengths.parse(lengths) if isinstance(lengths, str) else lengths
    recorder = Recorder(compute, factories=factories)
    with runtime.observe_calls(recorder):
        yield recorder
    write_recipe(
        path,
        recorder.events,
        name=name,
        source=f"kernelpack.recording() in `{shlex.join(sys.argv) or 'python'}`",
        lengths=lengths,
    )


_process_recording: Any = None


def start_from_env() -> None:
    """Record this whole process into ``KERNELPACK_RECORD_DIR`` (set by ``kernelpack record``): called by the
    sitecustomize record installs, right after ``import torch``."""
    directory = settings.record_dir()
    if directory is None:
        return
    factories = Factories(**settings.record_factories())
    sink = directory / f"calls-{os.getpid()}.jsonl"
    sink.touch()  # this process records (even if it makes no call)
    recorder = Recorder(settings.record_compute(), sink=sink, factories=factories)
    global _process_recording
    _process_recording = runtime.observe_calls(recorder)  # referenced: a collected context would end recording
    _process_recording.__enter__()  # for the life of the process


# Put first on PYTHONPATH by record_command: every Python process of the command imports it at start. It waits for
# `import torch` (recording needs torch; a process without it records nothing and pays nothing), then starts
# kernelpack.record.start_from_env(); and it runs the sitecustomize it shadows, if any.
SITECUSTOMIZE = """\
import importlib.abc, importlib.machinery, importlib.util, os, sys

_HERE = os.path.dirname(os.path.abspath(__file__))


class _KernelpackRecordAfterTorch(importlib.abc.MetaPathFinder):
    # Stays on sys.meta_path until torch has really run: importlib.util.find_spec("torch") (transformers'
    # is_torch_available, for one) asks the finders too, and its spec is never executed.
    busy = False

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy = False
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        finder = self

        def exec_then_record(module):
            exec_module(module)
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            try:
                from kernelpack.record import start_from_env

                start_from_env()
            except Exception as e:
                print(f"kernelpack record: not recording this process: {type(e).__name__}: {e}", file=sys.stderr)

        spec.loader.exec_module = exec_then_record
        return spec


sys.meta_path.insert(0, _KernelpackRecordAfterTorch())
_shadowed = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if p != _HERE])
if _shadowed is not None and _shadowed.loader is not None:
    _module = importlib.util.module_from_spec(_shadowed)
    _shadowed.loader.exec_module(_module)
"""


@dataclasses.dataclass(frozen=True, slots=True)
class RecordResult:
    recipe: Path
    calls: int  # distinct recipe entries (a call's graphs merged)
    processes: int  # Python processes of the command that recorded
    seconds: float  # the command's wall time
    notes: tuple[str, ...]


def record_command(
    command: Sequence[str],
    out: str | os.PathLike[str],
    *,
    compute: str = "skip",
    name: str | None = None,
    factories: Factories | None = None,
    lengths: Lengths | None = None,
) -> RecordResult:
    """Run ``command`` (``python train.py ...``) with every Python process of it recording, then write the recipe
    of all their calls to ``out``. Nothing is written when the command fails or a call cannot be written."""
    if not command:
        raise RecordError("no command to record", hint="kernelpack record -o recipe.toml -- python train.py ...")
    if compute not in COMPUTE:
        raise RecordError(f"--compute {compute!r}", hint=f"one of {', '.join(COMPUTE)}")
    target = Path(out)
    if not target.parent.is_dir() or target.is_dir():  # before the job runs, not after
        raise RecordError(
            f"-o {target}: {'is a directory' if target.is_dir() else 'its directory does not exist'}",
            hint="pass -o a file path in an existing directory, e.g. -o recipes/my-job.toml",
        )
    try:
        check_replaceable(target)
    except OSError as e:
        raise RecordError(f"-o {target}: {e.strerror}", hint="pass -o a new file name or a regular file") from None
    problem = check_name(name or _stem_name(target))
    if problem:  # before the job runs
        raise RecordError(f"recipe name {name or _stem_name(target)!r} {problem}", hint="pass --name")
    factories = factories or Factories()
    with tempfile.TemporaryDirectory(prefix="kernelpack-record-") as tmp:
        site, calls = Path(tmp, "site"), Path(tmp, "calls")
        site.mkdir()
        calls.mkdir()
        (calls / settings.RECORD_MARKER).write_text(f"{os.getpid()}\n")  # settings.record_dir() checks it
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = dict(os.environ)
        env.update(
            KERNELPACK_RECORD_DIR=str(calls),
            KERNELPACK_RECORD_COMPUTE=compute,
            KERNELPACK_RECORD_FACTORIES=json.dumps({"mask": dict(factories.mask), "score": dict(factories.score)}),
            PYTHONPATH=os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p),
        )
        start = time.perf_counter()
        returncode = _run_to_the_end(command, env)
        seconds = time.perf_counter() - start
        processes = len(list(calls.glob("calls-*.jsonl")))
        events = read_events(calls)
    source = shlex.join(command)
    if returncode != 0:
        raise RecordError(
            f"`{source}` exited with status {returncode}: no recipe written",
            hint="its own output is above; record a run that ends normally (a step or two suffice)",
        )
    if processes == 0:
        raise RecordError(
            f"no Python process of `{source}` imported torch with kernelpack importable",
            hint="run the job with the Python that has kernelpack installed (kernelpack record -- python train.py)",
        )
    path = write_recipe(target, events, name=name, source=f"`{source}`", lengths=lengths)
    notes = tuple(e["note"] for e in events if "note" in e)
    entries = len({json.dumps({**e["call"]["config"], "graphs": None}, sort_keys=True) for e in events if "call" in e})
    return RecordResult(path, entries, processes, seconds, notes)


def _run_to_the_end(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Run the recorded command in a session of its own and return its exit status. Whatever stops record (^C,
    SIGTERM: the CLI turns both into exceptions) stops the command's whole session first, so that no process of it
    keeps running on GPUs, or writing into a directory record removes: SIGTERM, then SIGKILL after 10 s.
    A terminal's ^C reaches record only (another session), which passes it on as SIGINT."""
    try:
        proc = subprocess.Popen(list(command), env=dict(env), start_new_session=True)
    except OSError as e:
        raise RecordError(f"cannot run {command[0]!r}: {e}", hint="kernelpack record -o R.toml -- CMD ARGS") from e
    try:
        return proc.wait()
    except BaseException as e:
        first = signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM
        for sig, grace in ((first, 10.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=grace)
                _wait_session_gone(proc.pid, grace)
                break
            except subprocess.TimeoutExpired:
                continue
        raise


def _wait_session_gone(pgid: int, seconds: float) -> None:
    """Until no process of group ``pgid`` is left (the command's children outlive it for a moment)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)
    raise subprocess.TimeoutExpired("kernelpack record", seconds)


def read_events(directory: Path) -> list[dict[str, Any]]:
    """Every event the processes of a recorded command wrote (one ``calls-<pid>.jsonl`` each)."""
    events = []
    for file in sorted(directory.glob("calls-*.jsonl")):
        for line in file.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):  # a line cut short by a killed process
                events.append(json.loads(line))
    return events


# ------------------------------------------------------------------------------------------------ one call


def _event(sig: CallSignature, arguments: Mapping[str, Any], path: str, site: str | None, factories: Factories) -> Any:
    """The call event of a call, or the problem event saying why its recipe entry cannot be written."""
    where = {"call_signature": sig.describe(), "path": path, "site": site}
    try:
        mask, mask_closure, window, padded = _mask(arguments.get("block_mask"), sig, factories)
        score, score_closure = _score(arguments.get("score_mod"), sig, factories)
        params = {f.name: getattr(sig, f.name) for f in dataclasses.fields(sig)}
        for f in ("mask", "device_index", "graph", "score_mod"):
            params.pop(f)
        config = Config(
            **params,
            mask=mask,
            mask_closure=mask_closure,
            window=window,
            padded=padded,
            score_mod=score,
            score_closure=score_closure,
            graphs=(sig.graph,),
        )
    except closures.NotRebuildable as e:
        return {"problem": {**where, "reason": e.message, "hint": e.hint}}
    except _Unrecordable as e:
        return {"problem": {**where, "reason": str(e), "hint": e.hint}}
    except ConfigError as e:
        return {"problem": {**where, "reason": f"a recipe cannot declare this call: {e}", "hint": _CONFIG_HINT}}
    problem = _check_factories(config, sig)
    if problem is not None:
        return {"problem": {**where, **problem}}
    return {"call": {**where, "config": config.to_dict(), "device_index": sig.device_index}}


_CONFIG_HINT = "kernelpack serves the calls a recipe can declare (README, 'Recipe format')"


class _Unrecordable(Exception):
    def __init__(self, reason: str, hint: str) -> None:
        super().__init__(reason)
        self.hint = hint


def _check_factories(config: Config, sig: CallSignature) -> dict[str, str] | None:
    """A factory the user named must make the job's very function: its key (code, closure, qualname) equal to the
    call's, or the artifact would never cover the call."""
    from .masks import mask_for, score_mod_for
    from .signature import mask_key, score_mod_key

    checks = []
    if config.mask_closure is None and config.mask not in BUILTIN_MASKS:
        checks.append(("mask", config.mask, lambda: mask_key(mask_for(config)), sig.mask))
    if config.score_closure is None and config.score_mod not in SCORE_MODS:
        checks.append(("score_mod", config.score_mod, lambda: score_mod_key(score_mod_for(config)), sig.score_mod))
    for what, factory, made, wanted in checks:
        try:
            got = made()
        except KernelpackError as e:
            return {"reason": f"the {what} factory {factory} failed for this call: {e.message}", "hint": e.hint or ""}
        if got != wanted:
            return {
                "reason": f"the {what} factory {factory} makes {got}, but the job's {what} is {wanted}: the artifact "
                "would never cover this call",
                "hint": "the factory must return the job's very function (the same code and the same name): call "
                "the function your job makes it with",
            }
    return None


def _mask(block_mask: Any, sig: CallSignature, factories: Factories) -> tuple[str, str | None, int | None, bool]:
    """(mask, mask_closure, window) of a recipe config for the call's BlockMask."""
    if block_mask is None:
        raise _Unrecordable(
            "a call without a block_mask: recipes cannot declare one yet",
            hint="pass a BlockMask (create_block_mask(lambda b, h, q, kv: q >= 0, None, None, Q, KV) for none)",
        )
    if getattr(block_mask, "full_kv_num_blocks", None) is None:
        raise _Unrecordable(
            "a BlockMask without full blocks (BlockMask.from_kv_blocks): its graph is not the one kernelpack builds",
            hint="build the BlockMask with create_block_mask (or kernelpack.masks.block_mask)",
        )
    lengths = tuple(getattr(block_mask, "seq_lengths", (sig.q_len, sig.kv_len)))
    if lengths != (sig.q_len, sig.kv_len):
        raise _Unrecordable(
            f"the BlockMask was made for lengths {lengths}, the call has ({sig.q_len}, {sig.kv_len})",
            hint="build the BlockMask for the call's q and kv lengths",
        )
    mask_mod = block_mask.mask_mod
    tag = getattr(mask_mod, "kernelpack_mask", None)
    match = re.fullmatch(r"(padded\()?(\w+)\((\d+)\)(\))?", str(tag)) if tag is not None else None
    if match is not None and bool(match.group(1)) == bool(match.group(4)) and match.group(2) in BUILTIN_MASKS:
        # kernelpack's own masks by name and window, masks.padded() around one as [call] padded
        return match.group(2), None, int(match.group(3)), bool(match.group(1))
    factory = factories.lookup(mask_mod, "mask")
    if factory is not None:
        return factory, None, None, False
    ref = closures.describe(mask_mod, "mask")
    return ref["function"], closures.closure_json(ref), None, False


def _score(score_mod: Any, sig: CallSignature, factories: Factories) -> tuple[str, str | None]:
    if sig.score_mod in SCORE_MODS:  # by graph: any function returning the score is the identity
        return sig.score_mod, None
    factory = factories.lookup(score_mod, "score")
    if factory is not None:
        return factory, None
    ref = closures.describe(score_mod, "score_mod")
    return ref["function"], closures.closure_json(ref)


def _stand_in(arguments: Mapping[str, Any]) -> Any:
    """What flex_attention returns for these arguments, as zeros (gradients too): the shapes, dtypes, devices and
    autograd connections of the real call, with no compile and no attention computed."""
    q, k, v = arguments["query"], arguments["key"], arguments["value"]
    out, lse, max_scores = _zeros_fn().apply(q, k, v)
    aux = arguments.get("return_aux")
    if aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput

        return out, AuxOutput(
            lse=lse if getattr(aux, "lse", False) else None,
            max_scores=max_scores if getattr(aux, "max_scores", False) else None,
        )
    if arguments.get("return_lse"):
        return out, lse
    return out


_zeros_class: Any = None


def _zeros_fn() -> Any:
    global _zeros_class
    if _zeros_class is None:
        import torch

        class FlexStandIn(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, q: Any, k: Any, v: Any) -> Any:
                ctx.inputs = [(t.shape, t.dtype, t.device) for t in (q, k, v)]
                b, h, s, _ = q.shape
                # flex's output has the query's memory layout: a transposed view ([B, S, H, D] seen as [B, H, S, D])
                # stays one, with the value's head dim
                if q.dim() == 4 and q.stride(1) < q.stride(2) and q.transpose(1, 2).is_contiguous():
                    out = q.new_zeros((b, s, h, v.shape[-1])).transpose(1, 2)
                else:
                    out = q.new_zeros((b, h, s, v.shape[-1]))
                lse = q.new_zeros((b, h, s), dtype=torch.float32)
                return out, lse, lse.clone()

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.inputs)

        _zeros_class = FlexStandIn
    return _zeros_class


# ------------------------------------------------------------------------------------------------ the recipe


def recipe_text(
    events: Sequence[dict[str, Any]],
    *,
    name: str,
    description: str = "",
    source: str = "path",
    check: bool = True,
    lengths: Lengths | None = None,
) -> str:
    """The recipe (TOML) of recorded events: one ``[[calls]]`` table per graph-selecting variant of a call (its
    graphs merged), each with a comment saying where it was made.

    Calls that differ only in their lengths and in the ints and tensor sizes their mask closes over are one variant
    (:func:`_merge_closures`): DFlash's mask at every context length S. Such a variant seen at two or more lengths is
    one dynamic range, widened beyond the lengths seen (:func:`_range_table`; ``lengths`` sets it, or asks for static
    buckets). A None where another call has an int (a full layer's window) is another variant: another graph.

    Raises :class:`RecordError` for problem events (each with what to do) or no call; with ``check``, the text is
    parsed back and every recorded call replayed against it with the keys the runtime uses (:func:`_replay`)."""
    problems = [e["problem"] for e in events if "problem" in e]
    if problems:
        lines = [f"{len(problems)} call(s) cannot be written as a recipe:"]
        by_reason: dict[str, list[dict[str, Any]]] = {}
        for p in problems:  # one line per reason (a job's many lengths fail for one), with the first call
            by_reason.setdefault(p["reason"], []).append(p)
        for reason, same in by_reason.items():
            p = same[0]
            others = f" and {len(same) - 1} more call(s)" if len(same) > 1 else ""
            lines.append(f"- {p['call_signature']}{others} ({p['path']} at {p['site'] or 'an unknown site'}): {reason}")
        hints = list(dict.fromkeys(p["hint"] for p in problems if p.get("hint")))
        raise RecordError("\n".join(lines), hint="\n\n".join(hints))
    entries: dict[str, dict[str, Any]] = {}
    recorded_calls = [e["call"] for e in events if "call" in e]
    for call in _merge_closures(recorded_calls):
        params = dict(call["config"])
        graphs = params.pop("graphs")
        key = json.dumps(params, sort_keys=True)
        entry = entries.setdefault(key, {"config": params, "graphs": set(), "devices": set(), "seen": set()})
        entry["graphs"].update(graphs)
        if call.get("device_index") is not None:
            entry["devices"].add(call["device_index"])
        entry["seen"].add(f"{call['path']} at {call['site'] or 'an unknown site'}")
    if not entries:
        raise RecordError(
            "no flex_attention call was recorded",
            hint='kernelpack sees calls through kernelpack.flex_attention, attn_implementation="kernelpack" and '
            "torch.compile(flex_attention); inside your own torch.compile(model) flex is part of your graph, which "
            "record cannot see",
        )
    devices = {entry["config"]["device"] for entry in entries.values()}
    if len(devices) > 1:
        raise RecordError(
            f"calls on {sorted(devices)}: a recipe is for one device type",
            hint="record the CPU and the CUDA job separately",
        )
    problem = check_name(name)
    if problem:
        raise RecordError(f"recipe name {name!r} {problem}", hint="pass --name")
    indices = sorted({i for entry in entries.values() for i in entry["devices"]})
    notes = [e["note"] for e in events if "note" in e]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [_comment(f"# Recorded by kernelpack record from {source} on {now}.")]
    out += [_comment(f"# note: {n}") for n in notes]
    if indices and indices != [0]:
        out.append(f"# CUDA device indices seen: {indices}: build with --devices {','.join(map(str, indices))}")
    out += [f"name = {_toml_text(name)}"]
    if description:
        out.append(f"description = {_toml_text(description)}")
    out += [f"device = {_toml_text(devices.pop())}", ""]
    for group in _length_groups(entries.values()):
        graphs = sorted({g for entry in group for g in entry["graphs"]}, key=GRAPHS.index)
        recorded = [Config.from_dict({**entry["config"], "graphs": graphs}) for entry in group]
        sites = sorted({s for entry in group for s in entry["seen"]})
        indices_seen = sorted({d for entry in group for d in entry["devices"]})
        for i, (table, comments) in enumerate(_tables(recorded, lengths)):
            out += [_comment(f"# {c}") for c in comments]
            if i == 0:
                out += [_comment(f"# seen: {s}") for s in sites]
                if indices_seen and indices_seen != [0]:
                    out.append(f"# device indices: {indices_seen}")
            out += ["[[calls]]", *(f"{k} = {_toml_text(v)}" for k, v in table.items()), ""]
    text = "\n".join(out)
    if check:
        _replay(parse_recipe(tomllib.loads(text), path="<recorded recipe>"), recorded_calls, lengths)
    return text


# the number of distinct lengths of one otherwise equal call from which record writes a range, not a table each
RANGE_FROM = 2
# record's default range for a length that varied: from half the smallest to twice the largest length seen (torch's
# one dynamic graph serves any length; the range is what strict mode serves), within one block + 1 .. LENGTH_CAP
WIDEN = 2
LENGTH_CAP = 131072


@dataclasses.dataclass(frozen=True, slots=True)
class Lengths:
    """``--lengths MIN:MAX[:MULTIPLE]``: the range record writes for the lengths that varied (a dynamic range; with
    MULTIPLE, static buckets of that multiple instead)."""

    min: int
    max: int
    multiple: int | None = None

    @classmethod
    def parse(cls, text: str) -> Lengths:
        parts = text.split(":")
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            numbers = []
        if len(parts) not in (2, 3) or len(numbers) != len(parts) or any(n <= 0 for n in numbers):
            raise RecordError(
                f"--lengths {text!r} is not MIN:MAX or MIN:MAX:MULTIPLE (positive integers)",
                hint="e.g. --lengths 1024:16384 (one dynamic graph) or --lengths 1024:4096:256 (static buckets)",
            )
        if numbers[0] > numbers[1]:
            raise RecordError(f"--lengths {text!r}: MIN {numbers[0]} is above MAX {numbers[1]}", hint="MIN:MAX")
        return cls(numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else None)


def _merge_closures(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recorded calls with each mask's closure written once per variant: calls whose masks differ only in the
    ints and tensor sizes they close over are one variant, and each such value is written as the constant it was,
    as the expression of the call's dimensions it followed in every call (``{"dim": "kv_len - q_len"}``, a tensor
    of shape ``["batch", "q_len // 16"]``), or as an example of the values seen (``{"example": 1500, "seen":
    [1024, 4096]}``). The builder makes each value again at every recipe point (:func:`kernelpack.closures.rebuild`)
    and a dynamic graph keeps the varying ones symbolic (their key is their type). A None where another call has an
    int is another variant: it selects other code."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for call in calls:
        config = call["config"]
        closure = config.get("mask_closure")
        rest = {k: v for k, v in config.items() if k not in ("q_len", "kv_len", "graphs")}
        if closure is not None:
            rest["mask_closure"] = _blank(json.loads(closure))
        groups.setdefault(json.dumps(rest, sort_keys=True), []).append(call)
    out = []
    for group in groups.values():
        closures_ = [c["config"].get("mask_closure") for c in group]
        if closures_[0] is None:
            out += group
            continue
        dims = [_dims_of(c) for c in group]
        merged = _merge([json.loads(c) for c in closures_], dims, tensor=False)
        text = json.dumps(merged, sort_keys=True, separators=(",", ":"))
        out += [{**c, "config": {**c["config"], "mask_closure": text}} for c in group]
    return out


def _dims_of(call: dict[str, Any]) -> dict[str, int]:
    return {d: int(call["config"][d]) for d in closures.DIMS}


def _blank(v: Any) -> Any:
    """A closure with its ints and tensor sizes blanked: what the calls of one variant share."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return "<int>"
    if isinstance(v, list):
        return [_blank(x) for x in v]
    if isinstance(v, dict):
        if "tensor" in v and len(v) == 1 and isinstance(v["tensor"], dict):
            return {"tensor": {**v["tensor"], "shape": ["<int>"] * len(v["tensor"].get("shape", ()))}}
        return {k: _blank(x) for k, x in v.items()}
    return v


def _merge(values: list[Any], dims: list[dict[str, int]], *, tensor: bool) -> Any:
    """One value for the same position of every call's closure (see :func:`_merge_closures`); a tensor's sizes
    prefer an expression even when constant (the builder's tensor then follows the recipe point)."""
    first = values[0]
    if isinstance(first, int) and not isinstance(first, bool):
        exprs = [
            e
            for e in closures.dim_expressions(first, dims[0])
            if all(closures.evaluate(e, d) == v for v, d in zip(values, dims, strict=True))
        ]
        constant = len(set(values)) == 1
        if exprs and (tensor or not constant):
            return {"dim": exprs[0]} if not tensor else exprs[0]
        if constant:
            return first
        return {"example": first, "seen": [min(values), max(values)]}
    if isinstance(first, list):
        return [_merge([v[i] for v in values], dims, tensor=tensor) for i in range(len(first))]
    if isinstance(first, dict):
        if "tensor" in first and len(first) == 1:
            shapes = [v["tensor"]["shape"] for v in values]
            merged = [_merge([s[i] for s in shapes], dims, tensor=True) for i in range(len(shapes[0]))]
            return {"tensor": {**first["tensor"], "shape": merged}}
        return {k: _merge([v[k] for v in values], dims, tensor=tensor) for k in first}
    return first


def _length_groups(entries: Any) -> list[list[dict[str, Any]]]:
    """The recorded calls grouped by everything but their lengths (and graphs, merged): a group of RANGE_FROM or
    more becomes one range. A length that varies starts above one block in a range (torch makes a length of one
    block another graph); one that stays fixed may be anything. Calls through the user's own
    ``torch.compile(flex_attention)`` stay one table per length: kernelpack cannot make that compile dynamic."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        rest = {k: v for k, v in entry["config"].items() if k not in ("q_len", "kv_len")}
        groups.setdefault(json.dumps(rest, sort_keys=True), []).append(entry)
    out = []
    for key in sorted(groups):
        group = sorted(groups[key], key=lambda e: (e["config"]["q_len"], e["config"]["kv_len"]))
        block_q, block_kv = group[0]["config"].get("block_size") or (128, 128)
        qs, kvs = {e["config"]["q_len"] for e in group}, {e["config"]["kv_len"] for e in group}
        own = any(s.startswith("torch.compile(flex_attention)") for e in group for s in e["seen"])
        long = [
            e
            for e in group
            if (len(qs) == 1 or e["config"]["q_len"] > block_q) and (len(kvs) == 1 or e["config"]["kv_len"] > block_kv)
        ]
        if len(long) >= RANGE_FROM and not own:
            out.append(long)
            out += [[e] for e in group if e not in long]
        else:
            out += [[e] for e in group]
    return out


def _tables(recorded: list[Config], lengths: Lengths | None = None) -> list[tuple[dict[str, Any], list[str]]]:
    """The ``[[calls]]`` tables of one call recorded at these lengths, each with its comment lines: the call itself
    for one length (unless ``lengths`` asks for a range); for several, one dynamic range over them, widened
    (:func:`_range_table`), or static buckets when ``lengths`` has a multiple."""
    exact = [(_call_table(c), [c.describe()]) for c in recorded]
    if len(recorded) == 1 and lengths is None:
        return exact
    table, comments = _range_table(recorded, lengths)
    try:  # the proposal must parse; an invalid one (a range at one block) leaves the lengths one by one
        head = f'name = "r"\ndevice = {_toml_text(recorded[0].device)}\n[[calls]]\n'
        parse_recipe(tomllib.loads(head + "\n".join(f"{k} = {_toml_text(v)}" for k, v in table.items())))
    except RecipeError as e:
        if lengths is not None:
            raise RecordError(f"--lengths: {e}", hint="a range starts above one block (128)") from None
        return exact
    return [(table, comments)]


def _range_table(recorded: list[Config], lengths: Lengths | None) -> tuple[dict[str, Any], list[str]]:
    first = recorded[0]
    rest = _call_table(first)
    for key in ("seq_len", "q_len", "kv_len", "dynamic"):
        rest.pop(key, None)
    table: dict[str, Any] = {k: rest.pop(k) for k in ("mask", "window", "batch", "q_heads", "kv_heads") if k in rest}
    lens = [(c.q_len, c.kv_len) for c in recorded]
    tied = all(q == kv for q, kv in lens)
    qs, kvs = sorted({q for q, _ in lens}), sorted({kv for _, kv in lens})
    where = f"{len(lens)} lengths were recorded, q_len {qs[0]}..{qs[-1]}, kv_len {kvs[0]}..{kvs[-1]}"
    if len(lens) == 1:
        where = f"one length was recorded, q_len {qs[0]}, kv_len {kvs[0]}"
    # calls made through guarded(dynamic=True) are served by dynamic graphs only
    if lengths is not None and lengths.multiple is not None and first.dynamic:
        raise RecordError(
            "--lengths MIN:MAX:MULTIPLE asks for static buckets, but the job calls a dynamic graph "
            "(guarded(dynamic=True))",
            hint="drop MULTIPLE: --lengths MIN:MAX",
        )

    def span(seen: list[int], block: int) -> dict[str, int]:
        if lengths is not None:
            out = {"min": lengths.min, "max": lengths.max}
            if lengths.multiple is not None:
                out["multiple"] = lengths.multiple
            return out
        lo = max(block + 1, seen[0] // WIDEN)
        return {"min": min(lo, seen[0]), "max": max(seen[-1], min(LENGTH_CAP, seen[-1] * WIDEN))}

    if lengths is None:
        # a job that already pads (every length a multiple of one m >= 64): its buckets serve it as it calls, with
        # static graphs' faster kernels (docs/BENCHMARKS.md: 7.0 ms against 10.6 ms for one DFlash-shaped call)
        m = math.gcd(*qs, *kvs)
        if m >= 64 and not first.dynamic and (tied or len(qs) == 1 or len(kvs) == 1):
            lengths = Lengths(qs[0] if len(qs) > 1 or tied else kvs[0], qs[-1] if len(qs) > 1 or tied else kvs[-1], m)
            where += f", all multiples of {m} (the job pads)"
    buckets = lengths is not None and lengths.multiple is not None
    if tied:
        table["seq_len"] = span(qs, max(first.block_size))
        what = "seq_len"
    else:
        # a length that did not vary stays fixed (DFlash's q_len: its anchors times its block); for one dynamic
        # graph it is the range [q, q]
        for name, seen, block in (("q_len", qs, first.block_size[0]), ("kv_len", kvs, first.block_size[1])):
            if len(seen) > 1 or (lengths is not None and name == "kv_len"):
                table[name] = span(seen, block)
            else:
                table[name] = seen[0] if buckets else {"min": seen[0], "max": seen[0]}
        varied = [
            n
            for n in ("q_len", "kv_len")
            if isinstance(table[n], dict) and ("multiple" in table[n] or table[n]["min"] != table[n]["max"])
        ]
        what = " and ".join(varied) or "kv_len"
    table.update(rest)
    if lengths is not None and lengths.multiple is not None:
        return table, [
            f"{where}: static buckets of {lengths.multiple} for {what}; a length between buckets is padded to one "
            "(kernelpack.runtime.padded_lengths)",
            "for one dynamic graph that serves any length without padding, record with --lengths MIN:MAX",
        ]
    table["dynamic"] = True
    source = "--lengths"
    if lengths is None:
        source = f"record's default: 1/{WIDEN} of the smallest to {WIDEN}x the largest seen, at most {LENGTH_CAP}"
    return table, [
        f"{where}: one dynamic graph serves {what} over the range ({source}), as the job calls it, with no padding",
        "to serve other lengths, record again with --lengths MIN:MAX (MIN:MAX:MULTIPLE for static buckets, which "
        "run faster kernels but need the job to pad)",
    ]


def _replay(recipe: Recipe, calls: list[dict[str, Any]], lengths: Lengths | None = None) -> None:
    """Every recorded call replayed against the written recipe with the keys the runtime uses: the same call
    parameters, its lengths in a config's, and its mask's key (the job's values, made again from the recording)
    equal to the key of the config's mask made at the call's lengths, with the values a dynamic graph keeps
    symbolic keyed by type. Raises :class:`RecordError` naming the first call no config serves."""
    for call in calls:
        recorded = Config.from_dict(call["config"])
        if any(_serves(c, recorded) for c in recipe.configs):
            continue
        # static buckets serve a call the job pads to one: the same call at the bucket's lengths
        buckets = [c for c in recipe.configs if c.q_range is None]
        padded = [
            c
            for c in buckets
            if c.q_len >= recorded.q_len and c.kv_len >= recorded.kv_len and _serves(c, recorded.at(c.q_len, c.kv_len))
        ]
        if padded:
            continue
        # the values record wrote as following the lengths (from every call of this variant)
        refs = [c.reference("mask") or {} for c in buckets if c.mask == recorded.mask]
        follows = [p for ref in refs[:1] for p in closures.varying(ref) if ".shape[" not in p]
        if buckets and lengths is not None and lengths.multiple is not None:
            raise RecordError(
                f"static buckets (--lengths {lengths.min}:{lengths.max}:{lengths.multiple}) cannot serve the call "
                f"{recorded.describe()}"
                + (
                    f": its mask closes over {', '.join(follows)}, which follow(s) the call's lengths, so a call "
                    "padded to a bucket keeps its own value and misses the bucket's graph"
                    if follows
                    else ": its lengths are above the largest bucket"
                ),
                hint="drop MULTIPLE (--lengths MIN:MAX: one dynamic graph serves every length as the job calls it)",
            )
        raise RecordError(
            f"the recorded recipe does not serve the call {recorded.describe()} (at {call.get('site')})",
            hint="report it as a kernelpack bug; until then, write the recipe by hand (README, 'Recipe format')",
        )


def _serves(built: Config, call: Config) -> bool:
    """Whether a recipe's config serves a recorded call: the same call parameters, its lengths (exactly, or in the
    config's dynamic range) and, for a mask made again from its closure, the same mask key at the call's lengths
    (see :func:`_replay`)."""
    if not built.covers_lengths(call.q_len, call.kv_len) or (call.dynamic and not built.dynamic):
        return False
    same = dataclasses.replace(
        call,
        q_len=built.q_len,
        kv_len=built.kv_len,
        q_range=built.q_range,
        kv_range=built.kv_range,
        dynamic=built.dynamic,
        mask_closure=built.mask_closure if call.mask_closure is not None else None,
        graphs=built.graphs if set(call.graphs) <= set(built.graphs) else call.graphs,
    )
    if same.id != built.id:
        return False
    if call.mask_closure is None:
        return True
    from .masks import mask_for
    from .signature import mask_key

    ref = built.reference("mask")
    assert ref is not None
    free = tuple(closures.varying(ref)) if built.dynamic else ()
    # made again as the builder's workers make it (their sys.path ends with the working directory); a mask that
    # cannot be made here cannot be built either: the error says so, before anything is written
    sys.path.append(os.getcwd())
    try:
        job = mask_for(call, call.device)
        made = mask_for(built.at(call.q_len, call.kv_len), call.device)
    finally:
        sys.path.remove(os.getcwd())
    return mask_key(job, free) == mask_key(made, free)


def write_recipe(
    path: str | os.PathLike[str],
    events: Sequence[dict[str, Any]],
    *,
    name: str | None = None,
    source: str = "a job",
    lengths: Lengths | None = None,
) -> Path:
    """:func:`recipe_text` written atomically to ``path`` (name: the file's stem by default)."""
    target = Path(path)
    text = recipe_text(events, name=name or _stem_name(target), source=source, lengths=lengths)
    try:
        write_bytes(target, text.encode())
    except OSError as e:
        raise RecordError(f"cannot write {target}: {e}", hint="pass -o a path in a writable directory") from e
    return target


def _stem_name(target: Path) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", target.stem).lstrip(".") or "recorded"


def _call_table(config: Config) -> dict[str, Any]:
    """A config as a ``[[calls]]`` table: every key that is not its default."""
    t: dict[str, Any] = {}
    ref = config.reference("mask")
    t["mask"] = ref if ref is not None else config.mask
    if config.window is not None:
        t["window"] = config.window
    t["batch"] = config.batch
    t["q_heads"], t["kv_heads"] = config.q_heads, config.kv_heads
    if config.q_len == config.kv_len:
        t["seq_len"] = config.q_len
    else:
        t["q_len"], t["kv_len"] = config.q_len, config.kv_len
    t["head_dim"], t["dtype"], t["graphs"] = config.head_dim, config.dtype, list(config.graphs)
    if config.layout != "bhsd":
        t["layout"] = config.layout
    if config.scale is not None:
        t["scale"] = config.scale
    if config.enable_gqa != (config.q_heads != config.kv_heads):
        t["enable_gqa"] = config.enable_gqa
    if config.return_lse:
        t["return_lse"] = True
    if tuple(config.block_size) != DEFAULT_BLOCK_SIZE:
        t["block_size"] = list(config.block_size)
    score = config.reference("score")
    if score is not None or config.score_mod != "none":
        t["score_mod"] = score if score is not None else config.score_mod
    for key, default in (("return_aux", "none"), ("mask_dims", "broadcast"), ("alias", "none"), ("mode", "default")):
        if getattr(config, key) != default:
            t[key] = getattr(config, key)
    if config.dynamic:
        t["dynamic"] = True
    if config.padded:
        t["padded"] = True
    if config.kernel_options:
        t["kernel_options"] = dict(config.kernel_options)
    return t


def _comment(text: str) -> str:
    return _toml_writer.comment(text)


def _toml_text(value: Any) -> str:
    """A TOML value, through the one writer (:mod:`kernelpack._toml`)."""
    try:
        return _toml_writer.value(value)
    except _toml_writer.NotWritable as e:
        raise RecordError(
            f"a recorded value {e}", hint="rename the file or module to UTF-8, or record other calls"
        ) from None
