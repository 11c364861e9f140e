"""``kernelpack build``: compile every config of a recipe in isolated workers and pack the caches into one artifact.

Each (config, device) runs in its own process (:mod:`kernelpack._worker`) with its own fresh TORCHINDUCTOR_CACHE_DIR
(Triton's cache under it), through exactly the canonical calls workers make (:mod:`kernelpack.canonical`), one per
graph, and is checked against a float64 reference computed without flex. ``jobs`` workers run at once on the same
device (compilation is CPU-bound). The per-config caches are merged into one artifact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _fs, _worker, closures, evidence, settings
from . import artifact as art
from . import manifest as mf
from .canonical import marks as canonical_marks
from .compiled import free_mask_values, key_settings, marking, trace_settings
from .config import Config
from .errors import BuildError, KernelpackError, RecipeError, printable
from .keys import BuildKey, probe
from .masks import block_mask_for, rows_guaranteed_safe_problem
from .recipe import Recipe, load_recipe
from .records import BuiltFunction, WorkerResult
from .signature import Graph, mask_key
from .workload import check_errors, range_lengths, run_config


@dataclass(frozen=True, slots=True)
class ConfigOutcome:
    config: Config
    ok: bool
    device_index: int
    seconds: float  # first canonical call (compile + run), as measured in the worker
    errors: dict[str, float] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    build_key: dict[str, str] | None = None
    mask_key: str = ""
    mask_free: tuple[str, ...] = ()  # the mask's values the built graph's guards leave free (entering its key by type)
    marks: tuple[str, ...] = ()  # what its dynamic graph was traced with symbolic (canonical.marks)
    score_key: str = ""
    key_settings: dict[str, str] = field(default_factory=dict)
    message: str = ""
    log_tail: str = ""
    log_path: Path | None = None  # the worker's whole output (kept when a build fails)
    cache_dir: Path | None = None
    functions: dict[str, BuiltFunction] = field(default_factory=dict)  # tier 2: graph -> its precompiled function
    not_precompiled: str = ""  # why some graph has none
    wall_seconds: float = 0.0  # the worker process, start-up included (a timed-out worker has no ``seconds``)


class BuildProgress:
    """Progress callbacks, no-ops here; the CLI renders them (kernelpack.cli). ``config_started`` and
    ``config_done`` are called from the worker threads, up to ``jobs`` at once."""

    def start(self, total: int, jobs: int) -> None: ...

    def config_started(self, config: Config, device_index: int) -> None: ...

    def config_done(self, outcome: ConfigOutcome) -> None: ...


def hms(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


def _say(line: str) -> None:
    print(printable(line), file=sys.stderr, flush=True)


class Eta:
    """Time left for ``total`` configs run ``jobs`` at a time: the configs running now finish after the mean time of
    the finished ones (less what they ran already), the queued ones in waves of ``jobs`` after that."""

    def __init__(self, total: int, jobs: int) -> None:
        self.total, self.jobs = total, max(1, jobs)
        self.running: dict[tuple[str, int], float] = {}
        self.durations: list[float] = []

    def started(self, key: tuple[str, int]) -> None:
        self.running[key] = time.perf_counter()

    def finished(self, key: tuple[str, int]) -> float:
        """The seconds this config ran (as seen here, timed-out workers included)."""
        seconds = time.perf_counter() - self.running.pop(key, time.perf_counter())
        self.durations.append(seconds)
        return seconds

    def left(self) -> float | None:
        if not self.durations:
            return None
        mean, now = statistics.mean(self.durations), time.perf_counter()
        running = max((max(0.0, mean - (now - t)) for t in self.running.values()), default=0.0)
        queued = self.total - len(self.durations) - len(self.running)
        return running + mean * math.ceil(max(0, queued) / self.jobs)


class BuildProgressBase(BuildProgress):
    """Progress with the time left and the count done; subclasses render (one line per config here, a live
    table and JSON lines in the CLI's kernelpack._render)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.eta = Eta(0, 1)
        self.done = 0

    def start(self, total: int, jobs: int) -> None:
        with self.lock:
            self.t0, self.eta = time.perf_counter(), Eta(total, jobs)
            self._start(total, jobs)

    def config_started(self, config: Config, device_index: int) -> None:
        with self.lock:
            self.eta.started((config.id, device_index))
            self._config_started(config, device_index)

    def config_done(self, outcome: ConfigOutcome) -> None:
        with self.lock:
            self.done += 1
            ran = self.eta.finished((outcome.config.id, outcome.device_index))
            # a worker that failed (or timed out) reports no compile time: show how long it ran
            self._config_done(outcome, outcome.seconds if outcome.ok else (outcome.wall_seconds or ran))
            last = self.done == self.eta.total
        if last:  # outside the lock: a live display's refresh thread takes it, and stopping joins that thread
            self.close()

    def close(self) -> None: ...

    def _start(self, total: int, jobs: int) -> None: ...

    def _config_started(self, config: Config, device_index: int) -> None: ...

    def _config_done(self, outcome: ConfigOutcome, seconds: float) -> None: ...

    def _eta(self) -> str:
        left = self.eta.left()
        return "?" if left is None else hms(left)


class BuildLines(BuildProgressBase):
    """One line per finished config (CI logs stay readable)."""

    def _start(self, total: int, jobs: int) -> None:
        _say(f"building {total} config(s), {jobs} at a time")

    def _config_started(self, config: Config, device_index: int) -> None:  # a log shows what is compiling now
        device = f" on cuda:{device_index}" if config.device == "cuda" else ""
        _say(f"started {config.describe()}{device}")

    def _config_done(self, outcome: ConfigOutcome, seconds: float) -> None:
        total = self.eta.total
        _say(
            f"[{self.done:>{len(str(total))}}/{total}] {'ok  ' if outcome.ok else 'FAIL'} {seconds:6.1f}s "
            f"{outcome.config.describe()}  elapsed {hms(time.perf_counter() - self.t0)} "
            f"eta {self._eta()}"
        )


@dataclass(frozen=True, slots=True)
class BuildResult:
    artifact: Path | None
    manifest: mf.Manifest | None
    outcomes: list[ConfigOutcome]
    seconds: float

    @property
    def failed(self) -> list[ConfigOutcome]:
        return [o for o in self.outcomes if not o.ok]


def build_recipe(
    recipe_path: str | Path,
    out_dir: str | Path,
    *,
    jobs: int = 1,
    keep_going: bool = False,
    devices: Sequence[int] = (0,),
    shard: tuple[int, int] | None = None,
    level: int = 10,
    timeout: float = 1800.0,
    progress: BuildProgress | None = None,
    workdir: str | Path | None = None,
) -> BuildResult:
    """Build every config of the recipe on every device index in ``devices``.

    Inductor's cache keys contain the device index of the inputs (pytorch#170123), so one process driving several
    GPUs needs each config compiled per index; a job with one process per GPU pins its GPU as cuda:0 instead
    (:func:`kernelpack.runtime.pin_local_gpu`) and needs only ``devices=(0,)``.

    ``shard=(i, n)`` builds the i-th (1-based) of n deterministic slices of the configs (sorted by id, every n-th);
    :func:`kernelpack.artifact.merge` combines the shards into one artifact.
    """
    recipe = load_recipe(recipe_path)
    configs = shard_configs(recipe.configs, shard)
    devices = sorted(set(devices))
    if not devices or any(d < 0 for d in devices):
        raise KernelpackError(f"devices must be non-negative GPU indices, got {devices}", hint="e.g. --devices 0,1")
    if recipe.device == "cpu" and devices != [0]:
        raise KernelpackError(
            f"recipe {recipe.name!r} is for the CPU: --devices {devices} does not apply",
            hint="drop --devices for CPU recipes",
        )
    preflight(recipe, configs, devices, Path(out_dir))
    progress = BuildLines() if progress is None else progress  # from Python too: a line per config on stderr
    start = time.perf_counter()
    own_workdir = workdir is None
    work = Path(tempfile.mkdtemp(prefix="kernelpack-build-")) if workdir is None else Path(workdir)
    try:
        pairs = [(c, d) for c in configs for d in devices]
        progress.start(len(pairs), max(1, jobs))

        stop = threading.Event()

        def run(c: Config, d: int) -> ConfigOutcome:
            if stop.is_set():
                raise _worker.Stopped("stopped")
            progress.config_started(c, d)
            return _run_worker(c, work / f"{c.id}-d{d}", d, timeout, stop)

        outcomes: list[ConfigOutcome] = []
        pool = ThreadPoolExecutor(max_workers=max(1, jobs))
        try:
            futures = [pool.submit(run, c, d) for c, d in pairs]
            for fut in as_completed(futures):
                outcome = fut.result()
                outcomes.append(outcome)
                progress.config_done(outcome)
        except BaseException:
            # ^C, SIGTERM (the CLI turns it into an exception here) or an error: stop at once. Queued configs never
            # start, running workers are killed with their sessions (within the 0.25 s poll), and the work dir goes
            # below, instead of every remaining config compiling first
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown()
        outcomes.sort(key=lambda o: (o.config.id, o.device_index))
        failed = _keep_logs([o for o in outcomes if not o.ok])
        built = [o for o in outcomes if o.ok]
        if (failed and not keep_going) or not built:
            ids = [o.config.id for o in failed]
            raise BuildError(_failure_report(recipe, failed), failed=ids, hint=_hint(failed, built, timeout))
        path, manifest = _package(recipe, built, failed, Path(out_dir), level, shard)
        return BuildResult(path, manifest, outcomes, time.perf_counter() - start)
    finally:
        if own_workdir:
            shutil.rmtree(work, ignore_errors=True)


def _keep_logs(failed: list[ConfigOutcome]) -> list[ConfigOutcome]:
    """The failed workers with their logs copied out of the work dir (which the build removes) into a directory of
    their own, so that the failure report can name a log that is still there."""
    if not failed:
        return failed
    logs = Path(tempfile.mkdtemp(prefix="kernelpack-build-logs-"))
    kept = []
    for o in failed:
        if o.log_path is not None and o.log_path.is_file():
            dest = logs / f"{o.config.id}-d{o.device_index}.log"
            shutil.copyfile(o.log_path, dest)
            o = dataclasses.replace(o, log_path=dest)
        else:
            o = dataclasses.replace(o, log_path=None)
        kept.append(o)
    return kept


def preflight(recipe: Recipe, configs: Sequence[Config], devices: Sequence[int], out_dir: Path) -> None:
    """What can fail before any compile, checked in seconds instead of after the workers ran: the output directory
    can be written, the recipe's device type is there (and ``devices`` are visible), and every mask and score_mod
    factory imports, once each."""
    _check_out_dir(out_dir)
    if recipe.device == "cuda":
        _check_cuda(recipe, devices)
    from . import masks

    seen: set[str] = set()
    # Import from where the workers will: they are `python -m` processes started now, so the PYTHONPATH of this
    # moment (a caller may have set it after start) comes first on their sys.path and the working directory last
    # (kernelpack._worker: safe path); the `kernelpack` script's sys.path has neither
    added = [p for p in settings.pythonpath() if p not in sys.path]
    sys.path[:0] = added
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
        added.append(os.getcwd())
    try:
        for c in configs:
            for kind, what, spec in (("mask", "mask", c.mask), ("score", "score_mod", c.score_mod)):
                if ":" in spec and spec not in seen and c.reference(kind) is None:  # type: ignore[arg-type]
                    seen.add(spec)
                    masks.load_factory(spec, what)
        _references_run(recipe, configs)
    finally:
        for p in added:
            sys.path.remove(p)


def _references_run(recipe: Recipe, configs: Sequence[Config]) -> None:
    """Each function reference (``{ function = "mod:qualname", closure = {...} }``) made again and called once on
    index scalars, as flex calls it, before any worker starts: a closure value of the wrong type for its function
    (``window = "128"``) failed inside every build worker, or at ``activate()``, with the function's own TypeError.
    A factory (``"pkg.mod:factory"``) is the user's code, built per config: its failures stay per-config
    build failures (``--keep-going`` ships the rest)."""
    import torch

    from . import masks

    index = torch.zeros((), dtype=torch.int32)
    seen: set[tuple[str, str | None]] = set()
    for c in configs:
        for kind, name, closure in (("mask", c.mask, c.mask_closure), ("score", c.score_mod, c.score_closure)):
            if closure is None or (name, closure) in seen:
                continue
            seen.add((name, closure))
            try:
                if kind == "mask":
                    masks.mask_for(c, "cpu")(index, index, index, index)
                else:
                    fn = masks.score_mod_for(c)
                    assert fn is not None
                    fn(torch.zeros(()), index, index, index, index)
            except KernelpackError:
                raise
            except Exception as e:
                what = "mask" if kind == "mask" else "score_mod"
                raise RecipeError(
                    f"recipe {recipe.name!r}",
                    what,
                    f"the function {name} fails with these closure values ({c.describe()}): {type(e).__name__}: "
                    f"{str(e)[:300]}",
                    value=json.loads(closure).get("closure"),
                    hint="give each closure value the type the function uses (record writes them as the job had them)",
                ) from None


def _check_out_dir(out_dir: Path) -> None:
    """A real write probe (os.access says yes to root for anything), in the nearest directory that exists; it leaves
    nothing behind, and the output directory itself is created only when the artifact is written."""
    existing = out_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    hint = "choose a writable output directory with -o"
    if not existing.is_dir():
        raise KernelpackError(f"cannot write the artifact in {out_dir}: {existing} is not a directory", hint=hint)
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".kernelpack-probe-"):
            pass
    except OSError as e:
        raise KernelpackError(f"cannot write the artifact in {out_dir}: {type(e).__name__}: {e}", hint=hint) from None


