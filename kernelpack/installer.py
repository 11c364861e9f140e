"""Install an artifact into a TorchInductor cache directory: verified, atomic, idempotent, safe with many workers.

Every byte is staged in a temporary directory inside the destination root and checked against the manifest's sha256
before anything becomes visible; only then is each file hard-linked into place (atomic, and failing on an existing
name), so a reader never sees a partial file and a bad artifact leaves the target exactly as it was. Existing cache
entries are never overwritten or deleted. A marker keyed by the artifact's sha256 makes a second install a fast
no-op; a file lock keeps N workers on a node from doing the work N times, but correctness does not depend on it.

Files only: nothing here changes the process (its environment, torch's config). :func:`kernelpack.install` is the
job-start wrapper that also points this process at the cache (:mod:`kernelpack.runtime`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

from . import _fs, _lock, settings
from . import artifact as art
from . import manifest as mf
from ._torch.inductor import CPP_UNSAFE_PATH_CHARS
from .errors import ArtifactError, InstallError, KernelpackError, KernelpackWarning, KeyMismatchError, LockTimeoutError
from .keys import differences, probe

log = logging.getLogger(__name__)

STATE_DIR = ".kernelpack"  # inside the cache dir: install markers. Never shipped in artifacts.
# inductor's FX-graph and AOTAutograd caches: only a Dynamo trace reads them (tier 1); a precompiled function (tier 2)
# carries its graphs, and loads with neither dir installed (checked: CPU, torch 2.13). Its generated code and
# kernels are in the other dirs (code dirs, triton/), which it does need.
TIER1_ONLY = ("fxgraph/", "aotautograd/")
_STAGE_PREFIX = ".kernelpack-tmp-"


@dataclass(frozen=True, kw_only=True, slots=True)
class InstallResult:
    artifact: str
    sha256: str
    cache_dir: str
    manifest: mf.Manifest
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
    torch's default under the temp dir). Read at call time. Raises :class:`InstallError` for a name that cannot be
    a directory here (empty, a file, a symlink loop)."""
    if cache_dir is not None:
        if not str(cache_dir).strip():
            raise InstallError(repr(str(cache_dir)), "an empty cache directory name", hint="pass a directory path")
        path = Path(cache_dir).absolute()
    else:
        env = settings.inductor_cache_dir()
        if env is None:
            from ._torch.inductor import default_cache_dir

            env = Path(default_cache_dir()).absolute()
        path = env
    try:
        real = path.resolve()
    except (RuntimeError, OSError) as e:  # pathlib raises RuntimeError for a symlink loop (< 3.13)
        raise InstallError(str(path), f"cannot be resolved: {e}", hint="fix the cache directory path") from None
    if real.exists() and not real.is_dir():
        raise InstallError(str(path), "is not a directory", hint="point the cache directory at a directory")
    return path


def destination(cache_dir: Path, rel: str) -> Path:
    """Where a file of the artifact's tree goes. ``triton/<dev>/...`` follows TRITON_CACHE_DIR when it is set,
    exactly like inductor's ``triton_cache_dir()``."""
    triton_dir = settings.triton_cache_dir()
    parts = rel.split("/")
    if triton_dir is not None and parts[0] == "triton" and len(parts) > 2:
        return triton_dir.joinpath(*parts[2:])
    return cache_dir.joinpath(*parts)


def marker_path(cache_dir: Path, sha256: str) -> Path:
    return cache_dir / STATE_DIR / "installed" / f"{sha256}.json"


def install_artifact(
    artifact: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    allow_mismatch: bool = False,
    device_index: int = 0,
    sha256: str | None = None,
) -> InstallResult:
    """Install ``artifact`` into ``cache_dir`` (default: the directory inductor uses in this process). Files only:
    this process is not changed (``kernelpack.install`` also points it at the cache).

    Refuses (:class:`KeyMismatchError`) an artifact built for another torch/triton/CUDA/GPU unless ``allow_mismatch``.
    ``sha256`` (a pinned pull): the artifact must have exactly these bytes. It is copied through one open file,
    hashed as it is copied, into a directory private to this process, and installed from there: no one can swap it
    between the check and the install. A pinned install also owns what it installs: a file already at one of the
    artifact's paths with other content is an error, not kept (torch would load it), and a second install counts as
    done only while every file still hashes to the manifest's sha256 (not its size: a same-size swap is seen).
    """
    return begin_install(
        artifact, cache_dir, allow_mismatch=allow_mismatch, device_index=device_index, sha256=sha256
    ).finish()


