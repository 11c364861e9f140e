"""The ``kernelpack`` command: thin click commands, each calling one library function.

One error boundary: a :class:`KernelpackError` prints ``error:`` and ``hint:`` lines and exits 1; tracebacks only
with ``-v`` or ``KERNELPACK_DEBUG=1``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import click

from . import settings
from ._version import __version__
from .errors import KernelpackError, printable

if TYPE_CHECKING:
    from .manifest import Manifest


def _parse_devices(text: str) -> list[int]:
    try:
        return [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a comma-separated list of GPU indices", param_hint="--devices"
        ) from None


def _parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    i, sep, n = text.partition("/")
    if not (sep and i.isdigit() and n.isdigit()):
        raise click.BadParameter(f"{text!r} is not I/N, e.g. 2/4", param_hint="--shard")
    return int(i), int(n)


def _storage_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``key=value`` pairs for fsspec; values that parse as JSON (numbers, true/false, objects) are decoded."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not key=value", param_hint="--storage-option")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


_storage_option = click.option(
    "--storage-option",
    "storage_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="fsspec storage option, e.g. endpoint_url=http://127.0.0.1:9000 (repeatable).",
)


def _needs_torch(command: str) -> None:
    """inspect, ls, push, merge and lock work without torch (a CI publish job need not install it); the commands that
    compile, probe the build key or install say so plainly instead of failing deep inside with an ImportError."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise KernelpackError(
            f"`kernelpack {command}` needs torch, which is not installed for {sys.executable}",
            hint="install the torch build you train with (pip install torch==...); inspect, ls, push, merge and lock "
            "work without it",
        )


def _echo(text: str) -> None:
    """A line that holds names read from an artifact or a registry: control characters escaped."""
    click.echo(printable(text))


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kernelpack")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks and per-config details.")
@click.pass_context
def commands(ctx: click.Context, verbose: bool) -> None:
    """Build once, ship, install and prove precompiled torch.compile(flex_attention) caches."""
    ctx.obj = {"verbose": verbose or settings.debug()}


def _progress_options(f: Any) -> Any:
    f = click.option(
        "--progress",
        type=click.Choice(["auto", "live", "plain", "jsonl"]),
        default="auto",
        show_default=True,
        help="auto: a live table on a terminal, plain lines otherwise; jsonl: one JSON object per event (stderr).",
    )(f)
    return click.option("-q", "--quiet", is_flag=True, help="No progress output; errors and the result only.")(f)


@commands.command(name="build")
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out_dir", default=".", show_default=True, help="Directory for the artifact.")
@click.option(
    "-j", "--jobs", default=1, show_default=True, type=click.IntRange(min=1), help="Configs compiled in parallel."
)
@click.option("--keep-going", is_flag=True, help="Ship the configs that built; list the failed ones in the manifest.")
@click.option(
    "--devices",
    default="0",
    show_default=True,
    help="CUDA device indices to build every config on, e.g. 0,1,2 (one process driving several GPUs).",
)
@click.option("--shard", default=None, metavar="I/N", help="Build the I-th of N deterministic slices (CI shards).")
@click.option("--level", default=10, show_default=True, type=click.IntRange(1, 22), help="zstd level.")
@click.option(
    "--timeout",
    default=1800.0,
    show_default=True,
    type=click.FloatRange(0, 7 * 24 * 3600, min_open=True),
    callback=lambda ctx, param, value: _finite(param, value),
    help="Seconds allowed per config.",
)
@_progress_options
def build_cmd(
    recipe: str,
    out_dir: str,
    jobs: int,
    keep_going: bool,
    devices: str,
    shard: str | None,
    level: int,
    timeout: float,
    progress: str,
    quiet: bool,
) -> None:
    """Compile RECIPE's configs and pack the caches into one .kpack artifact."""
    _needs_torch("build")
    from ._render import build_progress
    from .build import build_recipe

    shown = build_progress("none" if quiet else progress)
    try:
        result = build_recipe(
            recipe,
            out_dir,
            jobs=jobs,
            keep_going=keep_going,
            devices=_parse_devices(devices),
            shard=_parse_shard(shard),
            level=level,
            timeout=timeout,
            progress=shown,
        )
    finally:
        shown.close()
    assert result.artifact is not None and result.manifest is not None
    m = result.manifest
    click.echo(
        f"wrote {result.artifact} ({_size(result.artifact.stat().st_size)}; {len(m.files)} files, "
        f"{_size(m.total_size)} expanded) in {result.seconds:.1f} s"
    )
    if result.failed:
        click.echo(f"warning: {len(result.failed)} config(s) failed and are listed in the manifest", err=True)
    _warn_not_precompiled(m)


