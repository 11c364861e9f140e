"""The ``kernelpack`` command: thin click commands, each calling one library function.

One error boundary: a :class:`KernelpackError` prints ``error:`` and ``hint:`` lines and exits 1; tracebacks only
with ``-v`` or ``KERNELPACK_DEBUG=1``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import click

from . import __version__
from .build import BuildProgress, ConfigOutcome
from .errors import KernelpackError


class _Progress(BuildProgress):
    """One line per finished config: count, outcome, compile time, elapsed and ETA (CI logs stay readable)."""

    def __init__(self) -> None:
        self.total = self.done = 0
        self.start_t = time.perf_counter()

    def start(self, total: int) -> None:
        self.total, self.start_t = total, time.perf_counter()
        click.echo(f"building {total} config(s)", err=True)

    def config_done(self, outcome: ConfigOutcome) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start_t
        eta = elapsed / self.done * (self.total - self.done)
        status = "ok  " if outcome.ok else "FAIL"
        click.echo(
            f"[{self.done:>{len(str(self.total))}}/{self.total}] {status} {outcome.seconds:6.1f}s "
            f"{outcome.config.describe()}  elapsed {_hms(elapsed)} eta {_hms(eta)}",
            err=True,
        )


def _parse_devices(text: str) -> list[int]:
    try:
        return [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a comma-separated list of GPU indices", param_hint="--devices"
        ) from None


def _hms(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


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
def cli(ctx: click.Context, verbose: bool) -> None:
    """Build once, ship, install and prove precompiled torch.compile(flex_attention) caches."""
    ctx.obj = {"verbose": verbose or os.environ.get("KERNELPACK_DEBUG") == "1"}


@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out_dir", default=".", show_default=True, help="Directory for the artifact.")
@click.option("-j", "--jobs", default=1, show_default=True, help="Configs compiled in parallel on the device.")
@click.option("--keep-going", is_flag=True, help="Ship the configs that built; list the failed ones in the manifest.")
@click.option(
    "--devices",
    default="0",
    show_default=True,
    help="CUDA device indices to build every config on, e.g. 0,1,2 (one process driving several GPUs).",
)
@click.option("--level", default=10, show_default=True, help="zstd level.")
@click.option("--timeout", default=1800.0, show_default=True, help="Seconds allowed per config.")
def build(recipe: str, out_dir: str, jobs: int, keep_going: bool, devices: str, level: int, timeout: float) -> None:
    """Compile RECIPE's configs and pack the caches into one .kpack artifact."""
    from .build import build as run_build

    result = run_build(
        recipe,
        out_dir,
        jobs=jobs,
        keep_going=keep_going,
        devices=_parse_devices(devices),
        level=level,
        timeout=timeout,
        progress=_Progress(),
    )
    assert result.artifact is not None and result.manifest is not None
    m = result.manifest
    click.echo(
        f"wrote {result.artifact} ({_size(result.artifact.stat().st_size)}; {len(m['files'])} files, "
        f"{_size(m['total_size'])} expanded) in {result.seconds:.1f} s"
    )
    if result.failed:
        click.echo(f"warning: {len(result.failed)} config(s) failed and are listed in the manifest", err=True)


@cli.command()
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect(artifact: str, as_json: bool) -> None:
    """Show an artifact's manifest without extracting it (does not import torch)."""
    from .artifact import read_manifest

    m = read_manifest(artifact).data
    if as_json:
        click.echo(json.dumps(m, indent=1, sort_keys=True))
        return
    total = sum(f["size"] for f in m["files"])
    click.echo(f"{m['name']}  (format {m['format']}, kernelpack {m.get('kernelpack_version', '?')})")
    click.echo(f"recipe: {m['recipe'].get('name')}  sha256 {m['recipe'].get('sha256', '?')[:16]}")
    click.echo(
        f"artifact: {_size(os.path.getsize(artifact))} compressed, {len(m['files'])} files, {_size(total)} expanded"
    )
    click.echo("build key:")
    for k, v in m["build_key"].items():
        click.echo(f"  {k:14} {v}")
    click.echo(f"devices: {m.get('devices', [m.get('device_index', 0)])}")
    click.echo(f"configs ({len(m['configs'])}):")
    from .recipe import Config

    for c in m["configs"]:
        on = f"  devices {c['devices']}" if "devices" in c else ""
        click.echo(f"  {Config.from_dict(c['params']).describe()}  compile {c.get('compile_seconds', 0):.1f}s{on}")
    for c in m.get("failed", []):
        click.echo(f"  FAILED {c['id']} (device {c.get('device', '?')}): {c.get('error', '')}")


