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
import json
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

from . import closures, evidence, runtime, settings
from ._fs import check_replaceable
from .config import BUILTIN_MASKS, SCORE_MODS, Config
from .errors import ConfigError, KernelpackError, NotRebuildable, RecordError
from .recipe import check_name
from .recipe_writer import Lengths, stem_name, write_recipe
from .records import RecordedCall, RecordEvent, RecordNote, RecordProblem, record_event
from .signature import CallSignature, signature_of

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - exercised on 3.10 only
    pass

COMPUTE = ("skip", "compile")


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
    (:data:`kernelpack.records.RecordEvent`: a recorded call, a problem, a note). With ``sink``, each event is also
    appended to that file as a JSON line as it happens (a job killed later keeps what it recorded)."""

    def __init__(self, compute: str = "skip", *, sink: Path | None = None, factories: Factories | None = None) -> None:
        if compute not in COMPUTE:
            raise KernelpackError(f"record: compute={compute!r}", hint=f"one of {', '.join(COMPUTE)}")
        self.compute = compute
        self.sink = sink
        self.factories = factories or Factories()
        self.events: list[RecordEvent] = []
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
            event = RecordProblem(
                sig.describe(),
                path,
                evidence.user_site(),
                reason=f"kernelpack could not record this call: {type(e).__name__}: {e}",
                hint="run with KERNELPACK_DEBUG=1 for the traceback, and report it",
            )
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
        self._add(RecordNote(text))

    def _add(self, event: RecordEvent) -> None:
        with self._lock:
            self.events.append(event)
            if self.sink is not None:
                try:
                    with open(self.sink, "a", encoding="utf-8") as f:
                        f.write(json.dumps(event.to_dict()) + "\n")
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
    problem = check_name(name or stem_name(target))
    if problem:  # before the job runs
        raise RecordError(f"recipe name {name or stem_name(target)!r} {problem}", hint="pass --name")
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
    notes = tuple(e.text for e in events if isinstance(e, RecordNote))
    entries = len(
        {json.dumps({**e.config, "graphs": None}, sort_keys=True) for e in events if isinstance(e, RecordedCall)}
    )
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


def read_events(directory: Path) -> list[RecordEvent]:
    """Every event the processes of a recorded command wrote (one ``calls-<pid>.jsonl`` each)."""
    events = []
    for file in sorted(directory.glob("calls-*.jsonl")):
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            try:
                data = json.loads(line)
            except ValueError:  # a line cut short by a killed process
                continue
            try:
                events.append(record_event(data))
            except (TypeError, KeyError, ValueError) as e:
                raise RecordError(
                    f"{file}:{number} is not an event kernelpack record writes: {e}",
                    hint="a process of the recorded command wrote into record's directory; record again",
                ) from None
    return events


# ------------------------------------------------------------------------------------------------ one call


def _event(
    sig: CallSignature, arguments: Mapping[str, Any], path: str, site: str | None, factories: Factories
) -> RecordedCall | RecordProblem:
    """The call event of a call, or the problem event saying why its recipe entry cannot be written."""
    described = sig.describe()
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
    except NotRebuildable as e:
        return RecordProblem(described, path, site, reason=e.message, hint=e.hint or "")
    except _Unrecordable as e:
        return RecordProblem(described, path, site, reason=str(e), hint=e.hint or "")
    except ConfigError as e:
        return RecordProblem(described, path, site, reason=f"a recipe cannot declare this call: {e}", hint=_CONFIG_HINT)
    problem = _check_factories(config, sig)
    if problem is not None:
        return RecordProblem(described, path, site, **problem)
    return RecordedCall(described, path, site, config=config.to_dict(), device_index=sig.device_index)


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
