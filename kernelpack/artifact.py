"""The ``.kpack`` artifact: one zstd-compressed tar stream, ``manifest.json`` first, then the cache tree.

Layout::

    manifest.json                 format, versions, recipe, configs, build key, every file's size and sha256
    cache/<path in the cache dir> one regular member per distinct content; a later file with the same content is a
                                  hard-link member pointing at the first one (tar's own dedup, so ``tar -x`` works)

Packing is deterministic: members sorted, mtime/uid/gid/uname/gname fixed, modes normalized, and zstd's
multi-threaded output does not depend on the thread count, so the same cache tree and manifest give the same bytes.

Reading never trusts the archive: every member is checked against the manifest (name, type, size, sha256) while it
streams, names must be normalized relative paths under ``cache/``, the only links allowed are hard links to an
earlier member, and the expanded size is capped by the manifest's own total before anything is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import posixpath
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .errors import ArtifactError, ArtifactNotFoundError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TREE_PREFIX = "cache/"
SUFFIX = ".kpack"
MAX_MANIFEST_BYTES = 64 << 20
# zstd long-distance matching finds the Triton binaries that appear both as files and inside FX-graph entries
# (pickled bundles), which file-level dedup cannot see. The reader must allow the same window.
WINDOW_LOG = 27
_CHUNK = 1 << 20

# Never shipped: inductor's lock files, kernelpack's own bookkeeping, half-written temporaries.
_SKIP_DIRS = {"locks", ".kernelpack"}


def max_expanded_bytes() -> int:
    """Refuse artifacts whose manifest declares more than this (decompression-bomb cap); env at call time."""
    return int(os.environ.get("KERNELPACK_MAX_EXPANDED_BYTES", str(64 << 30)))


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str  # relative to the cache dir, POSIX separators
    size: int
    sha256: str


def is_shipped(rel: str) -> bool:
    parts = rel.split("/")
    name = parts[-1]
    return not (parts[0] in _SKIP_DIRS or name.endswith(".lock") or name.startswith("tmp") or ".tmp" in name)


def scan_tree(root: Path) -> dict[str, Path]:
    """Relative POSIX path -> file, for every file of a cache dir that belongs in an artifact. No symlinks followed."""
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath, name)
            rel = full.relative_to(root).as_posix()
            if not is_shipped(rel):
                continue
            if full.is_symlink() or not full.is_file():
                raise ArtifactError(str(root), "cache tree holds a non-regular file; refusing to pack it", member=rel)
            found[rel] = full
    return found


def sha256_file(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_files(files: dict[str, Path]) -> list[FileEntry]:
    return [FileEntry(rel, files[rel].stat().st_size, sha256_file(files[rel])) for rel in sorted(files)]


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode = size, 0, 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def pack(
    out_path: Path,
    manifest: dict[str, Any],
    files: dict[str, Path],
    entries: list[FileEntry],
    *,
    level: int = 10,
    threads: int = -1,
) -> None:
    """Write the artifact atomically: temp file in the same directory, then ``os.replace``."""
    import zstandard

    by_path = {e.path: e for e in entries}
    manifest_bytes = (json.dumps(manifest, sort_keys=True, indent=1) + "\n").encode()
    params = zstandard.ZstdCompressionParameters.from_level(
        level, threads=threads, enable_ldm=True, window_log=WINDOW_LOG, write_checksum=True
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=f".{out_path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as raw:
            cctx = zstandard.ZstdCompressor(compression_params=params)
            with cctx.stream_writer(raw, closefd=False) as zw:
                with tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                    tar.addfile(_tarinfo(MANIFEST_NAME, len(manifest_bytes)), io.BytesIO(manifest_bytes))
                    first_with: dict[str, str] = {}
                    for rel in sorted(files):
                        entry = by_path[rel]
                        name = TREE_PREFIX + rel
                        if entry.sha256 in first_with:
                            ti = _tarinfo(name, 0)
                            ti.type, ti.linkname = tarfile.LNKTYPE, first_with[entry.sha256]
                            tar.addfile(ti)
                            continue
                        first_with[entry.sha256] = name
                        with open(files[rel], "rb") as f:
                            tar.addfile(_tarinfo(name, entry.size), f)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, out_path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True, slots=True)
class Manifest:
    data: dict[str, Any]
    files: dict[str, FileEntry]

    @property
    def total_size(self) -> int:
        return sum(e.size for e in self.files.values())


def _open_stream(path: str) -> tuple[IO[bytes], IO[bytes]]:
    import zstandard

    try:
        raw = open(path, "rb")
    except FileNotFoundError:
        raise ArtifactNotFoundError(path) from None
    except IsADirectoryError:
        raise ArtifactError(path, "is a directory, not a .kpack file") from None
    dctx = zstandard.ZstdDecompressor(max_window_size=1 << WINDOW_LOG)
    return raw, dctx.stream_reader(raw, read_across_frames=False)


def _parse_manifest(path: str, blob: bytes) -> Manifest:
    try:
        data = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(path, f"manifest.json is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ArtifactError(path, "manifest.json is not a JSON object")
    fmt = data.get("format")
    if fmt != FORMAT_VERSION:
        raise ArtifactError(path, f"unsupported artifact format {fmt!r} (this kernelpack reads {FORMAT_VERSION})")
    files: dict[str, FileEntry] = {}
    try:
        for f in data["files"]:
            entry = FileEntry(str(f["path"]), int(f["size"]), str(f["sha256"]))
            _check_name(path, entry.path)
            if entry.size < 0 or len(entry.sha256) != 64:
                raise ValueError(f"bad size/sha256 for {entry.path!r}")
            if entry.path in files:
                raise ValueError(f"file listed twice: {entry.path!r}")
            files[entry.path] = entry
        for key in ("build_key", "recipe", "configs", "name"):
            data[key]
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(path, f"manifest.json is malformed: {type(e).__name__}: {e}") from None
    manifest = Manifest(data, files)
    if manifest.total_size > max_expanded_bytes():
        raise ArtifactError(
            path,
            f"manifest declares {manifest.total_size} bytes expanded, over the cap of {max_expanded_bytes()} "
            "(set KERNELPACK_MAX_EXPANDED_BYTES to raise it)",
        )
    return manifest


def _check_name(path: str, rel: str) -> None:
    """A cache path must be a normalized relative POSIX path: no absolute paths, '..', '.', empty parts, NUL."""
    if (
        not rel
        or rel.startswith("/")
        or "\\" in rel
        or "\0" in rel
        or posixpath.normpath(rel) != rel
        or any(part in ("", ".", "..") for part in rel.split("/"))
        or not is_shipped(rel)
    ):
        raise ArtifactError(path, "unsafe or non-normalized path", member=rel)


@contextlib.contextmanager
def _wrap_errors(path: str) -> Iterator[None]:
    """Turn the decoder's and tarfile's exceptions into an ArtifactError naming the file."""
    import zstandard

    try:
        yield
    except (zstandard.ZstdError, tarfile.TarError, EOFError) as e:
        raise ArtifactError(path, f"corrupt or truncated artifact: {type(e).__name__}: {e}") from e


def read_manifest(path: str | Path) -> Manifest:
    """Only the first member is decompressed: cheap even for a large artifact, and torch is not imported."""
    path = str(path)
    raw, stream = _open_stream(path)
    with raw, stream, _wrap_errors(path):
        tar = tarfile.open(fileobj=stream, mode="r|")
        first = tar.next()
        if first is None or first.name != MANIFEST_NAME or not first.isreg():
            raise ArtifactError(path, "first member is not manifest.json: not a kernelpack artifact")
        if first.size > MAX_MANIFEST_BYTES:
            raise ArtifactError(path, f"manifest.json is {first.size} bytes, over {MAX_MANIFEST_BYTES}")
        f = tar.extractfile(first)
        assert f is not None
        blob = f.read()
        if len(blob) != first.size:
            raise ArtifactError(path, "truncated inside manifest.json")
        return _parse_manifest(path, blob)


@dataclass(frozen=True, slots=True)
class Member:
    """A verified file of the cache tree: ``write(dst)`` streams its bytes into ``dst`` and checks size and sha256."""

    path: str
    entry: FileEntry
    link_to: str | None  # earlier member path with the same content (tar hard link)
    write: Callable[[IO[bytes]], None]


def iter_members(path: str | Path, manifest: Manifest) -> Iterator[Member]:
    """Yield every file of the tree in archive order, each checked against ``manifest`` as it is written.

    Raises :class:`ArtifactError` on any mismatch: an unknown, duplicate, missing, unsafe or oversize member, a link
    that does not point at an earlier member of the same content, a sha256 that differs, or a corrupt stream.
    """
    path = str(path)
    raw, stream = _open_stream(path)
    seen: dict[str, str] = {}  # member path -> sha256 of its verified content
    with raw, stream, _wrap_errors(path):
        tar = tarfile.open(fileobj=stream, mode="r|")
        first = tar.next()
        if first is None or first.name != MANIFEST_NAME:
            raise ArtifactError(path, "first member is not manifest.json")
        f = tar.extractfile(first)
        assert f is not None
        blob = f.read()
        if _parse_manifest(path, blob).files != manifest.files:
            raise ArtifactError(path, "manifest.json changed between reads")
        budget = manifest.total_size
        while (ti := tar.next()) is not None:
            name = ti.name
            if not name.startswith(TREE_PREFIX):
                raise ArtifactError(path, "member outside cache/", member=name)
            rel = name[len(TREE_PREFIX) :]
            _check_name(path, rel)
            entry = manifest.files.get(rel)
            if entry is None:
                raise ArtifactError(path, "member not listed in manifest.json", member=name)
            if rel in seen:
                raise ArtifactError(path, "duplicate member", member=name)
            if ti.islnk():
                target = ti.linkname
                target_rel = target[len(TREE_PREFIX) :] if target.startswith(TREE_PREFIX) else None
                if target_rel is None or target_rel not in seen or seen[target_rel] != entry.sha256:
                    raise ArtifactError(
                        path, f"hard link to {target!r} is not an earlier member with this content", member=name
                    )
                seen[rel] = entry.sha256
                yield Member(rel, entry, target_rel, _no_write)
                continue
            if not ti.isreg():
                raise ArtifactError(
                    path, f"member type {ti.type!r} not allowed (only files and hard links)", member=name
                )
            if ti.size != entry.size:
                raise ArtifactError(path, f"size {ti.size} != manifest size {entry.size}", member=name)
            budget -= ti.size
            if budget < 0:
                raise ArtifactError(path, "expanded size exceeds manifest total", member=name)
            src = tar.extractfile(ti)
            assert src is not None
            consumed: list[bool] = []

            def write(
                dst: IO[bytes],
                src: IO[bytes] = src,
                entry: FileEntry = entry,
                name: str = name,
                consumed: list[bool] = consumed,
            ) -> None:
                h, n = hashlib.sha256(), 0
                with _wrap_errors(path):
                    while chunk := src.read(_CHUNK):
                        n += len(chunk)
                        if n > entry.size:
                            raise ArtifactError(path, "member longer than declared", member=name)
                        h.update(chunk)
                        dst.write(chunk)
                if n != entry.size:
                    raise ArtifactError(path, f"truncated: {n} of {entry.size} bytes", member=name)
                if h.hexdigest() != entry.sha256:
                    raise ArtifactError(path, "sha256 differs from manifest.json (tampered or corrupt)", member=name)
                consumed.append(True)

            yield Member(rel, entry, None, write)
            if not consumed:
                raise ArtifactError(path, "member was not consumed", member=name)
            seen[rel] = entry.sha256
        missing = manifest.files.keys() - seen.keys()
        if missing:
            raise ArtifactError(
                path, f"{len(missing)} file(s) of manifest.json missing (truncated?)", member=sorted(missing)[0]
            )


def _no_write(dst: IO[bytes]) -> None:
    raise AssertionError("hard-link members have no bytes: copy the target's")


def artifact_name(recipe: str, tag: str) -> str:
    return f"{recipe}-{tag}{SUFFIX}"