def _check_cuda(recipe: Recipe, devices: Sequence[int]) -> None:
    import torch

    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            why, hint = "is a CPU-only build", "build CUDA recipes on a GPU machine with a CUDA build of torch"
        else:
            why = f"(CUDA {torch.version.cuda}) sees no CUDA device"
            visible = settings.cuda_visible_devices()
            hint = "check the GPU and its driver (nvidia-smi)" + (
                f"; CUDA_VISIBLE_DEVICES={','.join(visible)!r} is set" if visible is not None else ""
            )
        raise KernelpackError(f"recipe {recipe.name!r} is for CUDA, but torch {torch.__version__} {why}", hint=hint)
    count = torch.cuda.device_count()
    missing = [d for d in devices if d >= count]
    if missing:
        raise KernelpackError(
            f"--devices {','.join(map(str, devices))}: only {count} CUDA device(s) are visible (0..{count - 1})",
            hint="name visible device indices, or check CUDA_VISIBLE_DEVICES",
        )


def _hint(failed: list[ConfigOutcome], built: list[ConfigOutcome], timeout: float) -> str:
    """The hint that matches the failures: --keep-going only when something built, --timeout for timeouts."""
    timed_out = [o for o in failed if "timed out" in o.message]
    hints = []
    if timed_out:
        hints.append(f"{len(timed_out)} timed out: raise --timeout (now {timeout:.0f} s per config)")
    if len(timed_out) < len(failed):
        hints.append("fix or drop the failing configs (the reasons are above)")
    if built:
        hints.append("or pass --keep-going to ship the configs that built")
    elif failed:
        hints.append("no config built, so --keep-going would ship nothing")
    return "; ".join(hints)