def _warn_not_precompiled(m: Manifest) -> None:
    """A build whose tier 2 failed still works (the inductor cache serves every call), so it must say so: on the
    H200 a torch-version difference once left every graph without its function and nothing told."""
    graphs = sum(len(c.config.graphs) * len(c.devices) for c in m.configs)
    missing = graphs - sum(len(c.precompiled) for c in m.configs)
    if missing:
        reasons = list(dict.fromkeys(c.not_precompiled for c in m.configs if c.not_precompiled))
        click.echo(
            f"warning: {missing} of {graphs} graph(s) have no precompiled function (tier 2), the inductor cache will "
            f"serve them: {reasons[0] if reasons else 'no reason recorded'}"
            + (f" (and {len(reasons) - 1} other reason(s): kernelpack inspect --json)" if len(reasons) > 1 else ""),
            err=True,
        )


@commands.command(name="inspect")
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@click.option(
    "--verify", "check", is_flag=True, help="Also read every member and check its size and sha256 (no torch)."
)
def inspect_cmd(artifact: str, as_json: bool, check: bool) -> None:
    """Show an artifact's manifest without extracting it (does not import torch)."""
    from .artifact import check_members, read_manifest
    from .manifest import FORMAT_VERSION

    checked = check_members(artifact) if check else None  # raises naming the first bad member: nothing printed
    m = checked.manifest if checked is not None else read_manifest(artifact)
    if as_json:
        click.echo(json.dumps(m.to_dict(), indent=1, sort_keys=True))
        return
    _echo(f"{m.name}  (format {FORMAT_VERSION}, kernelpack {m.kernelpack_version})")
    _echo(f"recipe: {m.recipe_name}  sha256 {str(m.recipe.get('sha256', '?'))[:16]}")
    click.echo(
        f"artifact: {_size(os.path.getsize(artifact))} compressed, {len(m.files)} files, {_size(m.total_size)} expanded"
    )
    if m.parts:  # what a start installs: the parts of the signatures it calls
        largest = max(sum(m.files[rel].size for rel in p.files) for p in m.parts)
        _echo(f"parts: {len(m.parts)} (a job installs those of the signatures it calls; largest {_size(largest)})")
    _echo("build key:")
    for k, v in m.build_key.to_dict().items():
        _echo(f"  {k:14} {v}")
    # a CPU build has one device, whose index (always 0) means nothing to the user: the JSON keeps it
    cpu = m.build_key.device_type == "cpu"
    _echo(f"devices: {'cpu' if cpu else list(m.devices)}")
    _echo(f"configs ({len(m.configs)}):")
    for c in m.configs:
        tier2 = f"{len(c.precompiled)}/{len(c.config.graphs) * len(c.devices)}"
        devices = "" if cpu else f"  devices {list(c.devices)}"
        _echo(f"  {c.config.describe()}  compile {c.compile_seconds:.1f}s{devices}  tier 2 {tier2}")
        if c.not_precompiled:
            _echo(f"    not precompiled: {c.not_precompiled}")
    for f in m.failed:
        _echo(f"  FAILED {f.config.id}" + ("" if cpu else f" (device {f.device})") + f": {f.error}")
    if checked is not None:
        click.echo(f"verified {checked.members} members ({_size(checked.size)}) against the manifest")
    else:
        click.echo("read the manifest only; `kernelpack inspect --verify` checks every member's hash")


_device_index_option = click.option(
    "--device-index",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="CUDA device whose name is compared.",
)


@commands.command(name="install")
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.option("--cache-dir", default=None, help="Target (default: TORCHINDUCTOR_CACHE_DIR or torch's default).")
@click.option("--allow-mismatch", is_flag=True, help="Install even if built for another torch/GPU (warns).")
@_device_index_option
def install_cmd(artifact: str, cache_dir: str | None, allow_mismatch: bool, device_index: int) -> None:
    """Install ARTIFACT into a TorchInductor cache directory (verified, atomic, idempotent)."""
    _needs_torch("install")
    from .installer import install_artifact

    r = install_artifact(artifact, cache_dir, allow_mismatch=allow_mismatch, device_index=device_index)
    if r.noop:
        click.echo(f"already installed in {r.cache_dir} ({r.files} files; {r.seconds:.2f} s)")
    else:
        click.echo(
            f"installed {r.written} files ({_size(r.bytes_written)}) into {r.cache_dir} in {r.seconds:.2f} s"
            f"; {r.present} already present, {r.kept} existing entries kept"
        )


