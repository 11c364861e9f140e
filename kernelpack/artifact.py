"""The ``.kpack`` artifact: one zstd-compressed tar stream, ``manifest.json`` first, then the cache tree.

Layout::

    manifest.json                 format, versions, recipe, configs, build key, every file's size and sha256, and
                                  the sha256 of all of that (``manifest_sha256``: a flipped bit anywhere is refused)
    cache/<path in the cache dir> one regular member per distinct content; a later file with the same content is a
                                  hard-link member pointing at the first one (tar's own dedup, so ``tar -x`` works)

The manifest itself, its typed owner and what it covers, is :mod:`kernelpack.manifest`; this module is the archive
around it: pack, merge, the hostile-archive reader, unpack.

Packing is deterministic: members sorted, mtime/uid/gid/uname/gname fixed, modes normalized, and zstd's
multi-threaded output does not depend on the thread count, so the same cache tree and manifest give the same bytes.

Reading never trusts the archive: every member is checked against the manifest (name, type, size, sha256) while it
streams, names must be normalized relative paths under ``cache/``, the only links allowed are hard links to an
earlier member, and the expanded size is capped by the manifest's own total before anything is read.

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from . import _fs
from ._fs import sha256_file
from .errors import ArtifactError, ArtifactNotFoundError, KernelpackError
from .manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    check_member_name,
    is_shipped,
    merge_manifests,
)

TREE_PREFIX = "cache/"
MAX_MANIFEST_BYTES = 64 << 20
# zstd long-distance matching finds the Triton binaries that appear both as files and inside FX-graph entries
# (pickled bundles), which file-level dedup cannot see. The reader must allow the same window.
WINDOW_LOG = 27
_CHUNK = 1 << 20


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


def hash_files(files: Mapping[str, Path]) -> list[FileEntry]:
    return [FileEntry(rel, files[rel].stat().st_size, sha256_file(files[rel])) for rel in sorted(files)]


# ------------------------------------------------------------------------------------------------ writing


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode = size, 0, 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def pack(
    out_path: Path, manifest: Manifest, sources: Mapping[str, Path], *, level: int = 10, threads: int = -1
) -> Path:
    """Write the artifact atomically: ``manifest``, then each of its files read from ``sources[path]``.

    Raises :class:`KernelpackError` naming the output when it cannot be written; nothing is left behind."""
    import zstandard

    params = zstandard.ZstdCompressionParameters.from_level(
        level, threads=threads, enable_ldm=True, window_log=WINDOW_LOG, write_checksum=True
    )
    manifest_bytes = manifest.to_json()
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with _fs.atomic_write(out_path, fsync=True) as raw:
            cctx = zstandard.ZstdCompressor(compression_params=params)
            with cctx.stream_writer(raw, closefd=False) as zw:
                with tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                    tar.addfile(_tarinfo(MANIFEST_NAME, len(manifest_bytes)), io.BytesIO(manifest_bytes))
                    first_with: dict[str, str] = {}
                    for rel, entry in sorted(manifest.files.items()):
                        name = TREE_PREFIX + rel
                        if entry.sha256 in first_with:
                            ti = _tarinfo(name, 0)
                            ti.type, ti.linkname = tarfile.LNKTYPE, first_with[entry.sha256]
                            tar.addfile(ti)
                            continue
                        first_with[entry.sha256] = name
                        with open(sources[rel], "rb") as f:
                            tar.addfile(_tarinfo(name, entry.size), f)
    except OSError as e:
        raise KernelpackError(
            f"cannot write the artifact {out_path}: {type(e).__name__}: {e}",
            hint="choose a writable output directory with -o and check its free space",
        ) from e
    return out_path


def merge(artifacts: Sequence[str | Path], out_dir: str | Path, *, level: int = 10) -> tuple[Path, Manifest]:
    """Combine artifacts of one recipe built for the same build key (CI shards) into one artifact.

    Refuses mixed keys or recipes, naming the field that differs. Configs and their devices are unioned; for a cache
    path present in several inputs, the first input wins (inputs are taken in the order given)."""
    if len(artifacts) < 2:
        raise KernelpackError("merge needs at least two artifacts", hint="kernelpack merge A.kpack B.kpack -o DIR")
    if not str(out_dir).strip():
        raise KernelpackError("merge -o: an empty directory name", hint="kernelpack merge A.kpack B.kpack -o DIR")
    manifests = [read_manifest(a) for a in artifacts]
    merged = merge_manifests(manifests, [str(a) for a in artifacts])
    with tempfile.TemporaryDirectory(prefix="kernelpack-merge-") as tmp:
        sources: dict[str, Path] = {}
        for n, path in enumerate(artifacts):
            tree = Path(tmp, str(n))
            for rel in unpack(path, tree).files:
                sources.setdefault(rel, tree / rel)
        out = pack(Path(out_dir) / merged.name, merged, sources, level=level)
    return out, merged


# ---------------------------------------------------------------------------------------------------------- reading


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
        raw = _fs.open_regular(path)
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
    return Manifest.from_json(blob, source=path)


@contextlib.contextmanager
def _wrap_errors(path: str, member: str | None = None) -> Iterator[None]:
    """Turn the decoder's and tarfile's exceptions into an ArtifactError naming the file (and the member read)."""
    import zstandard

    try:
        yield
    except (zstandard.ZstdError, tarfile.TarError, EOFError) as e:
        raise ArtifactError(path, f"corrupt or truncated artifact: {type(e).__name__}: {e}", member=member) from e


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
            check_member_name(path, rel)
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
                with _wrap_errors(path, name):
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


@dataclass(frozen=True, slots=True)
class MemberCheck:
    """What :func:`check_members` verified: every file the manifest lists (hard links included), their bytes."""

    manifest: Manifest
    members: int
    size: int  # expanded bytes


def check_members(path: str | Path) -> MemberCheck:
    """Read the whole artifact and check every member against its manifest, writing nothing: each listed file
    present once, with its size and sha256, no member that is not listed, and a stream that is neither truncated nor
    corrupt (tarfile reads whole 10 KiB records, so the tar's end and zstd's frame checksum are read too). An
    install's checks (:func:`iter_members`), without a target and without torch, plus one an install does not need
    (its members are whole either way): the file ends where its zstd frame ends. ``kernelpack inspect --verify``.

    Raises :class:`ArtifactError` naming the first bad member."""
    manifest = read_manifest(path)
    try:
        with open(os.devnull, "wb") as sink:
            for member in iter_members(path, manifest):
                if member.link_to is None:
                    member.write(sink)
        _check_frame_end(str(path))
    except ArtifactError as e:
        e.hint = "the artifact is damaged: download, copy or rebuild it again"
        raise
    return MemberCheck(manifest, len(manifest.files), manifest.total_size)


def _check_frame_end(path: str) -> None:
    """The file must end exactly where its zstd frame ends. A cut of 1 to 3 bytes falls inside the frame's 4-byte
    checksum: the decoder has every block by then and reports no error at EOF, and every member's hash is right, so
    only walking the frame's block headers (RFC 8878, 3.1.1.2) to its end tells. Trailing bytes after the frame are
    refused too: the builder writes one frame and nothing after it."""
    import zstandard

    with _wrap_errors(path), _fs.open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(18)  # a frame header's maximum size
        params = zstandard.get_frame_parameters(head)
        pos = zstandard.frame_header_size(head)
        while True:
            f.seek(pos)
            block = f.read(3)
            if len(block) < 3:
                raise ArtifactError(path, f"truncated artifact: {size} bytes end inside the zstd frame's blocks")
            header = int.from_bytes(block, "little")
            last, kind, block_size = header & 1, (header >> 1) & 3, header >> 3
            if kind == 3:
                raise ArtifactError(path, f"corrupt artifact: reserved zstd block type at byte {pos}")
            pos += 3 + (1 if kind == 1 else block_size)  # an RLE block stores its one byte
            if last:
                break
        end = pos + (4 if params.has_checksum else 0)
    if end > size:
        raise ArtifactError(path, f"truncated artifact: {size} bytes, its zstd frame ends at byte {end} (checksum cut)")
    if end < size:
        raise ArtifactError(path, f"corrupt artifact: {size - end} bytes after the end of its zstd frame")


def unpack(path: str | Path, dest: Path) -> Manifest:
    """Every file of the artifact's cache tree into ``dest``, verified (no staging: for scratch directories only;
    installing into a live cache is :func:`kernelpack.installer.install_artifact`'s job)."""
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