def _failure_report(recipe: Recipe, failed: list[ConfigOutcome]) -> str:
    lines = [f"{len(failed)} (config, device) build(s) of recipe {recipe.name!r} failed:"]
    for o in failed:
        device = f" on cuda:{o.device_index}" if o.config.device == "cuda" else ""
        lines.append(f"- {o.config.describe()}{device}: {o.message}")
        if o.log_tail:
            lines += ["    " + line for line in o.log_tail.splitlines()]
        if o.log_path is not None:
            lines.append(f"    the worker's whole output: {o.log_path}")
    return "\n".join(lines)


def _run_worker(
    config: Config, work: Path, device_index: int, timeout: float, stop: threading.Event | None = None
) -> ConfigOutcome:
    cache_dir = work / "cache"
    outcome = _worker.run(
        "kernelpack.build",
        {"config": config.to_dict(), "device_index": device_index},
        workdir=work,
        env=_worker.fresh_cache_env(cache_dir),
        timeout=timeout,
        stop=stop,
    )
    r = WorkerResult.from_dict(outcome.value) if outcome.value is not None else WorkerResult()
    messages = [m for m in (r.problem, outcome.error) if m]  # r.problem: the reference check failed
    return ConfigOutcome(
        config,
        outcome.ok and not r.problem,
        device_index,
        seconds=r.seconds,
        errors=r.errors,
        counters=r.counters,
        build_key=r.build_key or None,
        mask_key=r.mask_key,
        mask_free=r.mask_free,
        marks=r.marks,
        score_key=r.score_key,
        key_settings=r.key_settings,
        message="; ".join(messages),
        log_tail=outcome.log_tail,
        log_path=outcome.log_path,
        cache_dir=cache_dir,
        functions=r.functions,
        not_precompiled=r.missing,
        wall_seconds=outcome.seconds,
    )