@commands.command(name="verify")
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON.")
@click.option("--seed", type=int, default=None, help="Seed of the shuffled config order.")
@click.option("--check", is_flag=True, help="Also compare outputs with the float64 reference.")
@_progress_options
@click.pass_context
def verify_cmd(
    ctx: click.Context, artifact: str, as_json: bool, seed: int | None, check: bool, progress: str, quiet: bool
) -> None:
    """Prove ARTIFACT: in a fresh process, install it and check every config's first call compiles nothing."""
    _needs_torch("verify")
    from ._render import VerifyRender, step_summary
    from .errors import VerifyError
    from .verify import verify_artifact

    shown = VerifyRender("none" if quiet or as_json else progress)
    summary = settings.github_step_summary()  # GitHub Actions: the job's summary page gets the table
    try:
        report = verify_artifact(artifact, seed=seed, check=check, progress=shown)
    except VerifyError as e:
        if summary and e.report is not None:
            step_summary(summary, e.report, artifact)
        if as_json and e.report is not None:  # the counters of a failed verify are what the user needs
            click.echo(json.dumps(e.report.to_dict(), indent=1))
        raise
    finally:
        shown.close()
    if summary:
        step_summary(summary, report, artifact)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=1))
        return
    t = report.totals
    click.echo(
        f"verified {len(report.configs)} config(s) in shuffled order (seed {report.seed}): "
        f"fxgraph hits {t.get('inductor.fxgraph_cache_hit', 0)} misses {t.get('inductor.fxgraph_cache_miss', 0)}, "
        f"autograd hits {t.get('aot_autograd.autograd_cache_hit', 0)} misses "
        f"{t.get('aot_autograd.autograd_cache_miss', 0)}, triton compiled {t.get('triton_compiled', 0)}, c++ compiled "
        f"{t.get('cpp_compiled', 0)}, dense calls {t.get('dense_calls', 0)}"
    )
    click.echo(f"install {report.install_seconds:.2f} s, first calls {report.first_step_seconds:.2f} s in total")
    graphs = [t for c in report.configs for t in c.tiers.values()]
    tier1 = sorted({t.why for t in graphs if t.tier != "precompiled"})
    click.echo(
        f"{report.precompiled} of {len(graphs)} graph(s) served by precompiled functions (tier 2)"
        + (f"; the inductor cache serves the rest: {'; '.join(tier1)}" if tier1 else "")
    )
    if check:  # the per-config reference errors, the numbers --check adds
        click.echo("reference check (max. relative error against float64, per graph):")
        for c in report.configs:
            errors = ", ".join(f"{g} {e:.2e}" for g, e in sorted(c.errors.items()))
            _echo(f"  {c.describe}: {errors or 'not computed'}")
    if ctx.obj["verbose"]:
        for c in report.configs:
            _echo(f"  {c.describe}: {c.seconds:.2f} s ({', '.join(f'{g} {t.tier}' for g, t in c.tiers.items())})")


