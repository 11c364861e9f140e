"""Write an artifact's files into a cache dir: staged inside it, verified against the manifest, hard-linked into
place without clobbering anything, rolled back on any failure; in this process or in a child process of its own.
The mechanism under :mod:`kernelpack.installer`, which decides what to install and when (markers, locks, parts).

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from . import _fs, settings
from . import artifact as art
from . import manifest as mf
from .errors import InstallError, KernelpackError

log = logging.getLogger(__name__)

# an install marker to write after the files: its path, its data, and the files it vouches for (None: all)
Mark = tuple[Path, dict[str, object], "frozenset[str] | None"]
STAGE_PREFIX = ".kernelpack-tmp-"


def destination(cache_dir: Path, rel: str) -> Path:
    """Where a file of the artifact's tree goes. ``triton/<dev>/...`` follows TRITON_CACHE_DIR when it is set,
    exactly like inductor's ``triton_cache_dir()``."""
    triton_dir = settings.triton_cache_dir()
    parts = rel.split("/")
    if triton_dir is not None and parts[0] == "triton" and len(parts) > 2:
        return triton_dir.joinpath(*parts[2:])
    return cache_dir.joinpath(*parts)


@dataclass(slots=True)
class Counts:
    written: int = 0
    present: int = 0
    kept: list[str] = field(default_factory=list)  # differing entries already there, left alone
    nbytes: int = 0
    found: bool = False  # the part's marker said it was installed already (by another process, or an earlier one)


def extract(
    path: str,
    manifest: mf.Manifest,
    target: Path,
    pinned: bool = False,
    marks: Sequence[Mark] = (),
    *,
    parts: Collection[int] | None = None,
    base: int | None = None,
    dictionaries: dict[int, bytes] | None = None,
    cancel: threading.Event | None = None,
) -> Counts:
    """Stage every file, verified, then link each into place without clobbering anything.

    Any failure removes the staging directories and whatever this call created (files and directories), so the
    target ends exactly as it was. ``pinned``: a differing file already at one of the artifact's paths is such a
    failure (an unpinned install keeps it and says so). ``marks`` (install markers: path, data, and the files it
    vouches for, None for all; the kept ones among them are added) are written last, inside the same rollback: a
    marker that cannot be written (a full disk) takes the files just committed with it, so a failed install never
    leaves files in place. ``parts``: these parts of the artifact alone (default: all), read from their frames
    (``base``: :func:`kernelpack.artifact.parts_base`; ``dictionaries``: :func:`kernelpack.artifact.iter_members`'s).
    ``cancel``: once set, the extract rolls back at its next file (staged or linked), unless its markers are being
    written: the commit, after which it finishes.
    """
    stages: dict[Path, Path] = {}  # destination root -> staging dir inside it
    created: list[Path] = []  # directories and files this call created, in creation order
    staged: list[tuple[Path, Path, mf.FileEntry]] = []  # (staged file, destination, entry)
    by_rel: dict[str, Path] = {}
    counts = Counts()
    try:
        for member in art.iter_members(path, manifest, parts, base=base, dictionaries=dictionaries):
            _check_cancel(cancel, target)
            dest = destination(target, member.path)
            root = target if dest.is_relative_to(target) else settings.triton_cache_dir()
            assert root is not None  # destination() leaves the target only for TRITON_CACHE_DIR
            stage = stages.get(root)
            if stage is None:
                _fs.makedirs(root, created)
                stage = _fs.make_stage_dir(root, STAGE_PREFIX)
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
            _check_cancel(cancel, target)
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
        _check_cancel(cancel, target)  # the last chance: the markers are the commit
        for marker, data, files in marks:
            kept = counts.kept if files is None else [k for k in counts.kept if k in files]
            before_ = data.get("kept", [])
            assert isinstance(before_, list)
            write_marker(marker, {**data, "kept": sorted({*before_, *kept})}, created)
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


def _check_cancel(cancel: threading.Event | None, target: Path) -> None:
    if cancel is not None and cancel.is_set():
        raise InstallError(str(target), "the install was stopped (the job that started it is gone)")