def begin_install(
    artifact: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    allow_mismatch: bool = False,
    device_index: int = 0,
    sha256: str | None = None,
) -> Installing:
    """:func:`install_artifact` in two halves: this one reads the manifest, checks the build key and the cache dir
    and writes nothing (tenths of a second); :meth:`Installing.finish` hashes, extracts and writes the marker, in
    any thread (a background start runs it while torch's compiler imports: zstd and the writes release the GIL)."""
    stack = contextlib.ExitStack()
    path = str(artifact)
    try:
        if sha256 is not None:
            path = stack.enter_context(_pinned_copy(str(artifact), sha256))
        return _begin(path, cache_dir, allow_mismatch, device_index, stack, name=str(artifact), sha256=sha256)
    except BaseException as e:
        stack.close()
        if isinstance(e, KernelpackError):
            _named(e, path, str(artifact))
        raise


def _named(e: KernelpackError, private: str, artifact: str) -> KernelpackError:
    """The error as the user reads it: naming the artifact, not the descriptor a pinned install read it through."""
    if private != artifact:
        e.message = e.message.replace(private, artifact)
        e.args = (e.message,)
    if isinstance(e, ArtifactError) and not (e.hint or "").endswith(_LEFT_AS_IT_WAS):
        e.hint = f"{e.hint}{_LEFT_AS_IT_WAS}"
    return e


_LEFT_AS_IT_WAS = "; the cache dir was left as it was"


