"""Install an artifact into a TorchInductor cache directory: verified, atomic, idempotent, safe with many workers.

Every byte is staged in a temporary directory inside the destination root and checked against the manifest's sha256
before anything becomes visible; only then is each file hard-linked into place (atomic, and failing on an existing
name), so a reader never sees a partial file and a bad artifact leaves the target exactly as it was. Existing cache
entries are never overwritten or deleted. A marker keyed by the artifact's sha256 makes a second install a fast
no-op; a file lock keeps N workers on a node from doing the work N times, but correctness does not depend on it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import stat
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
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


def rank_cache_dir(base: str | os.PathLike[str] | None = None, local_rank: int | None = None) -> Path:
    """A private cache dir per worker on a node: ``<base>/rank<LOCAL_RANK>`` (base: the inductor cache dir).

    For jobs that keep one cache per rank instead of sharing the node directory; both are safe with concurrent
    installers. ``local_rank`` defaults to $LOCAL_RANK.
    """
    if local_rank is None:
        value = os.environ.get("LOCAL_RANK")
        if value is None or not value.isdigit():
            raise KernelpackError(f"LOCAL_RANK={value!r} is not a rank", hint="pass local_rank= or run under torchrun")
        local_rank = int(value)
    return resolve_cache_dir(base) / f"rank{local_rank}"


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
    With ``set_env`` (the default), once the install succeeded TORCHINDUCTOR_CACHE_DIR points at the target and
    Dynamo's recompile limit covers the artifact's configs, so that this process's next compile reads it; a warning
    says so if torch already compiled with another directory.
    """
    start = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(name: str) -> None:
        timings[name] = time.perf_counter() - start - sum(timings.values())

    path = str(artifact)
    manifest = art.read_manifest(path)
    lap("manifest")
    built = _build_key(path, manifest)
    mismatches = differences(built, probe(built.device_type, device_index))
    lap("probe")
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
    lap("hash")
    marker = marker_path(target, sha)
    counts = _Counts()
    noop = _marker_valid(marker, target, manifest)
    if not noop:
        with _node_lock(target):
            noop = _marker_valid(marker, target, manifest)  # another worker may have finished while we waited
            if not noop:
                counts = _extract(path, manifest, target)
                _write_marker(
                    marker,
                    {
                        "artifact": os.path.basename(path),
                        "sha256": sha,
                        "name": manifest.data["name"],
                        "files": len(manifest.files),
                        "kept": counts.kept,
                        "installed_at": time.time(),
                    },
                )
                lap("extract")
    if set_env:
        _point_inductor_at(target)
        from .runtime import ensure_recompile_limit

        ensure_recompile_limit(2 * len(manifest.data["configs"]))
    return InstallResult(
        artifact=path,
        sha256=sha,
        cache_dir=str(target),
        files=len(manifest.files),
        written=counts.written,
        present=counts.present,
        kept=len(counts.kept),
        bytes_written=counts.nbytes,
        seconds=time.perf_counter() - start,
        noop=noop,
        mismatches=mismatches,
        timings=timings,
    )


@dataclass
class _Counts:
    written: int = 0
    present: int = 0
    kept: list[str] = field(default_factory=list)  # differing entries already there, left alone
    nbytes: int = 0


def _build_key(path: str, manifest: art.Manifest) -> BuildKey:
    try:
        return BuildKey.from_dict(manifest.data["build_key"])
    except (TypeError, ValueError, AttributeError) as e:
        raise art.ArtifactError(path, f"manifest.json build_key is malformed: {e}") from None


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
    """The marker counts only while every file it vouches for is still there: with its size, or, for an entry that
    was already in the cache with other content (kept), at all."""
    try:
        kept = set(json.loads(marker.read_text()).get("kept", []))
    except (OSError, ValueError, AttributeError, TypeError):
        return False
    for rel, entry in manifest.files.items():
        try:
            size = destination(target, rel).stat().st_size
        except OSError:
            return False
        if size != entry.size and rel not in kept:
            return False
    return True


def _lock_timeout() -> float:
    value = os.environ.get("KERNELPACK_LOCK_TIMEOUT", "600")
    try:
        return float(value)
    except ValueError:
        raise KernelpackError(f"KERNELPACK_LOCK_TIMEOUT={value!r} is not a number", hint="give seconds") from None


