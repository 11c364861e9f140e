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
import hashlib
import json
import logging
import os
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import _fs, _lock, settings
from . import artifact as art
from . import manifest as mf
from ._torch.inductor import CPP_UNSAFE_PATH_CHARS
from .errors import ArtifactError, InstallError, KernelpackError, KernelpackWarning, KeyMismatchError, LockTimeoutError
from .keys import differences, probe
from .staging import STAGE_PREFIX, Counts, Mark, destination, extract, extract_in_child, write_marker

log = logging.getLogger(__name__)

STATE_DIR = ".kernelpack"  # inside the cache dir: install markers. Never shipped in artifacts.


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
    parts: int = 0  # the artifact's parts (a signature's files: kernelpack.manifest.Part)
    parts_installed: int = 0  # installed in the cache dir when this was read (a start installs parts as calls come)


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


def marker_path(cache_dir: Path, sha256: str) -> Path:
    return cache_dir / STATE_DIR / "installed" / f"{sha256}.json"


def part_marker_path(cache_dir: Path, sha256: str, index: int) -> Path:
    return cache_dir / STATE_DIR / "installed" / f"{sha256}.part-{index}.json"


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
        else:
            path = stack.enter_context(_held(path))
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
        if getattr(e, "artifact", None) == private:
            e.artifact = artifact  # type: ignore[attr-defined]  # ArtifactError's, KeyMismatchError's
    if isinstance(e, ArtifactError) and not (e.hint or "").endswith(_LEFT_AS_IT_WAS):
        e.hint = f"{e.hint}{_LEFT_AS_IT_WAS}"
    return e


_LEFT_AS_IT_WAS = "; the cache dir was left as it was"