@contextlib.contextmanager
def _pinned_copy(path: str, sha256: str) -> Iterator[str]:
    """A path to bytes that hash to ``sha256`` and that nobody can swap until the block ends: on Linux the open file
    itself (``/proc/self/fd/N``: hashed through that descriptor, installed from it; a rename or a new file at
    ``path`` does not change what it names), no copy. Elsewhere a copy, hashed as it is written, in a private
    staging directory (reaped by the next pinned install when a killed one left it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise InstallError(path, f"cannot read the pinned artifact: {type(e).__name__}: {e}") from e
    stage: Path | None = None
    try:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise InstallError(path, "the pinned artifact is not a regular file", hint="pull it again")
            os.set_blocking(fd, True)
            by_fd = f"/proc/self/fd/{fd}"
            if os.path.exists(by_fd):
                got, pinned_path = _hash_fd(fd), by_fd
            else:
                stage = _fs.make_stage_dir(Path(tempfile.gettempdir()), "kernelpack-pinned-")
                pinned_path = os.path.join(stage, os.path.basename(path))
                h = hashlib.sha256()
                with open(pinned_path, "wb") as out:
                    while chunk := os.read(fd, _fs.CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                got = h.hexdigest()
        except OSError as e:
            if isinstance(e, KernelpackError):
                raise
            raise InstallError(path, f"cannot read the pinned artifact: {type(e).__name__}: {e}") from e
        if got != sha256:
            raise InstallError(path, f"sha256 {got} is not the pinned {sha256}", hint="pull it again")
        yield pinned_path
    finally:
        if stage is not None:
            _fs.remove_stage_dir(stage)
        os.close(fd)


def _hash_fd(fd: int) -> str:
    h = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, _fs.CHUNK, offset):
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()


def _begin(
    path: str,
    cache_dir: str | os.PathLike[str] | None,
    allow_mismatch: bool,
    device_index: int,
    stack: contextlib.ExitStack,
    *,
    name: str,
    sha256: str | None,
) -> Installing:
    """``sha256``: what ``path`` hashes to, when a pinned install hashed it already (through the descriptor it
    installs from), so that it is not read a second time."""
    start = time.perf_counter()
    timings: dict[str, float] = {}
    target = resolve_cache_dir(cache_dir) if cache_dir is not None or settings.inductor_cache_dir() else None
    manifest = art.read_manifest(path)
    timings["manifest"] = time.perf_counter() - start
    built = manifest.build_key
    mismatches = differences(built, probe(built.device_type, device_index, expected_torch_key=built.torch_key))
    timings["probe"] = time.perf_counter() - start - timings["manifest"]
    if mismatches and not allow_mismatch:
        raise KeyMismatchError(path, mismatches)
    if mismatches:
        warnings.warn(
            str(KeyMismatchError(path, mismatches)) + "\ninstalling anyway (--allow-mismatch): expect cache misses",
            KernelpackWarning,
            stacklevel=3,
        )
    target = target or resolve_cache_dir(cache_dir)
    check_cache_dir(target, built.device_type)
    return Installing(
        path,
        name,
        target,
        manifest,
        mismatches,
        stack,
        sha256=sha256,
        timings=timings,
        seconds=time.perf_counter() - start,
    )


class Installing:
    """An install :func:`begin_install` checked: its artifact's manifest and the cache dir it goes into are known,
    nothing is written yet. :meth:`finish` (once, in any thread) installs; :meth:`result` is its outcome for other
    threads. A pinned install holds its descriptor open until then."""

    def __init__(
        self,
        path: str,
        name: str,
        target: Path,
        manifest: mf.Manifest,
        mismatches: list[tuple[str, str, str]],
        stack: contextlib.ExitStack,
        *,
        sha256: str | None,
        timings: dict[str, float],
        seconds: float,
    ) -> None:
        self.manifest = manifest
        self.cache_dir = str(target)
        self.artifact = name
        self._path, self._target, self._mismatches, self._stack = path, target, mismatches, stack
        self._sha256, self._timings, self._seconds = sha256, timings, seconds
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._result: InstallResult | None = None
        self._error: BaseException | None = None
        self._first: tuple[frozenset[str], _Counts, str, float] | None = None  # finish_first's files, counts, sha, s

    def finish_first(self, files: Callable[[str], bool], *, in_child: bool = False) -> bool:
        """Write the files ``files`` picks first (with every file of the same content), verified and linked into
        place, no marker: what must be there soon (a background start: the files precompiled functions load), so that
        :meth:`finish` can write the rest later. Returns whether the install is finished already (a valid marker: a
        second start on this node). A failure fails the whole install, the target left as it was; a later failure of
        :meth:`finish` leaves these files in place, unmarked (verified content; the next install completes them).
        ``in_child``: the files are written by a child process (:func:`_extract_in_child`)."""
        with self._lock:
            if self._done.is_set() or self._first is not None:
                return self._done.is_set()
            start = time.perf_counter()
            try:
                sha = self._sha256 or _fs.sha256_file(self._path)
                marker = marker_path(self._target, sha)
                if _marker_valid(marker, self._target, self.manifest, self._sha256 is not None):
                    self._first = (frozenset(), _Counts(), sha, 0.0)
                    with self._stack:  # done: a pinned install's descriptor is closed here
                        self._result = self._finish()
                    self._done.set()
                    return True
                picked = {rel for rel in self.manifest.files if files(rel)}
                shas = {self.manifest.files[rel].sha256 for rel in picked}
                # hard links join members of one content: a group goes whole into one part
                picked |= {rel for rel, e in self.manifest.files.items() if e.sha256 in shas}
                # a marker of its own, so that the other workers of the node skip this part while this one writes
                # the rest (8 workers start at once: one extracts, 7 wait for the lock, then find the marker)
                first = marker.with_name(marker.stem + ".first.json")
                pinned = self._sha256 is not None
                counts = _Counts()
                if _marker_valid(first, self._target, self.manifest, pinned, only=picked):
                    counts.kept = _kept(first)  # the final marker vouches for them too
                else:
                    _check_state_dir(self._target, marker)
                    with _node_lock(self._target):
                        if _marker_valid(first, self._target, self.manifest, pinned, only=picked):
                            counts.kept = _kept(first)
                        else:
                            extract = _extract_in_child if in_child else _extract
                            mark: tuple[Path, dict[str, object]] = (first, {"sha256": sha, "part": "first"})
                            counts = extract(self._path, self.manifest, self._target, pinned, mark, only=picked)
                self._first = (frozenset(picked), counts, sha, time.perf_counter() - start)
            except BaseException as e:
                self._error = _named(e, self._path, self.artifact) if isinstance(e, KernelpackError) else e
                self._done.set()
                with contextlib.suppress(BaseException):
                    self._stack.close()
                return True
            return False

    def finish(self, *, in_child: bool = False) -> InstallResult:
        """Hash, extract and mark: the files become visible here. Idempotent; a failure leaves the cache dir as it
        was (:func:`_extract`) and is raised again by every later call. ``in_child``: the files are written by a
        child process (:func:`_extract_in_child`)."""
        with self._lock:
            if not self._done.is_set():
                try:
                    with self._stack:
                        self._result = self._finish(in_child)
                except BaseException as e:
                    self._error = _named(e, self._path, self.artifact) if isinstance(e, KernelpackError) else e
                finally:
                    self._done.set()
        return self.result(timeout=0)

    def result(self, timeout: float | None = None) -> InstallResult:
        """What :meth:`finish` installed, waiting up to ``timeout`` seconds for another thread's."""
        if not self._done.wait(timeout):
            raise InstallError(
                self.artifact,
                f"its install into {self.cache_dir} has not finished after {timeout:.0f} s",
                hint="raise KERNELPACK_WARMUP_WAIT_SECONDS",
            )
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """What the finished install failed with (None: not finished, or installed)."""
        return self._error if self._done.is_set() else None

    def _finish(self, in_child: bool = False) -> InstallResult:
        start = time.perf_counter()
        timings = dict(self._timings)
        path, target, manifest, pinned = self._path, self._target, self.manifest, self._sha256 is not None
        first_files, counts, sha, first_seconds = self._first or (frozenset(), _Counts(), "", 0.0)
        if first_seconds:
            timings["extract_first"] = first_seconds
        sha = sha or _fs.sha256_file(path)
        timings["hash"] = time.perf_counter() - start
        marker = marker_path(target, sha)
        rest = None if not first_files else frozenset(manifest.files.keys() - first_files)
        noop = _marker_valid(marker, target, manifest, pinned)
        if noop:
            _fs.reap_dead(target, _STAGE_PREFIX)  # what killed installers left behind
        else:
            _check_state_dir(target, marker)  # before any commit: a failed install leaves the target as it was
            with _node_lock(target):
                # another worker may have finished while we waited
                noop = _marker_valid(marker, target, manifest, pinned)
                if not noop:
                    data: dict[str, object] = {
                        "artifact": os.path.basename(self.artifact),
                        "sha256": sha,
                        "name": manifest.name,
                        "files": len(manifest.files),
                        "installed_at": time.time(),
                    }
                    extract = _extract_in_child if in_child else _extract
                    counts = extract(path, manifest, target, pinned, (marker, data), only=rest, before=counts)
                    timings["extract"] = time.perf_counter() - start - timings["hash"]
        return InstallResult(
            artifact=self.artifact,
            sha256=sha,
            cache_dir=str(target),
            manifest=manifest,
            files=len(manifest.files),
            written=counts.written,
            present=counts.present,
            kept=len(counts.kept),
            bytes_written=counts.nbytes,
            seconds=self._seconds + first_seconds + time.perf_counter() - start,
            noop=noop,
            mismatches=self._mismatches,
            timings=timings,
        )


