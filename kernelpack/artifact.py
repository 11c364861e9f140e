"""The ``.kpack`` artifact: a tar stream in zstd frames, ``manifest.json`` first, then the cache tree by parts.

Layout, one zstd frame per row::

    manifest.json                 format, versions, recipe, configs, build key, every file's size and sha256, the
                                  parts (each one's files, owners, frame offset and size), and the sha256 of all of
                                  that (``manifest_sha256``: a flipped bit anywhere is refused)
    cache/<path in the cache dir> one frame per part: the files of one tier made for one set of (config, device)
    ...                           pairs (:class:`~kernelpack.manifest.Part`); in a part, one regular member per
                                  distinct content, a later file with the same content a hard-link member pointing
                                  at the first one (tar's own dedup). A part is compressed against its tier's first
                                  part (the first config's), a zstd raw-content dictionary: buckets of one call are
                                  the same kernels at other sizes
    (two zero blocks)             the tar's end

A process reads the manifest's frame, then seeks to the frames of the parts its calls need: installing is
proportional to what a job uses, not to the artifact (job start, docs/ARCHITECTURE.md).

The manifest itself, its typed owner and what it covers, is :mod:`kernelpack.manifest`; this module is the archive
around it: pack, merge, the hostile-archive reader, unpack.

Packing is deterministic: parts and members sorted, mtime/uid/gid/uname/gname fixed, modes normalized, and zstd's
multi-threaded output does not depend on the thread count, so the same cache tree and manifest give the same bytes.

Reading never trusts the archive: every member is checked against the manifest (name, type, size, sha256) while it
streams, names must be normalized relative paths under ``cache/``, the only links allowed are hard links to an
earlier member, and the expanded size is capped by the manifest's own total before anything is read.

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
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
from .parts import Part, owner, plan_parts

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
    out_path: Path,
    manifest: Manifest,
    sources: Mapping[str, Path],
    *,
    owners: Mapping[str, Collection[str]] | None = None,
    level: int = 10,
    threads: int = -1,
) -> tuple[Path, Manifest]:
    """Write the artifact atomically: ``manifest`` in the first zstd frame, then each part of its files (a
    :class:`~kernelpack.manifest.Part`: one per tier and set of ``owners``, the (config, device) pairs whose worker
    wrote the file; default: as ``manifest``'s own parts say) in a frame of its own, read from ``sources[path]``,
    then the tar's end. Returns the path and the manifest as written (with its parts' offsets).

    Raises :class:`KernelpackError` naming the output when it cannot be written; nothing is left behind."""
    import zstandard

    params = zstandard.ZstdCompressionParameters.from_level(
        level, threads=threads, enable_ldm=True, window_log=WINDOW_LOG, write_checksum=True
    )
    everyone = [owner(c.id, d) for c, d in manifest.pairs()]
    plan = plan_parts(list(manifest.files), manifest.owners() if owners is None else owners, everyone)
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        # a dictionary part's tar bytes: in memory, to compress the parts that use it against
        references = {p.dictionary: b"" for p in plan if p.dictionary is not None}
        for i in references:
            references[i] = b"".join(_part_tar(plan[i], manifest, sources))
        with tempfile.TemporaryFile(dir=out_path.parent, prefix=".kpack-parts-") as frames:
            parts = []
            for i, part in enumerate(plan):
                at = frames.tell()
                d = part.dictionary
                dictionary = _dictionary(references[d]) if d is not None else None
                cctx = zstandard.ZstdCompressor(compression_params=params, dict_data=dictionary)
                with cctx.stream_writer(frames, closefd=False) as zw:
                    if i in references:
                        zw.write(references[i])
                    else:
                        for chunk in _part_tar(part, manifest, sources):
                            zw.write(chunk)
                parts.append(dataclasses.replace(part, offset=at, size=frames.tell() - at))
            manifest = dataclasses.replace(manifest, parts=tuple(parts))
            manifest_bytes = manifest.to_json()
            frames.seek(0)
            with _fs.atomic_write(out_path, fsync=True) as raw:
                cctx = zstandard.ZstdCompressor(compression_params=params)
                head = _header(_tarinfo(MANIFEST_NAME, len(manifest_bytes))) + manifest_bytes
                raw.write(cctx.compress(head + _padding(len(manifest_bytes))))
                shutil.copyfileobj(frames, raw, _CHUNK)
                raw.write(cctx.compress(bytes(2 * tarfile.BLOCKSIZE)))  # the tar's end
    except OSError as e:
        raise KernelpackError(
            f"cannot write the artifact {out_path}: {type(e).__name__}: {e}",
            hint="choose a writable output directory with -o and check its free space",
        ) from e
    return out_path, manifest


def _part_tar(part: Part, manifest: Manifest, sources: Mapping[str, Path]) -> Iterator[bytes]:
    """A part's members as tar bytes (no end blocks: the archive's end is a frame of its own)."""
    first_with: dict[str, str] = {}  # hard links only inside a part: a part is read alone
    for rel in part.files:
        entry = manifest.files[rel]
        name = TREE_PREFIX + rel
        if entry.sha256 in first_with:
            ti = _tarinfo(name, 0)
            ti.type, ti.linkname = tarfile.LNKTYPE, first_with[entry.sha256]
            yield _header(ti)
            continue
        first_with[entry.sha256] = name
        yield _header(_tarinfo(name, entry.size))
        n = 0
        with open(sources[rel], "rb") as f:
            while chunk := f.read(_CHUNK):
                n += len(chunk)
                yield chunk
        if n != entry.size:
            raise KernelpackError(f"{sources[rel]} changed size while it was packed ({n} bytes, not {entry.size})")
        yield _padding(n)


def _dictionary(content: bytes) -> Any:
    import zstandard

    return zstandard.ZstdCompressionDict(content, dict_type=zstandard.DICT_TYPE_RAWCONTENT)


def _header(ti: tarfile.TarInfo) -> bytes:
    return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _padding(n: int) -> bytes:
    return bytes(-n % tarfile.BLOCKSIZE)


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
        owners: dict[str, set[str]] = {}
        for m in manifests:  # a path two shards hold is each's (the first one's bytes win, as for files)
            for rel, who in m.owners().items():
                owners.setdefault(rel, set()).update(who)
        return pack(Path(out_dir) / merged.name, merged, sources, owners=owners, level=level)


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


def iter_members(
    path: str | Path,
    manifest: Manifest,
    parts: Iterable[int] | None = None,
    *,
    base: int | None = None,
    dictionaries: dict[int, bytes] | None = None,
) -> Iterator[Member]:
    """Yield every file of ``parts`` (indices into ``manifest.parts``; default: all), part by part in archive order,
    each checked against ``manifest`` as it is written. Each part's frame is read alone, at its offset: ``base`` is
    where manifest.json's frame ends (:func:`parts_base`; found here when not given). ``dictionaries``: the tar
    bytes of dictionary parts decompressed already (filled here: a caller that reads more parts later keeps it).

    Raises :class:`ArtifactError` on any mismatch: an unknown, duplicate, missing, unsafe or oversize member, a member
    of another part, a link that does not point at an earlier member of its part with the same content, a sha256 that
    differs, a frame that does not end where the manifest says, or a corrupt stream.
    """
    path = str(path)
    indices = range(len(manifest.parts)) if parts is None else sorted(set(parts))
    if manifest.files and not manifest.parts:
        raise ArtifactError(path, "manifest.json lists files but no parts: not written by kernelpack's packer")
    try:
        raw = _fs.open_regular(path)
    except OSError as e:
        raise ArtifactError(path, f"cannot open: {type(e).__name__}: {e}") from None
    with raw:
        size = os.fstat(raw.fileno()).st_size
        if base is None:
            base = _frame_end(raw, 0, size, path)
        known = {} if dictionaries is None else dictionaries
        for i in indices:
            yield from _part_members(path, raw, size, base, manifest, i, known)


def parts_base(path: str | Path) -> int:
    """Where manifest.json's frame ends: the parts' offsets count from here."""
    path = str(path)
    with _wrap_errors(path), _fs.open_regular(path) as raw:
        return _frame_end(raw, 0, os.fstat(raw.fileno()).st_size, path)


def _frame(path: str, raw: IO[bytes], size: int, base: int, manifest: Manifest, index: int) -> bytes:
    """Part ``index``'s compressed frame, checked to end where the manifest says."""
    part = manifest.parts[index]
    at = base + part.offset
    if at + part.size > size:
        raise ArtifactError(
            path,
            f"truncated artifact: {size} bytes, its part {index}'s frame ({len(part.files)} files, the first named "
            f"here) ends at byte {at + part.size}",
            member=TREE_PREFIX + part.files[0],
        )
    raw.seek(at)
    data = raw.read(part.size)
    if len(data) != part.size or _frame_end(io.BytesIO(data), 0, part.size, path) != part.size:
        raise ArtifactError(
            path,
            f"corrupt artifact: part {index}'s frame ({len(part.files)} files, the first named here) does not end "
            "where manifest.json says",
            member=TREE_PREFIX + part.files[0],
        )
    return data