def _package(
    recipe: Recipe,
    built: list[ConfigOutcome],
    failed: list[ConfigOutcome],
    out_dir: Path,
    level: int,
    shard: tuple[int, int] | None = None,
) -> tuple[Path, mf.Manifest]:
    keys = {BuildKey.from_dict(o.build_key or {}) for o in built}
    if len(keys) != 1:
        raise BuildError(f"workers reported different build keys: {sorted(map(str, keys))}")
    (key,) = keys
    if len({json.dumps(o.key_settings, sort_keys=True) for o in built}) != 1:
        first = built[0].key_settings
        names = sorted(
            {n for o in built for n in o.key_settings.keys() | first.keys() if o.key_settings.get(n) != first.get(n)}
        )
        raise BuildError(
            f"workers compiled under different settings that enter inductor's cache keys: {', '.join(names)}; the "
            "artifact would serve only some processes"
        )
    # Merge: for a path more than one worker wrote, the first (by config id, then device) wins: deterministic.
    sources: dict[str, Path] = {}
    owners: dict[str, set[str]] = {}  # what each file was made for: the artifact's parts (installed by signature)
    for o in built:
        assert o.cache_dir is not None
        for rel, p in art.scan_tree(o.cache_dir).items():
            sources.setdefault(rel, p)
            owners.setdefault(rel, set()).add(mf.owner(o.config.id, o.device_index))
    manifest = mf.Manifest(
        name=mf.artifact_name(recipe.name, key.tag if shard is None else f"{key.tag}.shard-{shard[0]}-of-{shard[1]}"),
        created=mf.created_now(),
        recipe={**recipe.normalized, "sha256": recipe.sha256},
        configs=_built_configs(built),
        failed=tuple(mf.FailedConfig(config=o.config, device=o.device_index, error=o.message) for o in failed),
        build_key=key,
        files={e.path: e for e in art.hash_files(sources)},
        shard=None if shard is None else f"{shard[0]}/{shard[1]}",
        key_settings=built[0].key_settings,
    )
    return art.pack(out_dir / manifest.name, manifest, sources, owners=owners, level=level)