def check_cache_dir(target: Path, device_type: str = "cuda") -> None:
    """Refuse, before anything is written or loaded, a cache dir that torch could not use or that someone else
    could change: one another user can write (what is installed there is code every worker runs), one
    this process cannot write (torch takes its locks and writes new entries there, so even a complete install fails
    at the first load: ``InductorError: ... Read-only file system: '<cache>/locks'``), one under a file, and, for a
    CPU artifact, a path torch's C++ build command cannot carry. TRITON_CACHE_DIR, where set, the same."""
    dirs = [("cache dir", target)]
    triton_dir = settings.triton_cache_dir()
    if triton_dir is not None:
        dirs.append(("TRITON_CACHE_DIR", triton_dir))
    for what, d in dirs:
        for check, consequence, hint in (
            (
                _fs.writable_dir_problem,
                f"torch writes its locks and new entries in the {what}, so loading from it would fail",
                "point the cache dir at a writable directory",
            ),
            (
                _fs.private_dir_problem,
                "another user could change the code every worker loads from it",
                "use a directory only you can write",
            ),
        ):
            problem = check(d)
            if problem:
                raise InstallError(
                    str(d),
                    f"{problem}: {consequence}",
                    hint=f"{hint} (TORCHINDUCTOR_CACHE_DIR, or cache_dir= / --cache-dir)"
                    + (", or chmod go-w it" if check is _fs.private_dir_problem else ""),
                )
        bad = sorted(set(str(d.absolute())) & CPP_UNSAFE_PATH_CHARS)
        if device_type == "cpu" and bad:
            raise InstallError(
                str(d),
                f"holds {', '.join(map(repr, bad))}: torch's C++ build command splits paths there, so the CPU "
                "kernels could not be loaded from it",
                hint="choose a cache dir path without spaces, quotes or backslashes",
            )