@cli.command()
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.option("--cache-dir", default=None, help="Target (default: TORCHINDUCTOR_CACHE_DIR or torch's default).")
@click.option("--allow-mismatch", is_flag=True, help="Install even if built for another torch/GPU (warns).")
@click.option("--device-index", default=0, show_default=True, help="CUDA device whose name is compared.")
def install(artifact: str, cache_dir: str | None, allow_mismatch: bool, device_index: int) -> None:
    """Install ARTIFACT into a TorchInductor cache directory (verified, atomic, idempotent)."""
    from .install import install as run_install

    r = run_install(artifact, cache_dir, allow_mismatch=allow_mismatch, device_index=device_index, set_env=False)
    if r.noop:
        click.echo(f"already installed in {r.cache_dir} ({r.files} files; {r.seconds:.2f} s)")
    else:
        click.echo(
            f"installed {r.written} files ({_size(r.bytes_written)}) into {r.cache_dir} in {r.seconds:.2f} s"
            f"; {r.present} already present, {r.kept} existing entries kept"
        )


@cli.command()
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON.")
@click.option("--seed", type=int, default=None, help="Seed of the shuffled config order.")
@click.option("--check", is_flag=True, help="Also compare outputs with the float64 reference.")
@click.pass_context
def verify(ctx: click.Context, artifact: str, as_json: bool, seed: int | None, check: bool) -> None:
    """Prove ARTIFACT: in a fresh process, install it and check every config's first call compiles nothing."""
    from .verify import verify as run_verify

    report = run_verify(artifact, seed=seed, check=check)
    data = report.data
    if as_json:
        click.echo(json.dumps(data, indent=1))
        return
    t = data["totals"]
    click.echo(
        f"verified {len(data['configs'])} config(s) in shuffled order (seed {data['seed']}): "
        f"fxgraph hits {t['inductor.fxgraph_cache_hit']} misses {t['inductor.fxgraph_cache_miss']}, "
        f"autograd hits {t['aot_autograd.autograd_cache_hit']} misses {t['aot_autograd.autograd_cache_miss']}, "
        f"triton compiled {t['triton_compiled']}, c++ compiled {t['cpp_compiled']}, dense calls "
        f"{t['dense_calls']}"
    )
    click.echo(f"install {data['install_seconds']:.2f} s, first calls {data['first_step_seconds']:.2f} s in total")
    if data.get("triton_detection", "").startswith("unavailable"):
        click.echo(f"warning: Triton compiles could not be observed: {data['triton_detection']}", err=True)
    if ctx.obj["verbose"]:
        for c in data["configs"]:
            click.echo(f"  {c['describe']}: {c['seconds']:.2f} s")


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    click.echo(f"warning: {message}", err=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (testable with click's CliRunner or directly)."""
    verbose = os.environ.get("KERNELPACK_DEBUG") == "1" or any(a in ("-v", "--verbose") for a in (argv or sys.argv))
    warnings.showwarning = _show_warning
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name="kernelpack", standalone_mode=False)
    except KernelpackError as e:
        if verbose:
            raise
        click.echo(f"error: {e}", err=True)
        if e.hint:
            click.echo(f"hint: {e.hint}", err=True)
        return 1
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
