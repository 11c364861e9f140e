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
import secrets
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .errors import ArtifactError, ArtifactNotFoundError, KernelpackError

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
    value = os.environ.get("KERNELPACK_MAX_EXPANDED_BYTES", str(64 << 30))
    try:
        return int(value)
    except ValueError:
        raise KernelpackError(
            f"KERNELPACK_MAX_EXPANDED_BYTES={value!r} is not an integer", hint="give a byte count, e.g. 68719476736"
        ) from None


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
    tmp = out_path.with_name(f".{out_path.name}.{secrets.token_hex(4)}.tmp")
    # 0644 under the umask, like any file a user writes (mkstemp's 0600 would hide a shared artifact from the node's
    # other users and CI uploaders), and never group/world-writable: the artifact carries executable kernels.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
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


class _Budget(io.RawIOBase):
    """The decompressed stream, refusing to yield more than ``limit`` bytes in total.

    tarfile reads a whole pax or GNU long-name header into memory before returning the member, so a 32 KB artifact
    can declare a 1 GiB header; the budget stops that before the memory is taken.
    """

    def __init__(self, inner: IO[bytes], path: str, limit: int) -> None:
        self.inner, self.path, self.limit, self.count = inner, path, limit, 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        want = self.limit - self.count + 1 if n is None or n < 0 else min(n, self.limit - self.count + 1)
        data = self.inner.read(want)
        self.count += len(data)
        if self.count > self.limit:
            raise ArtifactError(self.path, f"archive expands past {self.limit} bytes, more than manifest.json declares")
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


@contextlib.contextmanager
def _open_tar(path: str, limit: int) -> Iterator[tarfile.TarFile]:
    """The artifact as a streaming tar reader over at most ``limit`` decompressed bytes; errors name the file."""
    import zstandard

    try:
        raw = open(path, "rb")
    except FileNotFoundError:
        raise ArtifactNotFoundError(path) from None
    except IsADirectoryError:
        raise ArtifactError(path, "is a directory, not a .kpack file") from None
    except OSError as e:
        raise ArtifactError(path, f"cannot open: {type(e).__name__}: {e}") from None
    dctx = zstandard.ZstdDecompressor(max_window_size=1 << WINDOW_LOG)
    with raw, dctx.stream_reader(raw, read_across_frames=False) as stream, _wrap_errors(path):
        yield tarfile.open(fileobj=_Budget(stream, path, limit), mode="r|")


def _read_manifest_member(path: str, tar: tarfile.TarFile) -> Manifest:
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


def _parse_manifest(path: str, blob: bytes) -> Manifest:
    try:
        data = json.loads(blob)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ArtifactError(path, f"manifest.json is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(data, dict):
        raise ArtifactError(path, "manifest.json is not a JSON object")
    fmt = data.get("format")
    if fmt != FORMAT_VERSION:
        raise ArtifactError(path, f"unsupported artifact format {fmt!r} (this kernelpack reads {FORMAT_VERSION})")
    files: dict[str, FileEntry] = {}
    try:
        for f in data["files"]:
            size = f["size"]
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(f"bad size {size!r} for {f.get('path')!r}")
            entry = FileEntry(str(f["path"]), size, str(f["sha256"]))
            _check_name(path, entry.path)
            if len(entry.sha256) != 64:
                raise ValueError(f"bad sha256 for {entry.path!r}")
            if entry.path in files:
                raise ValueError(f"file listed twice: {entry.path!r}")
            files[entry.path] = entry
        if not isinstance(data["name"], str) or not isinstance(data["recipe"], dict):
            raise TypeError("name must be a string and recipe an object")
        if not isinstance(data["build_key"], dict) or not all(isinstance(v, str) for v in data["build_key"].values()):
            raise TypeError("build_key must be an object of strings")
        if not isinstance(data["configs"], list) or not all(
            isinstance(c, dict) and isinstance(c.get("params"), dict) for c in data["configs"]
        ):
            raise TypeError("configs must be a list of objects with params")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ArtifactError(path, f"manifest.json is malformed: {type(e).__name__}: {e}") from None
    # A path that is also another path's directory could only fail half-way through an install.
    dirs = {rel.rsplit("/", 1)[0] for rel in files if "/" in rel}
    parents = {"/".join(d.split("/")[: i + 1]) for d in dirs for i in range(d.count("/") + 1)}
    clash = sorted(parents & files.keys())
    if clash:
        raise ArtifactError(path, "manifest.json lists a path both as a file and as a directory", member=clash[0])
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
        or len(rel) > 4096
        or rel.startswith("/")
        or "\\" in rel
        or "\0" in rel
        or posixpath.normpath(rel) != rel
        or any(part in ("", ".", "..") or len(part) > 255 for part in rel.split("/"))
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


# Room for tar headers: 512-byte blocks, pax records for long names, padding and the end-of-archive blocks.
_HEADER_SLACK = 64 << 10
_PER_MEMBER_SLACK = 4 << 10


def read_manifest(path: str | Path) -> Manifest:
    """Only the first member is decompressed: cheap even for a large artifact, and torch is not imported."""
    path = str(path)
    with _open_tar(path, MAX_MANIFEST_BYTES + _HEADER_SLACK) as tar:
        return _read_manifest_member(path, tar)


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
    limit = MAX_MANIFEST_BYTES + manifest.total_size + _HEADER_SLACK + _PER_MEMBER_SLACK * (len(manifest.files) + 1)
    seen: dict[str, str] = {}  # member path -> sha256 of its verified content
    with _open_tar(path, limit) as tar:
        if _read_manifest_member(path, tar).files != manifest.files:
            raise ArtifactError(path, "manifest.json changed between reads")
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
                if (
                    target_rel is None
                    or target_rel not in seen
                    or seen[target_rel] != entry.sha256
                    or manifest.files[target_rel].size != entry.size
                ):
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


def unpack(path: str | Path, dest: Path) -> Manifest:
    """Every file of the artifact's cache tree into ``dest``, verified (no staging: for scratch directories only;
    installing into a live cache is :func:`kernelpack.install.install`'s job)."""
    manifest = read_manifest(path)
    for member in iter_members(path, manifest):
        out = dest / member.path
        out.parent.mkdir(parents=True, exist_ok=True)
        if member.link_to is not None:
            out.write_bytes((dest / member.link_to).read_bytes())
        else:
            with open(out, "wb") as f:
                member.write(f)
    return manifest


def _no_write(dst: IO[bytes]) -> None:
    raise AssertionError("hard-link members have no bytes: copy the target's")


def artifact_name(recipe: str, tag: str) -> str:
    return f"{recipe}-{tag}{SUFFIX}"