@dataclass(slots=True)
class _Counts:
    written: int = 0
    present: int = 0
    kept: list[str] = field(default_factory=list)  # differing entries already there, left alone
    nbytes: int = 0


def _check_state_dir(target: Path, marker: Path | None = None) -> None:
    """The marker's directory must be (or become) a real directory inside the target: not a file, not a symlink to
    elsewhere. Checked before extracting, so a marker that cannot be written fails the install with the target
    unchanged."""
    state = target / STATE_DIR
    for p in (state, state / "installed"):
        if p.is_symlink() or (p.exists() and not p.is_dir()):
            raise InstallError(
                str(target),
                f"{p} is {'a symlink' if p.is_symlink() else 'not a directory'}: kernelpack keeps its install markers "
                "there and follows no link out of the cache directory",
                hint=f"remove {p}",
            )
    if marker is not None and (marker.is_symlink() or (marker.exists() and not marker.is_file())):
        raise InstallError(str(target), f"{marker} is in the way (not a regular file)", hint=f"remove {marker}")


def _marker_valid(
    marker: Path, target: Path, manifest: mf.Manifest, pinned: bool = False, *, only: Collection[str] | None = None
) -> bool:
    """The marker counts only while every file it vouches for is still there: with its size, or, for an entry that
    was already in the cache with other content (kept), at all. ``pinned``: with its sha256, and nothing kept.
    ``only``: it vouches for these files alone (the first part of an install)."""
    try:
        kept = set(json.loads(marker.read_text()).get("kept", []))
    except (OSError, ValueError, AttributeError, TypeError):
        return False
    if not all(isinstance(k, str) for k in kept):
        return False
    if pinned and kept:
        return False
    for rel, entry in manifest.files.items():
        if only is not None and rel not in only:
            continue
        dest = destination(target, rel)
        try:
            size = dest.stat().st_size
        except OSError:
            return False
        if size != entry.size and rel not in kept:
            return False
        if pinned and (dest.is_symlink() or _fs.sha256_file(dest) != entry.sha256):
            return False
    return True


def _kept(marker: Path) -> list[str]:
    """The kept entries a valid marker lists (read after :func:`_marker_valid` said yes)."""
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
        return sorted(str(k) for k in json.loads(marker.read_text()).get("kept", []))
    return []


@contextlib.contextmanager
def _node_lock(target: Path) -> Iterator[None]:
    """Serialize installs into one directory on this node, so N workers extract once.

    The lock only saves work: commits are no-clobber links, correct without it. So when the lock cannot be had (no
    private lock directory, a holder stuck past KERNELPACK_LOCK_TIMEOUT, or KERNELPACK_INSTALL_LOCK=0) the install
    goes on without it. It lives outside the target so that a failed install leaves the target tree untouched.
    """
    lock_dir = _lock.user_lock_dir() if settings.install_lock() else None
    if lock_dir is None:
        if settings.install_lock():
            log.warning("no private lock directory for this user; installing without the node lock")
        yield
        return
    name = hashlib.sha256(str(target.resolve()).encode()).hexdigest()[:24]
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(_lock.file_lock(lock_dir / f"{name}.lock", what=f"install ({target})"))
        except LockTimeoutError as e:
            log.warning("%s; installing without it", e)
        yield