@commands.command(name="merge")
@click.argument("artifacts", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out_dir", default=".", show_default=True, help="Directory for the merged artifact.")
def merge_cmd(artifacts: tuple[str, ...], out_dir: str) -> None:
    """Combine shards of one recipe built for the same torch build into one artifact."""
    from .artifact import merge

    path, m = merge(artifacts, out_dir)
    click.echo(f"wrote {path} ({len(m.configs)} configs from {len(artifacts)} artifacts)")


def _finite(param: click.Parameter, value: float) -> float:
    # FloatRange lets nan through (every comparison with it is false), and nan seconds would mean no timeout
    if value != value:
        raise click.BadParameter(f"{value} is not a number of seconds", param=param)
    return value


@commands.command(name="push")
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.argument("registry")
@click.option("--force", is_flag=True, help="Replace a different artifact already published for this build.")
@_storage_option
def push_cmd(artifact: str, registry: str, force: bool, storage_options: tuple[str, ...]) -> None:
    """Publish ARTIFACT to REGISTRY (payload first, entry and index last)."""
    from .store import Registry

    entry, status, created = Registry(registry, _storage_options(storage_options)).push(artifact, force=force)
    if created:
        _echo(f"created new registry {registry}")
    click.echo(f"{status}: {registry.rstrip('/')}/{entry.path} (sha256 {entry.sha256[:16]}…, {_size(entry.size)})")
    if status == "rebuild":
        click.echo(
            "  a rebuild of the published artifact (same recipe, build key and configs; torch's files differ in "
            "compile timings): the published one stays, and the locks that pin it; --force publishes this one"
        )


@commands.command(name="ls")
@click.argument("registry")
@click.option("--recipe", default=None, help="Only this recipe.")
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
@_storage_option
def ls_cmd(registry: str, recipe: str | None, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """List the artifacts in REGISTRY."""
    from dataclasses import asdict

    from .store import Registry

    entries = Registry(registry, _storage_options(storage_options)).entries(recipe)
    if as_json:
        click.echo(json.dumps([asdict(e) for e in entries], indent=1))
        return
    rows = [("recipe", "torch", "commit", "device", "size", "created", "path")]
    for e in entries:
        k = e.key
        device = k.gpu_name if k.device_type == "cuda" else k.device_type
        created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(e.created))
        rows.append((e.recipe, k.torch_version, k.torch_git[:12], device, _size(e.size), created, e.path))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        _echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


@commands.command(name="pull")
@click.argument("registry")
@click.option("--recipe", required=True, help="Recipe name.")
@click.option("--install", "do_install", is_flag=True, help="Install into the cache dir after downloading.")
@click.option("--cache-dir", default=None, help="Install target (default: TORCHINDUCTOR_CACHE_DIR or torch's).")
@click.option("--lock", "lock_file", default=None, type=click.Path(dir_okay=False), help="Only the pinned artifact.")
@_device_index_option
@_storage_option
def pull_cmd(
    registry: str,
    recipe: str,
    do_install: bool,
    cache_dir: str | None,
    lock_file: str | None,
    device_index: int,
    storage_options: tuple[str, ...],
) -> None:
    """Download the artifact of RECIPE built for this environment (once per node), optionally install it."""
    _needs_torch("pull")
    from .installer import install_artifact
    from .store import pull

    r = pull(
        registry,
        recipe,
        lock=lock_file,
        storage_options=_storage_options(storage_options),
        device_index=device_index,
    )
    click.echo(f"{'downloaded' if r.downloaded else 'cached'}: {r.entry.path} -> {r.path}")
    if do_install:
        i = install_artifact(r.path, cache_dir, device_index=device_index, sha256=r.entry.sha256)
        click.echo(f"{'already installed' if i.noop else f'installed {i.written} files'} in {i.cache_dir}")


@commands.command(name="lock")
@click.argument("registry")
@click.option("--recipe", required=True, help="Recipe name.")
@click.option("-o", "--out", default="kernelpack.lock", show_default=True, help="Lock file to write.")
@_storage_option
def lock_cmd(registry: str, recipe: str, out: str, storage_options: tuple[str, ...]) -> None:
    """Pin every build of RECIPE in REGISTRY (artifact path and sha256 per build key)."""
    from .store import Registry, write_lock

    lock = write_lock(Registry(registry, _storage_options(storage_options)), recipe, out)
    click.echo(f"wrote {out}: {len(lock.pins)} pinned build(s) of {recipe}")


def _factory_pairs(pairs: tuple[str, ...], option: str) -> dict[str, str]:
    table = {}
    for pair in pairs:
        qualname, sep, factory = pair.partition("=")
        if not sep or not qualname or ":" not in factory:
            raise click.BadParameter(f"{pair!r} is not QUALNAME=pkg.module:factory", param_hint=option)
        table[qualname] = factory
    return table


@commands.command(name="record", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-o", "--out", required=True, help="The recipe to write (TOML).")
@click.option("--name", default=None, help="The recipe's name (default: the file's stem).")
@click.option(
    "--compute",
    type=click.Choice(["skip", "compile"]),
    default="skip",
    show_default=True,
    help="skip: kernelpack's calls return zeros and compile nothing; compile: the real calls.",
)
@click.option("--mask-factory", multiple=True, metavar="QUALNAME=MOD:FACTORY", help="Name a mask by its factory.")
@click.option("--score-factory", multiple=True, metavar="QUALNAME=MOD:FACTORY", help="Name a score_mod by its factory.")
@click.option(
    "--lengths",
    default=None,
    metavar="MIN:MAX[:MULTIPLE]",
    help="The range for lengths that varied (default: 1/2 the smallest to 2x the largest seen); MULTIPLE: static "
    "buckets instead of one dynamic graph.",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def record_cmd(
    out: str,
    name: str | None,
    compute: str,
    mask_factory: tuple[str, ...],
    score_factory: tuple[str, ...],
    lengths: str | None,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND (after --) and write the recipe of every flex_attention call it made."""
    from .recipe_writer import Lengths
    from .record import Factories, record_command

    factories = Factories(
        _factory_pairs(mask_factory, "--mask-factory"), _factory_pairs(score_factory, "--score-factory")
    )
    spans = Lengths.parse(lengths) if lengths is not None else None  # before the job runs
    result = record_command(command, out, compute=compute, name=name, factories=factories, lengths=spans)
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(
        f"wrote {result.recipe}: {result.calls} call(s) from {result.processes} process(es) in {result.seconds:.1f} s; "
        f"build it with: kernelpack build {result.recipe}"
    )


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    click.echo(f"warning: {printable(str(message))}", err=True)


def _hoist_verbose(args: list[str]) -> list[str]:
    """``kernelpack verify -v`` means ``kernelpack -v verify``: -v is the group's option, and the hints tell users
    to add it to the command they ran. Not past ``--`` or inside ``record``'s command, which keeps its own -v."""
    head = args[: args.index("--")] if "--" in args else args
    if "record" in head:
        head = head[: head.index("record")]
    hoisted = [a for a in head if a in ("-v", "--verbose")]
    if not hoisted:
        return args
    rest = list(args)
    for a in hoisted:
        rest.remove(a)
    return ["-v", *rest]


def _usage_hint(e: click.UsageError) -> str:
    command = e.ctx.command_path if e.ctx is not None else "kernelpack"
    if "unexpected extra argument" in e.format_message():
        return (
            f"{command} takes one path per argument; a shell glob that matched several files (shards too) gives "
            f"extra arguments: name one file. See {command} --help"
        )
    return f"see {command} --help"


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived. Raised in the main thread, as ^C raises KeyboardInterrupt, so that every
    ``finally`` on the way out runs: build's workers are killed with their sessions, record's command is stopped,
    temp and work directories are removed. (Python's default for SIGTERM ends the process at once, skipping
    them.)"""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_as_exceptions() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Terminated(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (testable with click's CliRunner or directly)."""
    args = _hoist_verbose(list(argv) if argv is not None else sys.argv[1:])
    verbose = settings.debug() or args[:1] == ["-v"] or args[:1] == ["--verbose"]
    warnings.showwarning = _show_warning
    # torch's import warns "Failed to initialize NumPy" when numpy is not installed; kernelpack never hands torch a
    # numpy array (numpy is not a dependency), so for a CLI user it is only noise. Set before any command imports torch.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    try:
        with _signals_as_exceptions():
            commands.main(args=args, prog_name="kernelpack", standalone_mode=False)
    except Terminated as e:  # SIGTERM, SIGHUP: everything kernelpack started was stopped on the way out
        click.echo(f"terminated ({signal.Signals(e.signum).name})", err=True)
        return 128 + e.signum
    except click.UsageError as e:  # documented as error:/hint: and exit 1, like every other error
        if type(e).__name__ == "NoArgsIsHelpError":  # click >= 8.2 raises it for a bare `kernelpack`: just help
            click.echo(e.ctx.get_help() if e.ctx is not None else "")
            return 0
        click.echo(f"error: {printable(e.format_message())}", err=True)
        click.echo(f"hint: {printable(_usage_hint(e))}", err=True)
        return 1
    except KernelpackError as e:
        if verbose:
            raise
        click.echo(f"error: {printable(e.message)}", err=True)
        if e.hint:
            click.echo(f"hint: {printable(e.hint)}", err=True)
        return 1
    except OSError as e:  # the one boundary for what the filesystem or the network says: unreadable or over-long
        # paths, a full disk, a refused connection. The stages wrap what they expect; this is for the rest
        if verbose:
            raise
        what = f"{e.strerror or type(e).__name__}" + (f": {os.fsdecode(e.filename)}" if e.filename else "")
        click.echo(f"error: {printable(what if e.strerror else f'{type(e).__name__}: {e}')}", err=True)
        click.echo("hint: check the path, its permissions and free space; -v shows where it happened", err=True)
        return 1
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as e:  # a file click could not open, and the like
        click.echo(f"error: {printable(e.format_message())}", err=True)
        return 1
    except click.exceptions.Exit as e:
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