def _built_configs(built: list[ConfigOutcome]) -> tuple[mf.BuiltConfig, ...]:
    """One manifest entry per config, listing the device indices it was built and checked on."""
    by_id: dict[str, list[ConfigOutcome]] = {}
    for o in built:
        by_id.setdefault(o.config.id, []).append(o)
    entries = []
    for outs in by_id.values():
        mask_keys = {(o.mask_key, o.mask_free, o.marks) for o in outs}
        if len(mask_keys) != 1:  # a factory that returns another mask per process would never hit
            raise BuildError(f"config {outs[0].config.describe()}: its mask differs between workers: {mask_keys}")
        mask, free, marks = mask_keys.pop()
        score_keys = {o.score_key for o in outs}
        if len(score_keys) != 1:
            raise BuildError(f"config {outs[0].config.describe()}: its score_mod differs between workers: {score_keys}")
        entries.append(
            mf.BuiltConfig(
                config=outs[0].config,
                devices=tuple(o.device_index for o in outs),
                mask_key=mask,
                mask_free=free,
                marks=marks,
                score_key=score_keys.pop(),
                compile_seconds=round(max(o.seconds for o in outs), 3),
                compile_seconds_by_device=tuple((o.device_index, round(o.seconds, 3)) for o in outs),
                max_rel_error=max((e for o in outs for e in o.errors.values()), default=0.0),
                precompiled=tuple(
                    # a graph of the config's own (the manifest's reader checks it again)
                    mf.Precompiled(device=o.device_index, graph=g, path=f.path, sha256=f.sha256, seconds=f.seconds)
                    for o in outs
                    for g in o.config.graphs
                    if (f := o.functions.get(g)) is not None
                ),
                not_precompiled="; ".join(sorted({o.not_precompiled for o in outs if o.not_precompiled})),
            )
        )
    return tuple(entries)