def _extract(
    path: str,
    manifest: mf.Manifest,
    target: Path,
    pinned: bool = False,
    mark: tuple[Path, dict[str, object]] | None = None,
    *,
    only: frozenset[str] | set[str] | None = None,
    before: _Counts | None = None,
) -> _Counts:
    """Stage every file, verified, then link each into place without clobbering anything.

    Any failure removes the staging directories and whatever this call created (files and directories), so the
    target ends exactly as it was. ``pinned``: a differing file already at one of the artifact's paths is such a
    failure (an unpinned install keeps it and says so). ``mark`` (the install marker's path and data, to which the
    kept files are added) is written last, inside the same rollback: a marker that cannot be written (a full disk)
    takes the files just committed with it, so a failed install never leaves files in place. ``only``: these files
    alone are written (every member is still read and verified); ``before``: the counts of an earlier part of the
    same install, which the marker's count includes.
    """
    stages: dict[Path, Path] = {}  # destination root -> staging dir inside it
    created: list[Path] = []  # directories and files this call created, in creation order
    staged: list[tuple[Path, Path, mf.FileEntry]] = []  # (staged file, destination, entry)
    by_rel: dict[str, Path] = {}
    counts = dataclasses.replace(before, kept=list(before.kept)) if before is not None else _Counts()
    try:
        for member in art.iter_members(path, manifest):
            if only is not None and member.path not in only:
                if member.link_to is None:
                    member.write(cast(IO[bytes], _Discard()))  # verified all the same: corrupt fails every part
                continue
            dest = destination(target, member.path)
            root = target if dest.is_relative_to(target) else settings.triton_cache_dir()
            assert root is not None  # destination() leaves the target only for TRITON_CACHE_DIR
            stage = stages.get(root)
            if stage is None:
                _fs.makedirs(root, created)
                stage = _fs.make_stage_dir(root, _STAGE_PREFIX)
                stages[root] = stage
            tmp = stage / str(len(staged))
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _fs.FILE_MODE), "wb") as f:
                if member.link_to is not None:
                    with open(by_rel[member.link_to], "rb") as src:
                        shutil.copyfileobj(src, f)
                else:
                    member.write(f)
            by_rel[member.path] = tmp
            staged.append((tmp, dest, member.entry))
        real_roots = [r.resolve() for r in stages]
        for tmp, dest, entry in staged:
            # checked before creating anything below it: a symlink inside the target (C/fxgraph -> /elsewhere) must
            # not get directories made through it
            existing = dest.parent
            while not existing.exists() and not existing.is_symlink():
                existing = existing.parent
            if not any(existing.resolve().is_relative_to(r) for r in real_roots):
                raise InstallError(
                    str(target),
                    f"{existing} leads outside the cache directory (a symlink); refusing to write through it",
                )
            _fs.makedirs(dest.parent, created)
            if _fs.link_no_clobber(tmp, dest):
                created.append(dest)
                counts.written += 1
                counts.nbytes += entry.size
            elif not dest.is_symlink() and dest.is_file() and _fs.sha256_file(dest) == entry.sha256:
                counts.present += 1
            else:
                counts.kept.append(entry.path)  # an entry already in the cache: never replaced, never followed
                if not pinned:
                    log.warning("kept existing %s (differs from the artifact's copy)", dest)
        if pinned and counts.kept:
            shown = ", ".join(counts.kept[:3]) + (f" and {len(counts.kept) - 3} more" if len(counts.kept) > 3 else "")
            raise InstallError(
                str(target),
                f"{len(counts.kept)} file(s) at the pinned artifact's paths hold other content ({shown}): torch "
                "would load them instead of the pinned ones, so nothing was installed",
                hint="install into a cache dir only this job writes (activate(cache_dir=...), kernelpack pull "
                "--install --cache-dir DIR), or remove those files",
            )
        if mark is not None:
            _write_marker(mark[0], {**mark[1], "kept": counts.kept}, created)
        return counts
    except BaseException as e:
        for stage in stages.values():
            _fs.remove_stage_dir(stage)
        stages.clear()
        for p in reversed(created):
            with contextlib.suppress(OSError):
                p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
        if isinstance(e, OSError) and not isinstance(e, KernelpackError):
            raise InstallError(str(target), f"{type(e).__name__}: {e}") from e
        raise
    finally:
        for stage in stages.values():
            _fs.remove_stage_dir(stage)