def _limit(manifest: Manifest, part: Part) -> int:
    """What a part's frame may expand to: its files, and room for their tar headers."""
    expanded = sum(manifest.files[rel].size for rel in part.files)
    return expanded + _HEADER_SLACK + _PER_MEMBER_SLACK * (len(part.files) + 1)


def _decompressor(
    path: str, raw: IO[bytes], size: int, base: int, manifest: Manifest, index: int, dictionaries: dict[int, bytes]
) -> Any:
    """A decoder for part ``index``'s frame: with its dictionary part's tar bytes (decompressed here once, kept in
    ``dictionaries``), where it has one."""
    import zstandard

    d = manifest.parts[index].dictionary
    if d is None:
        return zstandard.ZstdDecompressor(max_window_size=1 << WINDOW_LOG)
    if d not in dictionaries:
        frame = _frame(path, raw, size, base, manifest, d)
        dctx = zstandard.ZstdDecompressor(max_window_size=1 << WINDOW_LOG)
        limit = _limit(manifest, manifest.parts[d])
        with _wrap_errors(path), dctx.stream_reader(io.BytesIO(frame), read_across_frames=False) as stream:
            budget = _Budget(stream, path, limit)
            dictionaries[d] = b"".join(iter(lambda: budget.read(_CHUNK), b""))  # to its end, whatever a read returns
    return zstandard.ZstdDecompressor(max_window_size=1 << WINDOW_LOG, dict_data=_dictionary(dictionaries[d]))