def shard_configs(configs: Sequence[Config], shard: tuple[int, int] | None) -> list[Config]:
    if shard is None:
        return list(configs)
    i, n = shard
    if not (n >= 1 and 1 <= i <= n):
        raise KernelpackError(f"bad shard {i}/{n}", hint="--shard I/N with 1 <= I <= N, e.g. --shard 2/4")
    picked = sorted(configs, key=lambda c: c.id)[i - 1 :: n]
    if not picked:
        raise KernelpackError(f"shard {i}/{n} of {len(configs)} config(s) is empty", hint="use fewer shards")
    return picked


def _build_one(payload: dict[str, Any]) -> dict[str, Any]:
    """The worker: one config in this (fresh) process: canonical call, reference check, counters."""
    config = Config.from_dict(payload["config"])
    index = int(payload["device_index"])
    evidence.install_hooks()
    device = "cpu" if config.device == "cpu" else f"cuda:{index}"
    if config.device == "cuda":
        import torch

        torch.cuda.set_device(index)
    before = evidence.snapshot()
    lengths = range_lengths(config, 2, seed=int(config.id, 16))
    unsafe = rows_guaranteed_safe_problem(config, device, lengths)
    if unsafe:  # refused before compiling: the kernel would be shipped computing NaN (its reference is not Triton's)
        return WorkerResult(problem=unsafe, build_key=probe(config.device, index).to_dict()).to_dict()
    # a dynamic config's graph: symbolic in what differs between the ends of its ranges, static in the rest
    marks = canonical_marks(config, device)
    with marking(marks):
        call = run_config(config, device, lengths=lengths)
    problem = check_errors(config, call.errors)
    # which of the mask's values the dynamic graph keeps symbolic, as its own guards say: they enter its key by type
    bm = block_mask_for(config, device)  # the canonical BlockMask, once: its guards' free values and its key
    free = _free_values(config, device, bm) if config.dynamic else ()
    pinned = _pinned_varying(config, free)
    if pinned:
        problem = f"{problem}; {pinned}" if problem else pinned
    retraced = call.lengths_counters.get("frames.ok", 0)
    if retraced or evidence.compiled_anything(call.lengths_counters):
        range_problem = (
            f"its dynamic graph does not serve the whole range: at lengths {call.lengths} Dynamo traced {retraced} "
            f"more graph(s) ({', '.join(evidence.compiled_anything(call.lengths_counters)) or 'cache hits'})"
        )
        problem = f"{problem}; {range_problem}" if problem else range_problem
    counters = evidence.delta(before, evidence.snapshot())  # tier 1's compile, as before tier 2
    functions, missing = _precompile(config, device, index, marks) if not problem else ({}, "not built")
    return WorkerResult(
        seconds=call.seconds,
        errors=dict(call.errors),
        counters=counters,
        build_key=probe(config.device, index).to_dict(),
        mask_key=mask_key(bm.mask_mod, free),
        mask_free=tuple(free),
        marks=tuple(marks),
        score_key=call.score_key,
        key_settings=key_settings(config.device),
        problem=problem or "",
        functions=functions,
        missing=missing,
    ).to_dict()


def _pinned_varying(config: Config, free: tuple[str, ...]) -> str:
    """Why the dynamic graph does not serve the recipe's range: a closure int that varies over it (an expression of a
    length that varies, or an "example" of values the job made) which the graph's guards pin to one value (Python
    control flow on it, a 0/1 value). "" when none is."""
    ref = config.reference("mask")
    if not config.dynamic or ref is None:
        return ""
    ranged = {n for n, r in (("q_len", config.q_range), ("kv_len", config.kv_range)) if r and r[0] != r[1]}
    pinned = [
        p
        for p, expr in closures.varying(ref).items()
        if ".shape[" not in p and p not in free and (expr == "example" or any(n in expr for n in ranged))
    ]
    if not pinned:
        return ""
    return (
        f"torch's dynamic graph is guarded on the value of the mask's {', '.join(pinned)} (Python control flow on "
        "it, or a value of 0 or 1), which varies over the recipe's range: one graph would serve one value; record "
        "with --lengths MIN:MAX:MULTIPLE for a static graph per bucket"
    )