def _extract_in_child(
    path: str,
    manifest: mf.Manifest,
    target: Path,
    pinned: bool = False,
    mark: tuple[Path, dict[str, object]] | None = None,
    *,
    only: frozenset[str] | set[str] | None = None,
    before: _Counts | None = None,
) -> _Counts:
    """:func:`_extract` in a child process (``python -c``, kernelpack's installer and zstandard only, no torch;
    0.1-0.2 s to start): a background start's install runs beside Dynamo's and inductor's imports, and in a thread
    of the job's process it shares their GIL. Every file read, write, hash and zstd block releases and takes the GIL
    back, which an importing thread holds most of the time: measured on CPU (torch 2.13, this project's 2-core
    machine, 120 files and 62 MB), the extract took 0.5 s alone, 2.75 s in a thread beside the imports and
    0.74-0.97 s in a child process beside them; on the H200 the DFlash artifact's took 1.6-2.3 s instead of 0.3 s.
    The same checks and the same rollback run in the child; its error is raised here as it was raised there
    (KernelpackError pickles its state). The child dies with this process: when its stdin closes it rolls back
    (``_child_main``). A pinned install's descriptor is passed to the child under the same number."""
    import pickle
    import subprocess
    import sys

    fds: tuple[int, ...] = ()
    if path.startswith("/proc/self/fd/"):
        fds = (int(path.rsplit("/", 1)[1]),)
    package_root = str(Path(__file__).resolve().parent.parent)
    code = (
        f"import sys; sys.path.insert(0, {package_root!r}); from kernelpack.installer import _child_main; _child_main()"
    )
    job = pickle.dumps((path, manifest, str(target), pinned, mark, only, before))
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=fds, close_fds=True
        )
    except OSError as e:
        log.warning("kernelpack: cannot start the install's process (%s: %s); installing here", type(e).__name__, e)
        return _extract(path, manifest, target, pinned, mark, only=only, before=before)
    assert child.stdin is not None and child.stdout is not None
    try:
        child.stdin.write(len(job).to_bytes(8, "big") + job)
        child.stdin.flush()
        reply = child.stdout.read()  # stdin stays open until the child is done: its end is the child's stop signal
    except OSError:
        reply = b""
    finally:
        with contextlib.suppress(OSError):
            child.stdin.close()
        code_ = child.wait()
    try:
        outcome, value = pickle.loads(reply)
    except Exception:
        how = f"killed by signal {-code_}" if code_ < 0 else f"exited with code {code_}"
        raise InstallError(
            str(target),
            f"the install's process {how} before it finished; what it staged is removed by the next install",
            hint="see the messages above; set KERNELPACK_INSTALL_PROCESS=0 to install in the job's process",
        ) from None
    if outcome == "error":
        raise value
    return cast(_Counts, value)


def _child_main() -> None:
    """The install's child process (:func:`_extract_in_child`): one job on stdin, its counts or its exception on
    stdout. A watcher thread reads stdin to its end: the parent closing it before the job is done (the parent died,
    or gave up) interrupts the extract, which rolls back."""
    import _thread
    import pickle
    import signal
    import sys

    # The watcher stops the extract with interrupt_main(), a simulated SIGINT, which Python drops when SIGINT is
    # ignored: a job started as `nohup job &` (a shell ignores SIGINT in its background commands) passes SIG_IGN to
    # this child, which then finished the install after the job died instead of rolling it back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    size = int.from_bytes(stdin.read(8), "big")
    path, manifest, target, pinned, mark, only, before = pickle.loads(stdin.read(size))
    done = threading.Event()

    def watch() -> None:
        stdin.read()
        if not done.is_set():
            _thread.interrupt_main()

    threading.Thread(target=watch, daemon=True).start()
    reply: tuple[str, object]
    try:
        reply = ("ok", _extract(path, manifest, Path(target), pinned, mark, only=only, before=before))
    except BaseException as e:
        reply = ("error", e)
    done.set()
    try:
        data = pickle.dumps(reply)
    except Exception:  # an exception that does not pickle: its type and text
        failed = reply[1]
        data = pickle.dumps(("error", InstallError(target, f"{type(failed).__name__}: {failed}")))
    stdout.write(data)
    stdout.flush()
    os._exit(0)  # not a normal shutdown: the watcher is still blocked reading stdin (finalization would abort)


class _Discard:
    """A destination that keeps nothing: a member another part of the install writes is read and checked here."""

    def write(self, data: bytes) -> int:
        return len(data)


def _write_marker(marker: Path, data: dict[str, object], created: list[Path] | None = None) -> None:
    try:
        _fs.makedirs(marker.parent, created if created is not None else [])
        _fs.write_bytes(marker, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())
    except OSError as e:
        raise InstallError(str(marker.parent), f"cannot write the install marker: {type(e).__name__}: {e}") from e