def _part_members(
    path: str,
    raw: IO[bytes],
    size: int,
    base: int,
    manifest: Manifest,
    index: int,
    dictionaries: dict[int, bytes],
) -> Iterator[Member]:
    part = manifest.parts[index]
    data = _frame(path, raw, size, base, manifest, index)
    wanted = set(part.files)
    limit = _limit(manifest, part)
    seen: dict[str, str] = {}  # member path -> sha256 of its verified content
    dctx = _decompressor(path, raw, size, base, manifest, index, dictionaries)
    with dctx.stream_reader(io.BytesIO(data), read_across_frames=False) as stream, _wrap_errors(path):
        tar = tarfile.open(fileobj=_Budget(stream, path, limit), mode="r|")
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
            if rel not in wanted:
                raise ArtifactError(path, f"member of another part than its frame's ({index})", member=name)
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
    missing = wanted - seen.keys()
    if missing:
        raise ArtifactError(
            path, f"{len(missing)} file(s) of manifest.json missing from part {index}", member=sorted(missing)[0]
        )


@dataclass(frozen=True, slots=True)
class MemberCheck:
    """What :func:`check_members` verified: every file the manifest lists (hard links included), their bytes."""

    manifest: Manifest
    members: int
    size: int  # expanded bytes


def check_members(path: str | Path) -> MemberCheck:
    """Read the whole artifact and check every member against its manifest, writing nothing: each listed file
    present once, in its part, with its size and sha256, no member that is not listed, and a stream that is neither
    truncated nor corrupt. An install's checks (:func:`iter_members`), without a target and without torch, plus one
    an install does not need (its members are whole either way): the frames follow each other with nothing between
    them, and the file ends where the tar's end frame ends. ``kernelpack inspect --verify``.

    Raises :class:`ArtifactError` naming the first bad member."""
    manifest = read_manifest(path)
    try:
        base = parts_base(path)
        with open(os.devnull, "wb") as sink:
            for member in iter_members(path, manifest, base=base):
                if member.link_to is None:
                    member.write(sink)
        _check_layout(str(path), manifest, base)
    except ArtifactError as e:
        e.hint = "the artifact is damaged: download, copy or rebuild it again"
        raise
    return MemberCheck(manifest, len(manifest.files), manifest.total_size)


def _check_layout(path: str, manifest: Manifest, base: int) -> None:
    """After the parts' frames (each checked where it was read), exactly one more: the tar's end, then the file's."""
    import zstandard

    with _wrap_errors(path), _fs.open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        at = base + sum(p.size for p in manifest.parts)
        end = _frame_end(f, at, size, path)
        f.seek(at)
        tail = zstandard.ZstdDecompressor().decompress(f.read(end - at), max_output_size=1 << 20)
    if tail.strip(b"\0"):
        raise ArtifactError(path, "corrupt artifact: its last frame is not the tar's end")
    if end < size:
        raise ArtifactError(path, f"corrupt artifact: {size - end} bytes after the end of its last zstd frame")


def _frame_end(f: IO[bytes], pos: int, size: int, path: str) -> int:
    """Where the zstd frame that starts at ``pos`` ends, from its header and block headers alone (RFC 8878, 3.1.1):
    a few reads per 128 KiB block, nothing decompressed. A cut of 1 to 3 bytes falls inside a frame's 4-byte
    checksum: the decoder has every block by then and reports no error at EOF, so only this walk tells."""
    import zstandard

    with _wrap_errors(path):
        f.seek(pos)
        head = f.read(18)  # a frame header's maximum size
        params = zstandard.get_frame_parameters(head)
        pos += zstandard.frame_header_size(head)
        while True:
            f.seek(pos)
            block = f.read(3)
            if len(block) < 3:
                raise ArtifactError(path, f"truncated artifact: {size} bytes end inside a zstd frame's blocks")
            header = int.from_bytes(block, "little")
            last, kind, block_size = header & 1, (header >> 1) & 3, header >> 3
            if kind == 3:
                raise ArtifactError(path, f"corrupt artifact: reserved zstd block type at byte {pos}")
            pos += 3 + (1 if kind == 1 else block_size)  # an RLE block stores its one byte
            if last:
                break
        end = pos + (4 if params.has_checksum else 0)
    if end > size:
        raise ArtifactError(path, f"truncated artifact: {size} bytes, a zstd frame ends at byte {end} (checksum cut)")
    return end


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