@contextlib.contextmanager
def _node_lock(target: Path) -> Iterator[None]:
    """Serialize installs into one directory on this node, so N workers extract once.

    The lock only saves work: commits are no-clobber links, correct without it (network filesystems can lie about
    flock). So when the lock cannot be had (a lock directory not ours, a holder stuck past KERNELPACK_LOCK_TIMEOUT,
    or KERNELPACK_INSTALL_LOCK=0) the install goes on without it. It lives outside the target so that a failed
    install leaves the target tree untouched.
    """
    from filelock import FileLock, Timeout

    if os.environ.get("KERNELPACK_INSTALL_LOCK", "1") == "0":
        yield
        return
    lock_dir = Path(tempfile.gettempdir()) / f"kernelpack-locks-{os.getuid()}"
    try:
        lock_dir.mkdir(mode=0o700, exist_ok=True)
        st = lock_dir.lstat()
        ours = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
    except OSError:
        ours = False
    if not ours:
        log.warning("%s is not a directory of this user; installing without the node lock", lock_dir)
        yield
        return
    name = hashlib.sha256(str(target.resolve()).encode()).hexdigest()[:24]
    lock = FileLock(str(lock_dir / f"{name}.lock"), timeout=_lock_timeout())
    try:
        lock.acquire()
    except Timeout:
        log.warning("waited %.0f s for the install lock of %s; installing without it", _lock_timeout(), target)
        yield
        return
    try:
        yield
    finally:
        lock.release()


def _extract(path: str, manifest: art.Manifest, target: Path) -> _Counts:
    """Stage every file, verified, then link each into place without clobbering anything.

    Any failure removes the staging directories and whatever this call created (files and directories), so the
    target ends exactly as it was.
    """
    stages: dict[Path, Path] = {}  # destination root -> staging dir inside it
    created: list[Path] = []  # directories and files this call created, in creation order
    staged: list[tuple[Path, Path, art.FileEntry]] = []  # (staged file, destination, entry)
    by_rel: dict[str, Path] = {}
    counts = _Counts()
    try:
        for member in art.iter_members(path, manifest):
            dest = destination(target, member.path)
            root = target if dest.is_relative_to(target) else Path(os.environ["TRITON_CACHE_DIR"]).absolute()
            stage = stages.get(root)
            if stage is None:
                _makedirs(root, created)
                _remove_dead_stages(root)
                stage = Path(tempfile.mkdtemp(prefix=_stage_prefix(), dir=root))
                stages[root] = stage
            tmp = stage / str(len(staged))
            # 0644 under the umask: never group/world-writable, even with umask 0 (the cache is executed code)
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as f:
                if member.link_to is not None:
                    with open(by_rel[member.link_to], "rb") as src:
                        shutil.copyfileobj(src, f)
                else:
                    member.write(f)
            by_rel[member.path] = tmp
            staged.append((tmp, dest, member.entry))
        real_roots = [r.resolve() for r in stages]
        for tmp, dest, entry in staged:
            _makedirs(dest.parent, created)
            if not any(dest.parent.resolve().is_relative_to(r) for r in real_roots):
                raise InstallError(
                    str(target),
                    f"{dest.parent} leads outside the cache directory (a symlink); refusing to write through it",
                )
            if _link_no_clobber(tmp, dest):
                created.append(dest)
                counts.written += 1
                counts.nbytes += entry.size
            elif not dest.is_symlink() and dest.is_file() and art.sha256_file(dest) == entry.sha256:
                counts.present += 1
            else:
                counts.kept.append(entry.path)  # an entry already in the cache: never replaced, never followed
                log.warning("kept existing %s (differs from the artifact's copy)", dest)
        return counts
    except BaseException as e:
        for stage in stages.values():
            shutil.rmtree(stage, ignore_errors=True)
        stages.clear()
        for p in reversed(created):
            with contextlib.suppress(OSError):
                p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
        if isinstance(e, OSError) and not isinstance(e, KernelpackError):
            raise InstallError(str(target), f"{type(e).__name__}: {e}") from e
        raise
    finally:
        for stage in stages.values():
            shutil.rmtree(stage, ignore_errors=True)


def _stage_prefix() -> str:
    # host and pid in the name: a later install can tell a killed installer's leftovers from a live one's
    return f"{_STAGE_PREFIX}{socket.gethostname()}-{os.getpid()}-"


def _remove_dead_stages(root: Path) -> None:
    """Staging dirs of installers on this host that were killed (SIGKILL skips every cleanup) are removed."""
    host = socket.gethostname()
    for d in root.glob(f"{_STAGE_PREFIX}{host}-*-*"):
        pid = d.name[len(_STAGE_PREFIX) + len(host) + 1 :].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _link_no_clobber(src: Path, dest: Path) -> bool:
    """Make ``dest`` appear atomically with ``src``'s content unless it exists; True if this call created it.

    A hard link fails atomically on an existing name, where check-then-rename would race with torch or another node
    writing the same entry. Filesystems without hard links fall back to check-then-rename.
    """
    try:
        os.link(src, dest)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
    if dest.exists() or dest.is_symlink():
        return False
    os.replace(src, dest)
    return True


def _makedirs(d: Path, created: list[Path]) -> None:
    missing = []
    p = d
    while not p.exists():
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):
            p.mkdir(mode=0o755)  # under the umask; never group/world-writable
            created.append(p)


def _write_marker(marker: Path, data: dict[str, object]) -> None:
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")  # unique across hosts too
    try:
        _makedirs(marker.parent, [])
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w") as f:
            f.write(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, marker)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise InstallError(str(marker.parent), f"cannot write the install marker: {type(e).__name__}: {e}") from e