def extract_in_child(
    path: str,
    manifest: mf.Manifest,
    target: Path,
    pinned: bool = False,
    marks: Sequence[Mark] = (),
    *,
    parts: Collection[int] | None = None,
    base: int | None = None,
) -> Counts:
    """:func:`extract` in a child process (``python -c``, kernelpack's installer and zstandard only, no torch;
    0.1-0.2 s to start): a background start's install runs beside Dynamo's and inductor's imports, and in a thread
    of the job's process it shares their GIL. Every file read, write, hash and zstd block releases and takes the GIL
    back, which an importing thread holds most of the time: measured on CPU (torch 2.13, this project's 2-core
    machine, 120 files and 62 MB), the extract took 0.5 s alone, 2.75 s in a thread beside the imports and
    0.74-0.97 s in a child process beside them; on the H200 the DFlash artifact's took 1.6-2.3 s instead of 0.3 s.
    The same checks and the same rollback run in the child; its error is raised here as it was raised there
    (KernelpackError pickles its state). The child dies with this process: when its stdin closes before it is done,
    it rolls back (``_child_main``). A pinned install's descriptor is passed to the child under the same number."""
    import pickle
    import subprocess
    import sys

    fds: tuple[int, ...] = ()
    if path.startswith("/proc/self/fd/"):
        fds = (int(path.rsplit("/", 1)[1]),)
    package_root = str(Path(__file__).resolve().parent.parent)
    code = (
        f"import sys; sys.path.insert(0, {package_root!r}); from kernelpack.staging import _child_main; _child_main()"
    )
    job = pickle.dumps((path, manifest, str(target), pinned, marks, parts, base))
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=fds, close_fds=True
        )
    except OSError as e:
        log.warning("kernelpack: cannot start the install's process (%s: %s); installing here", type(e).__name__, e)
        return extract(path, manifest, target, pinned, marks, parts=parts, base=base)
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
    return cast(Counts, value)


def _child_main() -> None:
    """The install's child process (:func:`extract_in_child`): one job on stdin, its counts or its exception on
    stdout. A watcher thread reads stdin to its end: the parent closing it before the job is done (the parent died,
    or gave up) cancels the extract, which rolls back at its next file, or finishes if it is writing its markers.

    Its stdin is the child's one stop signal. An exception thrown into the extract from outside (the watcher's
    ``_thread.interrupt_main()`` before, or a terminal's ^C) lands anywhere: in the rollback itself, or, when the job
    dies just after the markers are written (CI at dc04d4d killed one there), in the removal of the staging
    directory, which it leaves half removed behind a whole install. So the extract checks a flag between files, and
    SIGINT is ignored here: a ^C that reaches the job's process group stops the job, and its end closes this child's
    stdin."""
    import pickle
    import signal
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    size = int.from_bytes(stdin.read(8), "big")
    path, manifest, target, pinned, marks, parts, base = pickle.loads(stdin.read(size))
    cancel = threading.Event()

    def watch() -> None:
        stdin.read()
        cancel.set()

    threading.Thread(target=watch, daemon=True).start()
    reply: tuple[str, object]
    try:
        reply = ("ok", extract(path, manifest, Path(target), pinned, marks, parts=parts, base=base, cancel=cancel))
    except BaseException as e:
        reply = ("error", e)
    try:
        data = pickle.dumps(reply)
    except Exception:  # an exception that does not pickle: its type and text
        failed = reply[1]
        data = pickle.dumps(("error", InstallError(target, f"{type(failed).__name__}: {failed}")))
    with contextlib.suppress(OSError):  # a parent that is gone reads nothing: not an error of this child's
        stdout.write(data)
        stdout.flush()
    os._exit(0)  # not a normal shutdown: the watcher may still be blocked reading stdin (finalization would abort)


def write_marker(marker: Path, data: dict[str, object], created: list[Path] | None = None) -> None:
    try:
        _fs.makedirs(marker.parent, created if created is not None else [])
        _fs.write_bytes(marker, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())
    except OSError as e:
        raise InstallError(str(marker.parent), f"cannot write the install marker: {type(e).__name__}: {e}") from e
