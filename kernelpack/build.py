"""``kernelpack build``: compile every config of a recipe in isolated workers and pack the caches into one artifact.

Each config runs in its own process (``python -m kernelpack.build --worker``) with its own fresh
TORCHINDUCTOR_CACHE_DIR (Triton's cache under it), through exactly the canonical call workers make, forward and
(if asked) backward, and is checked against a float64 reference computed without flex. ``jobs`` workers run at once
on the same device (compilation is CPU-bound). The per-config caches are merged into one artifact.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__
from . import artifact as art
from .errors import BuildError, KernelpackError
from .recipe import Config, Recipe, load_recipe

LOG_TAIL_LINES = 25


@dataclass(frozen=True, slots=True)
class ConfigOutcome:
    config: Config
    ok: bool
    device_index: int
    seconds: float  # first canonical call (compile + run), as measured in the worker
    wall: float  # the worker process, start-up included
    errors: dict[str, float] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    build_key: dict[str, str] | None = None
    message: str = ""
    log_tail: str = ""
    cache_dir: Path | None = None


class BuildProgress:
    """No-op progress callback; the CLI attaches a progress bar."""

    def start(self, total: int) -> None: ...

    def config_done(self, outcome: ConfigOutcome) -> None: ...


@dataclass(frozen=True, slots=True)
class BuildResult:
    artifact: Path | None
    manifest: dict[str, Any] | None
    outcomes: list[ConfigOutcome]
    seconds: float

    @property
    def failed(self) -> list[ConfigOutcome]:
        return [o for o in self.outcomes if not o.ok]


def build(
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
    :func:`merge` combines the shards into one artifact.
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
    progress = progress or BuildProgress()
    start = time.perf_counter()
    own_workdir = workdir is None
    work = Path(tempfile.mkdtemp(prefix="kernelpack-build-")) if workdir is None else Path(workdir)
    try:
        pairs = [(c, d) for c in configs for d in devices]
        progress.start(len(pairs))
        outcomes: list[ConfigOutcome] = []
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = [pool.submit(_run_worker, c, work / f"{c.id}-d{d}", d, timeout) for c, d in pairs]
            for fut in as_completed(futures):
                outcome = fut.result()
                outcomes.append(outcome)
                progress.config_done(outcome)
        outcomes.sort(key=lambda o: (o.config.id, o.device_index))
        failed = [o for o in outcomes if not o.ok]
        built = [o for o in outcomes if o.ok]
        if (failed and not keep_going) or not built:
            raise BuildError(_failure_report(recipe, failed), failed=[o.config.id for o in failed])
        path, manifest = _package(recipe, built, failed, Path(out_dir), level, shard)
        return BuildResult(path, manifest, outcomes, time.perf_counter() - start)
    finally:
        if own_workdir:
            shutil.rmtree(work, ignore_errors=True)


def _failure_report(recipe: Recipe, failed: list[ConfigOutcome]) -> str:
    lines = [f"{len(failed)} (config, device) build(s) of recipe {recipe.name!r} failed:"]
    for o in failed:
        device = f" on cuda:{o.device_index}" if o.config.device == "cuda" else ""
        lines.append(f"- {o.config.describe()}{device}: {o.message}")
        if o.log_tail:
            lines += ["    " + line for line in o.log_tail.splitlines()]
    return "\n".join(lines)


def worker_env(cache_dir: Path) -> dict[str, str]:
    """A fresh, private cache for one worker. Triton's cache goes under it (inductor's default layout)."""
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    env.pop("TRITON_CACHE_DIR", None)
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    env["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run_worker(config: Config, work: Path, device_index: int, timeout: float) -> ConfigOutcome:
    work.mkdir(parents=True, exist_ok=True)
    cache_dir, result_file, log_file = work / "cache", work / "result.json", work / "worker.log"
    cmd = [
        sys.executable,
        "-m",
        "kernelpack.build",
        "--worker",
        json.dumps(config.to_dict()),
        str(device_index),
        str(result_file),
    ]
    start = time.perf_counter()
    with open(log_file, "wb") as log:
        try:
            proc = subprocess.run(
                cmd,
                env=worker_env(cache_dir),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=timeout,
                check=False,
            )
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    wall = time.perf_counter() - start
    try:
        r = json.loads(result_file.read_text())
    except (OSError, ValueError):
        r = {}  # no result (crash, kill, timeout) or a half-written one
    ok = bool(r.get("ok")) and rc == 0
    messages = [r["message"]] if r.get("message") else []
    if rc != 0:
        why = f"timed out after {timeout:.0f} s" if rc is None else f"worker exited with status {rc}"
        messages.append(why + (f" (signal {-rc}; out of memory?)" if rc is not None and rc < 0 else ""))
    return ConfigOutcome(
        config,
        ok,
        device_index,
        seconds=r.get("seconds", 0.0),
        wall=wall,
        errors=r.get("errors", {}),
        counters=r.get("counters", {}),
        build_key=r.get("build_key"),
        message="; ".join(messages),
        log_tail="" if ok else _tail(log_file),
        cache_dir=cache_dir,
    )


def _tail(log_file: Path) -> str:
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-LOG_TAIL_LINES:])


def _package(
    recipe: Recipe,
    built: list[ConfigOutcome],
    failed: list[ConfigOutcome],
    out_dir: Path,
    level: int,
    shard: tuple[int, int] | None = None,
) -> tuple[Path, dict[str, Any]]:
    devices = sorted({o.device_index for o in built})
    keys = {json.dumps(o.build_key, sort_keys=True) for o in built}
    if len(keys) != 1:
        raise BuildError(f"workers reported different build keys: {sorted(keys)}")
    build_key = built[0].build_key
    assert build_key is not None
    # Merge: for a path more than one worker wrote, the first (by config id, then device) wins: deterministic.
    files: dict[str, Path] = {}
    for o in built:
        assert o.cache_dir is not None
        for rel, p in art.scan_tree(o.cache_dir).items():
            files.setdefault(rel, p)
    entries = art.hash_files(files)
    from .keys import BuildKey

    key = BuildKey.from_dict(build_key)
    name = art.artifact_name(recipe.name, key.tag if shard is None else f"{key.tag}.shard-{shard[0]}-of-{shard[1]}")
    manifest: dict[str, Any] = {
        "format": art.FORMAT_VERSION,
        "kernelpack_version": __version__,
        "name": name,
        "created": _created(),
        "recipe": {**recipe.normalized, "sha256": recipe.sha256},
        "configs": _config_entries(built),
        "failed": [
            {"id": o.config.id, "device": o.device_index, "params": o.config.to_dict(), "error": o.message}
            for o in failed
        ],
        "build_key": build_key,
        # device_index: where it was built (the first); devices: every index some config is covered on
        "device_index": devices[0],
        "devices": devices,
        "files": [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in entries],
        "total_size": sum(e.size for e in entries),
    }
    if shard is not None:
        manifest["shard"] = f"{shard[0]}/{shard[1]}"
    return _write(out_dir / name, manifest, files, entries, level), manifest


def _write(
    out: Path, manifest: dict[str, Any], files: dict[str, Path], entries: list[art.FileEntry], level: int
) -> Path:
    try:
        art.pack(out, manifest, files, entries, level=level)
    except OSError as e:
        raise KernelpackError(
            f"cannot write the artifact {out}: {type(e).__name__}: {e}",
            hint="choose a writable output directory with -o and check its free space",
        ) from e
    return out


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


def merge(artifacts: Sequence[str | Path], out_dir: str | Path, *, level: int = 10) -> tuple[Path, dict[str, Any]]:
    """Combine artifacts of one recipe built for the same build key (CI shards) into one artifact.

    Refuses mixed keys or recipes, naming the field that differs. Configs and devices are unioned; for a cache path
    present in several inputs, the first input wins (inputs are taken in the order given).
    """
    import tempfile

    from .keys import BuildKey, differences

    if len(artifacts) < 2:
        raise KernelpackError("merge needs at least two artifacts", hint="kernelpack merge A.kpack B.kpack -o DIR")
    manifests = [art.read_manifest(a) for a in artifacts]
    first = manifests[0].data
    key = BuildKey.from_dict(first["build_key"])
    for path, m in zip(artifacts[1:], manifests[1:], strict=True):
        diffs = differences(key, BuildKey.from_dict(m.data["build_key"]), every_field=True)
        if diffs:
            field, a, b = diffs[0]
            raise KernelpackError(
                f"cannot merge {path}: built for another environment ({field}: {b!r} != {a!r} in {artifacts[0]})",
                hint="merge only shards built with the same torch build on the same GPU model",
            )
        if m.data["recipe"].get("sha256") != first["recipe"].get("sha256"):
            raise KernelpackError(
                f"cannot merge {path}: recipe {m.data['recipe'].get('name')!r} (sha256 "
                f"{str(m.data['recipe'].get('sha256'))[:12]}) differs from {first['recipe'].get('name')!r}",
                hint="merge only shards of the same recipe file",
            )
    with tempfile.TemporaryDirectory(prefix="kernelpack-merge-") as tmp:
        files: dict[str, Path] = {}
        configs: dict[str, dict[str, Any]] = {}
        failed: list[dict[str, Any]] = []
        for n, (path, m) in enumerate(zip(artifacts, manifests, strict=True)):
            tree = Path(tmp, str(n))
            art.unpack(path, tree)
            for rel in m.files:
                files.setdefault(rel, tree / rel)
            for c in m.data["configs"]:
                merged = configs.setdefault(c["id"], {**c, "devices": []})
                merged["devices"] = sorted(set(merged["devices"]) | set(c.get("devices", [0])))
            failed += m.data.get("failed", [])
        entries = art.hash_files(files)
        devices = sorted({d for c in configs.values() for d in c["devices"]})
        built_ids = set(configs)
        manifest = {
            **{k: v for k, v in first.items() if k not in ("shard",)},
            "name": art.artifact_name(first["recipe"]["name"], key.tag),
            "created": _created(),
            "configs": sorted(configs.values(), key=lambda c: c["id"]),
            "failed": [f for f in failed if f["id"] not in built_ids],
            "devices": devices,
            "device_index": devices[0],
            "merged_from": [m.data["name"] for m in manifests],
            "files": [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in entries],
            "total_size": sum(e.size for e in entries),
        }
        out = _write(Path(out_dir) / manifest["name"], manifest, files, entries, level)
    return out, manifest


def _config_entries(built: list[ConfigOutcome]) -> list[dict[str, Any]]:
    """One manifest entry per config, listing the device indices it was built and checked on."""
    by_id: dict[str, list[ConfigOutcome]] = {}
    for o in built:
        by_id.setdefault(o.config.id, []).append(o)
    return [
        {
            "id": cid,
            "params": outs[0].config.to_dict(),
            "devices": [o.device_index for o in outs],
            "compile_seconds": round(max(o.seconds for o in outs), 3),
            "compile_seconds_by_device": {str(o.device_index): round(o.seconds, 3) for o in outs},
            "max_rel_error": max((e for o in outs for e in o.errors.values()), default=0.0),
        }
        for cid, outs in by_id.items()
    ]


def _created() -> int:
    """Build time; SOURCE_DATE_EPOCH (reproducible-builds convention) fixes it so rebuilds are byte-identical."""
    value = os.environ.get("SOURCE_DATE_EPOCH")
    if value is None:
        return int(time.time())
    try:
        return int(value)
    except ValueError:
        raise KernelpackError(
            f"SOURCE_DATE_EPOCH={value!r} is not an integer", hint="unset it or give seconds"
        ) from None


def _worker_main(config_json: str, device_index: str, result_file: str) -> int:
    """One config in this (fresh) process: canonical call, reference check, counters. Writes ``result_file``."""
    result: dict[str, Any] = {"ok": False}
    try:
        from . import evidence, keys
        from .workload import check_errors, run_config

        config = Config.from_dict(json.loads(config_json))
        evidence.install_hooks()
        device = "cpu" if config.device == "cpu" else f"cuda:{int(device_index)}"
        if config.device == "cuda":
            import torch

            torch.cuda.set_device(int(device_index))
        before = evidence.snapshot()
        call = run_config(config, device)
        result.update(seconds=call.seconds, errors=call.errors, counters=evidence.delta(before, evidence.snapshot()))
        result["build_key"] = keys.probe(config.device, int(device_index)).to_dict()
        message = check_errors(config, call.errors)
        if message is not None:
            result["message"] = message
        else:
            result["ok"] = True
    except KernelpackError as e:
        result["message"] = str(e)
    except Exception as e:  # the worker must report, whatever torch raised (compile error, OOM, ...)
        import traceback

        traceback.print_exc()
        result["message"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    tmp = Path(f"{result_file}.tmp")  # the parent must never read half a result
    tmp.write_text(json.dumps(result))
    os.replace(tmp, result_file)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(*sys.argv[2:]))
    sys.exit("usage: python -m kernelpack.build --worker CONFIG_JSON DEVICE_INDEX RESULT_FILE")