def _free_values(config: Config, device: str, bm: Any) -> tuple[str, ...]:
    """The mask's closure values that every built graph's guards leave free (:func:`compiled.free_mask_values`),
    asked of the entries the canonical calls made; () when an entry is not found (then every value is a key)."""
    import torch

    from .canonical import arguments, make_inputs

    free: set[str] | None = None
    for graph in config.graphs:
        with torch.set_grad_enabled(graph == "fwd+bwd"):
            args = arguments(config, make_inputs(config, device, graph, random=False), bm)
            found = free_mask_values(args, config.mode, True)
        if found is None:
            return ()
        free = set(found) if free is None else free & set(found)
    return tuple(sorted(free or ()))


def _precompile(
    config: Config, device: str, index: int, marks: tuple[str, ...]
) -> tuple[dict[str, BuiltFunction], str]:
    """Tier 2: each graph's canonical call aot-compiled (after tier 1's compile, whose inductor cache it
    reuses) and saved into this worker's cache dir, so packed and hashed with tier 1's files. Returns each graph's
    function and why some graph has none; a failure here leaves tier 1 serving the graph."""
    from . import precompiled, settings
    from .canonical import arguments, make_inputs
    from .masks import block_mask_for

    reason = precompiled.unavailable()
    if reason is None and not settings.precompile_at_build():
        reason = "built with KERNELPACK_PRECOMPILE=0"
    if reason is not None:
        return {}, reason
    cache = settings.inductor_cache_dir()
    assert cache is not None  # the builder gives every worker its own
    graphs: dict[str, BuiltFunction] = {}
    missing = []
    bm = block_mask_for(config, device)
    for graph in config.graphs:
        start = time.perf_counter()
        try:
            args = arguments(config, make_inputs(config, device, graph, random=False), bm)
            # traced as tier 1 was (dynamic=True of a fixed length too), so that it reuses tier 1's cache entries
            with trace_settings(config.dynamic, args, marks):
                fn = precompiled.compile_call(args, grad=graph == "fwd+bwd", mode=config.mode, dynamic=config.dynamic)
            blob = precompiled.dumps(fn)
        except Exception as e:  # tier 1 serves the graph; the manifest says why tier 2 does not
            missing.append(f"{graph} on device {index}: aot_compile failed: {type(e).__name__}: {e}"[:500])
            continue
        outside = _outside_guards(fn, config, device, graph)
        if outside is not None:  # a range its guards do not hold over: tier 1's dynamic graph serves it
            missing.append(f"{graph} on device {index}: its guards do not hold at q_len, kv_len {outside}")
            continue
        sha = hashlib.sha256(blob).hexdigest()
        rel = precompiled.file_name(config.id, index, graph, sha)
        (Path(cache) / rel).parent.mkdir(parents=True, exist_ok=True)
        _fs.write_bytes(Path(cache) / rel, blob)
        graphs[graph] = BuiltFunction(rel, sha, round(time.perf_counter() - start, 3))
    return graphs, "; ".join(missing)


def _outside_guards(fn: Any, config: Config, device: str, graph: Graph) -> tuple[int, int] | None:
    """For a dynamic range config: the first of the lengths the builder checks tier 1 at (both ends, 2 random ones)
    where the aot-compiled function's guards fail, or None (a fixed-length config: None)."""
    import torch

    from . import precompiled
    from .canonical import arguments, make_inputs
    from .masks import block_mask_for

    for q, kv in range_lengths(config, 2, seed=int(config.id, 16)):
        at = config.at(q, kv)
        with torch.set_grad_enabled(graph == "fwd+bwd"):
            args = arguments(at, make_inputs(at, device, graph, random=False), block_mask_for(at, device))
            if not precompiled.guards_pass(fn, args):
                return q, kv
    return None


if __name__ == "__main__":
    sys.exit(_worker.child_main(_build_one, sys.argv[1:]))