@contextlib.contextmanager
def _held(path: str) -> Iterator[str]:
    """The artifact as this install opened it, until the install is over: its parts are read at their signatures'
    first calls, minutes into a job, and must come from the file whose manifest was read, even where a rebuild has
    renamed a new artifact onto its path or the file was removed meanwhile (their frames would not be where this
    manifest says: every signature not installed yet would be refused). On Linux the open file (``/proc/self/fd/N``,
    as a pinned install); elsewhere, or where it cannot be opened as a regular file, the path (reading it says why)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO at the path must not hang here
    except OSError:
        yield path
        return
    try:
        by_fd = f"/proc/self/fd/{fd}"
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        yield by_fd if regular and os.path.exists(by_fd) else path
    finally:
        os.close(fd)


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
        raise KeyMismatchError(name, mismatches)
    if mismatches:
        warnings.warn(
            str(KeyMismatchError(name, mismatches)) + "\ninstalling anyway (--allow-mismatch): expect cache misses",
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
    nothing is written yet. The artifact is installed by parts (:class:`~kernelpack.manifest.Part`: a signature's
    files): :meth:`ensure` installs what one signature needs, in any thread, at its first call; :meth:`start` what a
    background start installs; :meth:`finish` every part. :meth:`result` is the install's outcome for other
    threads. A pinned install holds its descriptor open until every part is installed (or the process ends): a part
    installed lazily is read from the very bytes that were hashed."""

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
        self._pinned = sha256 is not None
        self._sha256, self._timings, self._seconds = sha256, timings, seconds
        self._base: int | None = None  # where manifest.json's frame ends (the parts' offsets count from it)
        self._dictionaries: dict[int, bytes] = {}  # dictionary parts' tar bytes, decompressed once per process
        self._lock = threading.Lock()  # finish() and the artifact's hash
        self._parts_lock = threading.Lock()
        self._part_locks: dict[int, threading.Lock] = {}
        self._parts: dict[int, Counts] = {}  # installed (here, or found installed) -> what installing it did
        self._complete = False  # every part and the install marker
        self._done = threading.Event()  # the install a start asked for (start() or finish()) is over
        self._error: BaseException | None = None
        self._install_seconds = 0.0

    # ------------------------------------------------------------------------------------------------ by part

    def ensure(self, owner: str, *, tier1: bool = False) -> None:
        """Install the parts a signature of ``owner`` (:func:`kernelpack.manifest.owner`) needs: its precompiled
        function's files, or with ``tier1`` also the inductor cache's own entries a trace of it reads. A dict lookup
        once they are installed. Safe in any thread (no torch, nothing traced; other threads and processes wait
        only for the same part); raises what failed, the part's files left as they were."""
        self.install_parts(self.manifest.parts_for(owner, tier1=tier1))

    def install_parts(self, indices: Collection[int], *, in_child: bool = False) -> None:
        """Install these parts of the artifact (the ones not installed yet), each verified and linked into place
        with its own marker (:func:`_install_part`). ``in_child``: written by a child process
        (:func:`kernelpack.staging.extract_in_child`)."""
        for i in sorted(set(indices)):
            if i in self._parts:
                continue
            with self._parts_lock:
                lock = self._part_locks.setdefault(i, threading.Lock())
            with lock:
                if i in self._parts:
                    continue
                start = time.perf_counter()
                try:
                    counts = self._install_part(i, in_child)
                except KernelpackError as e:
                    raise _named(e, self._path, self.artifact)  # noqa: B904  # the same error, named for the user
                with self._parts_lock:
                    self._install_seconds += time.perf_counter() - start
                    self._parts[i] = counts
                    self._drop_dictionaries()

    def _drop_dictionaries(self) -> None:
        """Every part installed: no later install reads a dictionary part's bytes (tens of MiB on a GPU artifact),
        so they are let go. Until then they stay, so that no signature's first call decompresses them again.
        Called under ``_parts_lock``."""
        if len(self._parts) == len(self.manifest.parts):
            self._dictionaries.clear()

    def _artifact_sha(self) -> str:
        with self._lock:
            if self._sha256 is None:
                start = time.perf_counter()
                self._sha256 = _fs.sha256_file(self._path)
                self._timings["hash"] = time.perf_counter() - start
            return self._sha256

    def _install_part(self, index: int, in_child: bool) -> Counts:
        sha = self._artifact_sha()
        part = self.manifest.parts[index]
        marker = part_marker_path(self._target, sha, index)
        target, manifest, pinned = self._target, self.manifest, self._pinned
        if _marker_valid(marker, target, manifest, pinned, only=part.files):
            return _found(part.files, _kept(marker))
        _check_state_dir(target, marker)  # before any commit: a failed install leaves the target as it was
        with _node_lock(target, f"{sha}.{index}"):
            # another worker of the node may have installed it while this one waited (8 start at once: one writes)
            if _marker_valid(marker, target, manifest, pinned, only=part.files):
                return _found(part.files, _kept(marker))
            if self._base is None:
                self._base = art.parts_base(self._path)
            marks = [(marker, _part_marker_data(sha, index, part), None)]
            if in_child:
                return extract_in_child(self._path, manifest, target, pinned, marks, parts=(index,), base=self._base)
            return extract(
                self._path,
                manifest,
                target,
                pinned,
                marks,
                parts=(index,),
                base=self._base,
                dictionaries=self._dictionaries,
            )

    # ------------------------------------------------------------------------------------------------ whole

    def start(self, owners: Collection[str], *, everything: bool, in_child: bool = False) -> None:
        """A background start's install: the tier-2 parts of ``owners`` (what its warm-up loads), then, with
        ``everything``, every other part (:meth:`finish`). A failure is kept for :meth:`result` and the report, not
        raised here."""
        try:
            self.install_parts({i for o in owners for i in self.manifest.parts_for(o)}, in_child=in_child)
            if everything:
                self.finish(in_child=in_child)
        except BaseException as e:
            self._error = e
        finally:
            self._done.set()

    def finish(self, *, in_child: bool = False) -> InstallResult:
        """Every part, then the install marker: idempotent, and a no-op (after a stat of each file) where the marker
        says this artifact is installed here already. A failure leaves each part's files as they were (a part
        installed before stays: verified content) and is raised again by every later call."""
        with self._lock:
            done = self._complete or self._error is not None
        if not done:
            try:
                self._finish(in_child)
                with self._lock:
                    self._complete = True
                with self._stack:  # done: a pinned install's descriptor is closed here
                    pass
            except BaseException as e:
                self._error = _named(e, self._path, self.artifact) if isinstance(e, KernelpackError) else e
                with contextlib.suppress(BaseException):
                    self._stack.close()
            finally:
                self._done.set()
        return self.result(timeout=0)

    def _finish(self, in_child: bool) -> None:
        """Every part not installed yet in one extract, with their markers and the install's: all or nothing (a
        bad member anywhere leaves the target as it was, as a one-frame artifact did)."""
        target, manifest, pinned = self._target, self.manifest, self._pinned
        sha = self._artifact_sha()
        marker = marker_path(target, sha)
        # what killed installers left behind, whatever they got to: a whole install reaps even where it then writes
        # nothing (killed after every part's marker but before the install's, a re-run writes only that marker)
        for root in (target, settings.triton_cache_dir()):
            if root is not None:
                _fs.reap_dead(root, STAGE_PREFIX)
        if _marker_valid(marker, target, manifest, pinned):
            with self._parts_lock:
                for i in range(len(manifest.parts)):
                    self._parts.setdefault(i, _found(manifest.parts[i].files, _kept(marker)))
            return
        start = time.perf_counter()
        _check_state_dir(target, marker)  # before any commit: a failed install leaves the target as it was
        with _node_lock(target, sha):
            if not _marker_valid(marker, target, manifest, pinned):  # another worker may have finished meanwhile
                found: dict[int, Counts] = {}
                for i, part in enumerate(manifest.parts):
                    pm = part_marker_path(target, sha, i)
                    if i in self._parts or _marker_valid(pm, target, manifest, pinned, only=part.files):
                        found[i] = self._parts.get(i) or _found(part.files, _kept(pm))
                missing = [i for i in range(len(manifest.parts)) if i not in found]
                data: dict[str, object] = {
                    "artifact": os.path.basename(self.artifact),
                    "sha256": sha,
                    "name": manifest.name,
                    "files": len(manifest.files),
                    "installed_at": time.time(),
                }
                marks: list[Mark] = [
                    (part_marker_path(target, sha, i), _part_marker_data(sha, i, manifest.parts[i]), part_files)
                    for i in missing
                    if (part_files := frozenset(manifest.parts[i].files))
                ]
                # the install's own marker vouches for every file: kept ones of the parts found too
                kept_before = sorted({k for c in found.values() for k in c.kept})
                marks.append((marker, {**data, "kept": kept_before}, None))
                counts = Counts()
                if missing:
                    if self._base is None:
                        self._base = art.parts_base(self._path)
                    write = extract_in_child if in_child else extract
                    counts = write(self._path, manifest, target, pinned, marks, parts=missing, base=self._base)
                else:
                    write_marker(marker, {**data, "kept": kept_before})
                with self._parts_lock:
                    self._parts.update(found)
                    for n, i in enumerate(missing):  # the counts of one extract, on its first part
                        self._parts.setdefault(i, counts if n == 0 else Counts())
                    self._install_seconds += time.perf_counter() - start
                    self._drop_dictionaries()
            else:
                with self._parts_lock:
                    for i in range(len(manifest.parts)):
                        self._parts.setdefault(i, _found(manifest.parts[i].files, _kept(marker)))
        self._timings["extract"] = time.perf_counter() - start

    def result(self, timeout: float | None = None) -> InstallResult:
        """What the install a start asked for (:meth:`start` or :meth:`finish`) did, waiting up to ``timeout`` seconds
        for another thread's; the parts installed since at their signatures' first calls are counted too."""
        if not self._done.wait(timeout):
            raise InstallError(
                self.artifact,
                f"its install into {self.cache_dir} has not finished after {timeout:.0f} s",
                hint="raise KERNELPACK_WARMUP_WAIT_SECONDS",
            )
        if self._error is not None:
            raise self._error
        with self._parts_lock:
            parts = list(self._parts.values())
            seconds = self._install_seconds
        return InstallResult(
            artifact=self.artifact,
            sha256=self._sha256 or "",
            cache_dir=self.cache_dir,
            manifest=self.manifest,
            files=len(self.manifest.files),
            written=sum(c.written for c in parts),
            present=sum(c.present for c in parts),
            kept=len({k for c in parts for k in c.kept}),
            bytes_written=sum(c.nbytes for c in parts),
            seconds=self._seconds + seconds,
            noop=bool(parts) and all(c.found for c in parts),
            mismatches=self._mismatches,
            timings=dict(self._timings),
            parts=len(self.manifest.parts),
            parts_installed=len(parts),
        )

    @property
    def finished(self) -> bool:
        """Whether the install a start asked for is over (later parts install at their first call)."""
        return self._done.is_set()

    @property
    def complete(self) -> bool:
        """Whether every part of the artifact is installed (:meth:`finish`)."""
        return self._complete

    @property
    def error(self) -> BaseException | None:
        """What the install a start asked for failed with (None: not over, or installed)."""
        return self._error if self._done.is_set() else None


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


def _found(files: Collection[str], kept: Collection[str]) -> Counts:
    """A part a marker says is installed: its files count as present (but for the kept ones), none written."""
    kept_here = [k for k in kept if k in files]
    return Counts(present=len(files) - len(kept_here), kept=kept_here, found=True)


def _part_marker_data(sha: str, index: int, part: mf.Part) -> dict[str, object]:
    return {"sha256": sha, "part": index, "owners": list(part.owners), "tier1": part.tier1}


def _kept(marker: Path) -> list[str]:
    """The kept entries a valid marker lists (read after :func:`_marker_valid` said yes)."""
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
        return sorted(str(k) for k in json.loads(marker.read_text()).get("kept", []))
    return []


@contextlib.contextmanager
def _node_lock(target: Path, what: str) -> Iterator[None]:
    """Serialize installs of ``what`` (one part of one artifact, or its marker) into one directory on this node, so
    N workers extract it once; other parts install meanwhile.

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
    name = hashlib.sha256(f"{target.resolve()}\0{what}".encode()).hexdigest()[:24]
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(_lock.file_lock(lock_dir / f"{name}.lock", what=f"install ({target})"))
        except LockTimeoutError as e:
            log.warning("%s; installing without it", e)
        yield
