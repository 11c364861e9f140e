"""Install an artifact into a TorchInductor cache directory: verified, atomic, idempotent, safe with many workers.

Every byte is staged in a temporary directory inside the destination root and checked against the manifest's sha256
before anything becomes visible; only then is each file moved into place with ``os.replace`` (atomic on POSIX), so a
reader never sees a partial file and a bad artifact leaves the target exactly as it was. Existing cache entries are
never overwritten or deleted. A marker keyed by the artifact's sha256 makes a second install a fast no-op; a file lock
keeps N workers on a node from doing the work N times, but correctness does not depend on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from . import artifact as art
from .errors import InstallError, KernelpackError, KeyMismatchError
from .keys import BuildKey, differences, probe

log = logging.getLogger(__name__)

STATE_DIR = ".kernelpack"  # inside the cache dir: install markers. Never shipped in artifacts.
_STAGE_PREFIX = ".kernelpack-tmp-"


class KernelpackWarning(UserWarning):
    pass


@dataclass(frozen=True, kw_only=True, slots=True)
class InstallResult:
    artifact: str
    sha256: str
    cache_dir: str
    files: int  # files in the artifact
    written: int  # moved into place by this call
    present: int  # already there with identical content
    kept: int  # already there with different content: left untouched (an existing entry is never replaced)
    bytes_written: int
    seconds: float
    noop: bool  # the marker said this artifact was installed here already
    mismatches: list[tuple[str, str, str]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase: manifest, probe, hash, extract


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    """``cache_dir`` if given, else the directory inductor will use in this process (TORCHINDUCTOR_CACHE_DIR or
    torch's default under the temp dir). Read at call time."""
    if cache_dir is not None:
        return Path(cache_dir).absolute()
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env:
        return Path(env).absolute()
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(default_cache_dir()).absolute()


def destination(cache_dir: Path, rel: str) -> Path:
    """Where a file of the artifact's tree goes. ``triton/<dev>/...`` follows TRITON_CACHE_DIR when it is set,
    exactly like inductor's ``triton_cache_dir()``."""
    triton_dir = os.environ.get("TRITON_CACHE_DIR")
    parts = rel.split("/")
    if triton_dir and parts[0] == "triton" and len(parts) > 2:
        return Path(triton_dir).absolute().joinpath(*parts[2:])
    return cache_dir.joinpath(*parts)


def marker_path(cache_dir: Path, sha256: str) -> Path:
    return cache_dir / STATE_DIR / "installed" / f"{sha256}.json"


def install(
    artifact: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    allow_mismatch: bool = False,
    device_index: int = 0,
    set_env: bool = True,
) -> InstallResult:
    """Install ``artifact`` into ``cache_dir`` (default: the directory inductor uses in this process).

    Refuses (:class:`KeyMismatchError`) an artifact built for another torch/triton/CUDA/GPU unless ``allow_mismatch``.
    With ``set_env`` (the default), TORCHINDUCTOR_CACHE_DIR is pointed at the target so that this process's next
    compile reads it; a warning says so if torch already compiled with another directory.
    """
    start = time.perf_counter()
    timings: dict[str, float] = {}
    path = str(artifact)
    manifest = art.read_manifest(path)
    timings["manifest"] = time.perf_counter() - start
    built = _build_key(path, manifest)
    mismatches = differences(built, probe(built.device_type, device_index))
    timings["probe"] = time.perf_counter() - start - sum(timings.values())
    if mismatches and not allow_mismatch:
        raise KeyMismatchError(path, mismatches)
    if mismatches:
        warnings.warn(
            str(KeyMismatchError(path, mismatches)) + "\ninstalling anyway (--allow-mismatch): expect cache misses",
            KernelpackWarning,
            stacklevel=2,
        )
    target = resolve_cache_dir(cache_dir)
    sha = art.sha256_file(path)
    timings["hash"] = time.perf_counter() - start - sum(timings.values())
    if set_env:
        _point_inductor_at(target)

    marker = marker_path(target, sha)
    if _marker_valid(marker, target, manifest):
        return _result(path, sha, target, manifest, start, noop=True, mismatches=mismatches, timings=timings)
    with _node_lock(target):
        if _marker_valid(marker, target, manifest):  # another worker finished while we waited
            return _result(path, sha, target, manifest, start, noop=True, mismatches=mismatches, timings=timings)
        t = time.perf_counter()
        written, present, kept, nbytes = _extract(path, manifest, target)
        timings["extract"] = time.perf_counter() - t
        _write_marker(
            marker,
            {
                "artifact": os.path.basename(path),
                "sha256": sha,
                "name": manifest.data["name"],
                "files": len(manifest.files),
                "installed_at": time.time(),
            },
        )
    return _result(
        path,
        sha,
        target,
        manifest,
        start,
        noop=False,
        mismatches=mismatches,
        written=written,
        present=present,
        kept=kept,
        nbytes=nbytes,
        timings=timings,
    )


def _build_key(path: str, manifest: art.Manifest) -> BuildKey:
    try:
        return BuildKey.from_dict(manifest.data["build_key"])
    except (TypeError, ValueError, AttributeError) as e:
        raise art.ArtifactError(path, f"manifest.json build_key is malformed: {e}") from None


def _result(
    path: str,
    sha: str,
    target: Path,
    manifest: art.Manifest,
    start: float,
    *,
    noop: bool,
    mismatches: list[tuple[str, str, str]],
    timings: dict[str, float],
    written: int = 0,
    present: int = 0,
    kept: int = 0,
    nbytes: int = 0,
) -> InstallResult:
    return InstallResult(
        artifact=path,
        sha256=sha,
        cache_dir=str(target),
        files=len(manifest.files),
        written=written,
        present=present,
        kept=kept,
        bytes_written=nbytes,
        seconds=time.perf_counter() - start,
        noop=noop,
        mismatches=mismatches,
        timings=timings,
    )


def _point_inductor_at(target: Path) -> None:
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current and Path(current).absolute() != target and _torch_compiled_already():
        warnings.warn(
            f"torch already compiled in this process with TORCHINDUCTOR_CACHE_DIR={current}; the artifact is "
            f"installed into {target} and TORCHINDUCTOR_CACHE_DIR now points there. Graphs compiled before this "
            "call were not affected: install before the first compiled call (kernelpack install at job start).",
            KernelpackWarning,
            stacklevel=3,
        )
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(target)


def _torch_compiled_already() -> bool:
    if "torch._dynamo" not in sys.modules:
        return False
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"] > 0 or bool(counters["inductor"])


def _marker_valid(marker: Path, target: Path, manifest: art.Manifest) -> bool:
    """The marker counts only while every file it vouches for is still there with its size."""
    if not marker.is_file():
        return False
    for rel, entry in manifest.files.items():
        try:
            if destination(target, rel).stat().st_size != entry.size:
                return False
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _node_lock(target: Path):  # type: ignore[no-untyped-def]
    """Serialize installs into one directory on this node. Lives outside the target so that a failed install leaves
    the target tree untouched; only saves work (rename-based commits are correct without it)."""
    from filelock import FileLock

    # Per user: another user's lock directory would not be writable.
    lock_dir = Path(tempfile.gettempdir()) / f"kernelpack-locks-{os.getuid()}"
    lock_dir.mkdir(mode=0o700, exist_ok=True)
    name = hashlib.sha256(str(target).encode()).hexdigest()[:24]
    with FileLock(str(lock_dir / f"{name}.lock")):
        yield


def _extract(path: str, manifest: art.Manifest, target: Path) -> tuple[int, int, int, int]:
    """Stage every file, verified, then move each into place. Returns (written, present, kept, bytes)."""
    stages: dict[Path, Path] = {}  # destination root -> staging dir inside it
    created_roots: list[Path] = []
    staged: list[tuple[Path, Path]] = []  # (staged file, destination)
    by_rel: dict[str, Path] = {}
    try:
        for member in art.iter_members(path, manifest):
            dest = destination(target, member.path)
            root = target if dest.is_relative_to(target) else Path(os.environ["TRITON_CACHE_DIR"]).absolute()
            stage = stages.get(root)
            if stage is None:
                if not root.exists():
                    _makedirs(root, created_roots)
                stage = Path(tempfile.mkdtemp(prefix=_STAGE_PREFIX, dir=root))
                stages[root] = stage
            tmp = stage / f"{len(staged)}"
            if member.link_to is not None:
                shutil.copyfile(by_rel[member.link_to], tmp)
            else:
                with open(tmp, "xb") as f:  # "x": plain open honours the umask, unlike mkstemp's 0600
                    member.write(f)
            by_rel[member.path] = tmp
            staged.append((tmp, dest))
        written = present = kept = nbytes = 0
        for tmp, dest in staged:
            if dest.exists() or dest.is_symlink():
                if not dest.is_symlink() and dest.is_file() and _same_file(dest, tmp):
                    present += 1
                else:
                    kept += 1  # an entry already in the cache: never replace or delete it
                    log.warning("kept existing %s (differs from the artifact's copy)", dest)
                continue
            _makedirs(dest.parent, [])
            size = tmp.stat().st_size
            os.replace(tmp, dest)
            written += 1
            nbytes += size
        return written, present, kept, nbytes
    except BaseException as e:
        # Staging first, then the directories this call created: the target ends exactly as it was.
        for stage in stages.values():
            shutil.rmtree(stage, ignore_errors=True)
        stages.clear()
        _rollback_dirs(created_roots)
        if isinstance(e, OSError) and not isinstance(e, KernelpackError):
            raise InstallError(str(target), f"{type(e).__name__}: {e}") from e
        raise
    finally:
        for stage in stages.values():
            shutil.rmtree(stage, ignore_errors=True)


def _makedirs(d: Path, created: list[Path]) -> None:
    missing = []
    p = d
    while not p.exists():
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):
            p.mkdir()
            created.append(p)


def _rollback_dirs(created: list[Path]) -> None:
    for d in reversed(created):
        with contextlib.suppress(OSError):
            d.rmdir()


def _same_file(a: Path, b: Path) -> bool:
    return a.stat().st_size == b.stat().st_size and art.sha256_file(a) == art.sha256_file(b)


def _write_marker(marker: Path, data: dict[str, object]) -> None:
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, marker)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
