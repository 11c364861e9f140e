from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import zstandard
from test_keys import H200

from kernelpack import artifact as art
from kernelpack import manifest as mf
from kernelpack.errors import ArtifactError, ArtifactNotFoundError

BUILD_KEY = H200.to_dict()


def make_tree(root: Path) -> dict[str, bytes]:
    content = {
        "fxgraph/ab/fabc/entry": b"fx-entry" * 100,
        "triton/0/HASH/kernel.cubin": b"\x7fELF-cubin" * 50,
        "triton/0/HASH/kernel.json": b'{"name": "kernel"}',
        "triton/0/OTHER/kernel.cubin": b"\x7fELF-cubin" * 50,  # same bytes as the first cubin: stored once
        "aotautograd/aa/entry": b"aot",
        "locks/x.lock": b"",  # never shipped
    }
    for rel, data in content.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return {k: v for k, v in content.items() if not k.startswith("locks/")}


def manifest_for(entries: list[mf.FileEntry], **extra: object) -> dict:
    return {
        "format": mf.FORMAT_VERSION,
        "name": "t.kpack",
        "recipe": {"name": "t"},
        "configs": [],
        "build_key": BUILD_KEY,
        "files": [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in entries],
        **extra,
    }


def pack_tree(root: Path, out: Path, threads: int = -1) -> tuple[dict, list[mf.FileEntry]]:
    files = art.scan_tree(root)
    entries = art.hash_files(files)
    _, written = art.pack(out, mf.Manifest.from_dict(manifest_for(entries), source=str(out)), files, threads=threads)
    return written.to_dict(), entries  # as packed: with its parts


def test_pack_is_deterministic_and_independent_of_threads(tmp_path: Path) -> None:
    make_tree(tmp_path / "a")
    make_tree(tmp_path / "b")  # another directory, other mtimes/inodes
    pack_tree(tmp_path / "a", tmp_path / "1.kpack", threads=1)
    pack_tree(tmp_path / "b", tmp_path / "2.kpack", threads=4)
    pack_tree(tmp_path / "a", tmp_path / "3.kpack", threads=-1)
    one = (tmp_path / "1.kpack").read_bytes()
    assert one == (tmp_path / "2.kpack").read_bytes() == (tmp_path / "3.kpack").read_bytes()
    (tmp_path / "b" / "aotautograd" / "aa" / "entry").write_bytes(b"changed")
    pack_tree(tmp_path / "b", tmp_path / "4.kpack")
    assert (tmp_path / "4.kpack").read_bytes() != one


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o000, 0o644)])
def test_artifact_file_mode_follows_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    """Not mkstemp's 0600: a published artifact must be readable by the node's other users under a usual umask, and
    never writable by them, even with umask 0 (it carries executable kernels)."""
    import os

    make_tree(tmp_path / "t")
    old = os.umask(umask)
    try:
        pack_tree(tmp_path / "t", tmp_path / "a.kpack")
    finally:
        os.umask(old)
    assert (tmp_path / "a.kpack").stat().st_mode & 0o777 == mode


def test_layout_manifest_first_dedup_by_hard_link_fixed_metadata(tmp_path: Path) -> None:
    content = make_tree(tmp_path / "t")
    pack_tree(tmp_path / "t", tmp_path / "a.kpack")
    data = (tmp_path / "a.kpack").read_bytes()
    # one stream to a plain zstd reader: the frames follow each other
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True).read()
    m = art.read_manifest(tmp_path / "a.kpack")
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        members = tar.getmembers()
        assert members[0].name == "manifest.json"
        names = [m.name for m in members[1:]]
        assert names == ["cache/" + rel for part in m.parts for rel in part.files]
        assert sorted(names) == ["cache/" + k for k in sorted(content)]
        links = [m for m in members if m.islnk()]
        assert [(m.name, m.linkname) for m in links] == [
            ("cache/triton/0/OTHER/kernel.cubin", "cache/triton/0/HASH/kernel.cubin")
        ]
        assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}
        # a plain tar reader gets the cache tree back (no config here: no part is compressed against a dictionary)
        tar.extractall(tmp_path / "x", filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(
            tmp_path / "x"
        )
    for rel, blob in content.items():
        assert (tmp_path / "x" / "cache" / rel).read_bytes() == blob
    # each part is a frame of its own at the offset the manifest gives: read alone, it holds its files and no other
    assert [p.tier1 for p in m.parts] == [False, True] and set(m.parts[1].files) == {
        "fxgraph/ab/fabc/entry",
        "aotautograd/aa/entry",
    }
    base = art.parts_base(tmp_path / "a.kpack")
    for part in m.parts:
        frame = data[base + part.offset : base + part.offset + part.size]
        alone = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(frame), read_across_frames=False).read()
        with tarfile.open(fileobj=io.BytesIO(alone)) as tar:
            assert [t.name for t in tar.getmembers()] == ["cache/" + rel for rel in part.files]
    assert base + sum(p.size for p in m.parts) < len(data)  # the tar's end, a frame of its own


def test_read_manifest_without_extracting(tmp_path: Path) -> None:
    make_tree(tmp_path / "t")
    manifest, entries = pack_tree(tmp_path / "t", tmp_path / "a.kpack")
    m = art.read_manifest(tmp_path / "a.kpack")
    assert m == mf.Manifest.from_dict(manifest, source="x") and set(m.files) == {e.path for e in entries}


def consume(path: Path, m: mf.Manifest) -> dict[str, bytes]:
    got: dict[str, bytes] = {}
    for member in art.iter_members(path, m):
        if member.link_to:
            got[member.path] = got[member.link_to]
        else:
            buf = io.BytesIO()
            member.write(buf)
            got[member.path] = buf.getvalue()
    return got


def test_iter_members_round_trip(tmp_path: Path) -> None:
    content = make_tree(tmp_path / "t")
    pack_tree(tmp_path / "t", tmp_path / "a.kpack")
    assert consume(tmp_path / "a.kpack", art.read_manifest(tmp_path / "a.kpack")) == content


def test_missing_and_not_an_artifact(tmp_path: Path) -> None:
    with pytest.raises(ArtifactNotFoundError):
        art.read_manifest(tmp_path / "nope.kpack")
    (tmp_path / "x.kpack").write_bytes(b"hello, not zstd")
    with pytest.raises(ArtifactError, match="corrupt or truncated"):
        art.read_manifest(tmp_path / "x.kpack")


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.95])
def test_truncated_artifact_is_rejected(tmp_path: Path, cut: float) -> None:
    make_tree(tmp_path / "t")
    pack_tree(tmp_path / "t", tmp_path / "a.kpack")
    m = art.read_manifest(tmp_path / "a.kpack")
    data = (tmp_path / "a.kpack").read_bytes()
    (tmp_path / "a.kpack").write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(ArtifactError):
        art.read_manifest(tmp_path / "a.kpack")
        consume(tmp_path / "a.kpack", m)


def raw_artifact(path: Path, manifest: dict, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> None:
    """Write an arbitrary (possibly hostile) archive: kernelpack's reader must judge it, not this writer. Laid out as
    the packer lays it out: the manifest's frame, every member in one part's frame (the manifest's files as one
    part, when it lists files as a list), the tar's end."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for ti, data in members:
            tar.addfile(ti, io.BytesIO(data) if data is not None else None)
    body = buf.getvalue()
    cctx = zstandard.ZstdCompressor()
    frame = cctx.compress(_without_end(body))
    files = manifest.get("files")
    if isinstance(files, list) and files and all(isinstance(f, dict) and isinstance(f.get("path"), str) for f in files):
        rels = sorted(f["path"] for f in files)
        manifest = {
            "parts": [{"owners": [], "tier1": False, "files": rels, "offset": 0, "size": len(frame)}],
            **manifest,
        }
    blob = mf.seal(manifest)  # sealed as the packer would: what is tried is the reader's checks behind the seal
    head = io.BytesIO()
    with tarfile.open(fileobj=head, mode="w", format=tarfile.PAX_FORMAT) as tar:
        ti = tarfile.TarInfo("manifest.json")
        ti.size = len(blob)
        tar.addfile(ti, io.BytesIO(blob))
    path.write_bytes(cctx.compress(_without_end(head.getvalue())) + frame + cctx.compress(bytes(1024)))


def _without_end(tar_bytes: bytes) -> bytes:
    """A tar stream without its end-of-archive blocks and record padding (all zero bytes after the last member)."""
    n = len(tar_bytes)
    while n >= 512 and not any(tar_bytes[n - 512 : n]):
        n -= 512
    return tar_bytes[:n]


def entry(rel: str, data: bytes) -> mf.FileEntry:
    import hashlib

    return mf.FileEntry(rel, len(data), hashlib.sha256(data).hexdigest())


def reg(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    return ti, data


def special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname = kind, linkname
    return ti, None


@pytest.mark.parametrize(
    "listed, members, fragment",
    [
        (["../evil"], [reg("cache/../evil", b"x")], "unsafe"),
        (["a"], [reg("/etc/a", b"x")], "outside cache/"),
        (["a"], [reg("cache/a", b"x"), reg("cache/a", b"x")], "duplicate member"),
        (["a"], [reg("cache/b", b"x")], "not listed"),
        (["a"], [special("cache/a", tarfile.SYMTYPE, "/etc/passwd")], "not allowed"),
        (["a"], [special("cache/a", tarfile.LNKTYPE, "/etc/passwd")], "hard link"),
        (["a"], [special("cache/a", tarfile.CHRTYPE)], "not allowed"),
        (["a"], [special("cache/a", tarfile.FIFOTYPE)], "not allowed"),
        (["a", "b"], [reg("cache/a", b"x")], "missing"),
        (["a"], [reg("cache/a", b"y")], "sha256 differs"),
        (["a"], [reg("cache/a", b"xx")], "size"),
        (["a/./b"], [reg("cache/a/./b", b"x")], "unsafe"),
    ],
)
def test_hostile_or_inconsistent_members_are_rejected(
    tmp_path: Path, listed: list[str], members: list, fragment: str
) -> None:
    entries = [entry(rel, b"x") for rel in listed]
    path = tmp_path / "h.kpack"
    raw_artifact(path, manifest_for(entries), members)
    with pytest.raises(ArtifactError, match=fragment):
        m = art.read_manifest(path)
        consume(path, m)


def test_decompression_bomb_is_capped_from_the_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_tree(tmp_path / "t")
    pack_tree(tmp_path / "t", tmp_path / "a.kpack")
    monkeypatch.setenv("KERNELPACK_MAX_EXPANDED_BYTES", "100")
    with pytest.raises(ArtifactError, match="over the cap"):
        art.read_manifest(tmp_path / "a.kpack")


def test_member_larger_than_its_manifest_size_is_refused(tmp_path: Path) -> None:
    big = b"z" * 4096
    e = entry("a", big)
    lying = manifest_for([mf.FileEntry("a", 10, e.sha256)])
    raw_artifact(tmp_path / "b.kpack", lying, [reg("cache/a", big)])
    with pytest.raises(ArtifactError, match="size"):
        consume(tmp_path / "b.kpack", art.read_manifest(tmp_path / "b.kpack"))


def test_scan_refuses_symlinks(tmp_path: Path) -> None:
    make_tree(tmp_path / "t")
    (tmp_path / "t" / "fxgraph" / "link").symlink_to("/etc/passwd")
    with pytest.raises(ArtifactError, match="non-regular"):
        art.scan_tree(tmp_path / "t")


def test_huge_pax_header_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A tiny artifact declaring a 96 MiB pax header: refused by the stream budget, not read into memory first."""
    import resource
    import time

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        ti = tarfile.TarInfo("manifest.json")
        ti.pax_headers = {"comment": "x" * (96 << 20)}
        tar.addfile(ti, io.BytesIO(b""))
    path = tmp_path / "bomb.kpack"
    path.write_bytes(zstandard.ZstdCompressor(level=3).compress(buf.getvalue()))
    del buf
    assert path.stat().st_size < 1 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    with pytest.raises(ArtifactError, match="expands past"):
        art.read_manifest(path)
    assert time.perf_counter() - t < 5
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200, grown_mib


@pytest.mark.parametrize(
    "files, fragment",
    [
        ([{"path": "a", "size": float("inf"), "sha256": "0" * 64}], "bad size"),
        ([{"path": "a", "size": "1", "sha256": "0" * 64}], "bad size"),
        (
            [{"path": "a", "size": 1, "sha256": "0" * 64}, {"path": "a/b", "size": 1, "sha256": "0" * 64}],
            "both as a file and as a directory",
        ),
        ([{"path": "x" * 300, "size": 1, "sha256": "0" * 64}], "unsafe"),
        ("not a list", "malformed"),
    ],
)
def test_malformed_manifest_fields_are_artifact_errors(tmp_path: Path, files: object, fragment: str) -> None:
    raw_artifact(tmp_path / "m.kpack", {**manifest_for([]), "files": files}, [])
    with pytest.raises(ArtifactError, match=fragment):
        art.read_manifest(tmp_path / "m.kpack")


@pytest.mark.parametrize("field, value", [("recipe", "x"), ("configs", [1]), ("build_key", {"a": 1}), ("name", 3)])
def test_manifest_with_wrong_types_is_refused(tmp_path: Path, field: str, value: object) -> None:
    raw_artifact(tmp_path / "m.kpack", {**manifest_for([]), field: value}, [])
    with pytest.raises(ArtifactError, match="malformed"):
        art.read_manifest(tmp_path / "m.kpack")


def _with_manifest(path: Path, out: Path, blob: bytes) -> None:
    """``path``'s archive with its manifest member's bytes replaced by ``blob`` (header resized to match): its first
    frame rewritten, the parts' frames after it as they were (their offsets count from its end)."""
    data = path.read_bytes()
    end = art.parts_base(path)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as dst:
        ti = tarfile.TarInfo(mf.MANIFEST_NAME)
        ti.size = len(blob)
        dst.addfile(ti, io.BytesIO(blob))
    out.write_bytes(zstandard.ZstdCompressor().compress(_without_end(buf.getvalue())) + data[end:])


def test_every_bit_flipped_in_the_manifest_is_refused_by_its_seal(tmp_path: Path) -> None:
    """Format 5 seals manifest.json with the sha256 of its canonical JSON: a flip in a field no check reads
    (``created``, the recipe text, a timing) is refused as surely as one in a file's sha256. Every byte of a real
    manifest is flipped (bit ``offset % 8``); each must be refused, never install."""
    content = make_tree(tmp_path / "t")
    pack_tree(tmp_path / "t", tmp_path / "a.kpack")
    blob = zstandard.ZstdDecompressor().decompressobj().decompress((tmp_path / "a.kpack").read_bytes())
    first = tarfile.open(fileobj=io.BytesIO(blob)).next()
    assert first is not None and first.name == mf.MANIFEST_NAME
    manifest = blob[first.offset_data : first.offset_data + first.size]
    assert consume(tmp_path / "a.kpack", art.read_manifest(tmp_path / "a.kpack")) == content
    refused: dict[str, int] = {}
    for i in range(len(manifest)):
        flipped = bytearray(manifest)
        flipped[i] ^= 1 << (i % 8)
        _with_manifest(tmp_path / "a.kpack", tmp_path / "f.kpack", bytes(flipped))
        with pytest.raises(ArtifactError) as e:
            art.read_manifest(tmp_path / "f.kpack")
        reason = "seal" if mf.SEAL in str(e.value) else "other"
        refused[reason] = refused.get(reason, 0) + 1
    assert sum(refused.values()) == len(manifest) and refused["seal"] > 0, refused

    data = json.loads(manifest)
    _with_manifest(tmp_path / "a.kpack", tmp_path / "e.kpack", json.dumps({**data, "created": 7}).encode())
    with pytest.raises(ArtifactError, match=rf"does not match its {mf.SEAL} .*changed after it was written"):
        art.read_manifest(tmp_path / "e.kpack")
    unsealed = {k: v for k, v in data.items() if k != mf.SEAL}
    _with_manifest(tmp_path / "a.kpack", tmp_path / "u.kpack", json.dumps(unsealed).encode())
    with pytest.raises(ArtifactError, match=rf"has no {mf.SEAL}"):
        art.read_manifest(tmp_path / "u.kpack")
    _with_manifest(tmp_path / "a.kpack", tmp_path / "r.kpack", mf.seal({**data, "created": 7}))  # resealed: accepted
    assert art.read_manifest(tmp_path / "r.kpack").created == 7


def test_unopenable_paths_are_artifact_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ArtifactError, match="cannot open"):
        art.read_manifest(tmp_path / "file" / "a.kpack")
    with pytest.raises(ArtifactError, match="directory"):
        art.read_manifest(tmp_path)


# ---------------------------------------------------------------------------------------------- the typed manifest

PARAMS = {
    "device": "cuda",
    "mask": "sliding_window",
    "window": 1024,
    "batch": 1,
    "q_heads": 32,
    "kv_heads": 8,
    "q_len": 4096,
    "kv_len": 4096,
    "head_dim": 128,
    "dtype": "bfloat16",
    "graphs": ["fwd+bwd"],
    "kernel_options": {},
    "mode": "default",
    "dynamic": False,
}


def with_configs(*configs: dict, **extra: object) -> dict:
    return {**manifest_for([]), "configs": list(configs), **extra}


def test_manifest_round_trips_through_json() -> None:
    data = with_configs(
        {"params": PARAMS, "devices": [1, 0], "mask_key": "sliding_window(1024)", "compile_seconds": 2.5},
        {"params": {**PARAMS, "q_len": 8192, "kv_len": 8192}, "devices": [0], "mask_key": "sliding_window(1024)"},
    )
    m = mf.Manifest.from_dict(data, source="m")
    again = mf.Manifest.from_dict(json.loads(m.to_json()), source="m")
    assert again == m and again.to_json() == m.to_json()
    assert m.devices == (0, 1) and [(c.config.q_len, d) for c, d in m.pairs()] == [(4096, 0), (4096, 1), (8192, 0)]
    assert m.to_dict()["configs"][0]["id"] == m.configs[0].config.id and m.to_dict()["devices"] == [0, 1]
    assert "device_index" not in m.to_dict()  # each config lists its devices (format 6)
    with pytest.raises(ArtifactError, match="configs: KeyError"):  # and must
        mf.Manifest.from_dict(with_configs({"params": PARAMS, "mask_key": "sliding_window(1024)"}), source="m")


def test_precompiled_functions_round_trip_and_must_be_files_of_the_artifact() -> None:
    """Tier 2's entries: listed per config, device and graph; a path outside kernelpack-precompiled/ or
    not among the files is refused, as is an unknown graph."""
    sha = "ab" * 32
    blob = {"path": f"kernelpack-precompiled/x-0-fwd_bwd-{sha[:32]}.bin", "size": 3, "sha256": sha}
    entry = {"device": 0, "graph": "fwd+bwd", "path": blob["path"], "sha256": sha, "seconds": 1.5}
    config = {"params": PARAMS, "devices": [0], "mask_key": "sliding_window(1024)", "precompiled": [entry]}
    m = mf.Manifest.from_dict({**with_configs(config), "files": [blob]}, source="m")
    assert m.configs[0].precompiled_for(0, "fwd+bwd") == mf.Precompiled(
        device=0, graph="fwd+bwd", path=blob["path"], sha256=sha, seconds=1.5
    )
    assert m.configs[0].precompiled_for(0, "fwd") is None and m.configs[0].precompiled_for(1, "fwd+bwd") is None
    assert mf.Manifest.from_dict(json.loads(m.to_json()), source="m") == m
    bad = [
        ({**entry, "path": "fxgraph/x"}, [blob], "under kernelpack-precompiled/"),
        ({**entry, "path": "kernelpack-precompiled/../fxgraph/x"}, [blob], "under kernelpack-precompiled/"),
        (entry, [], "not among the files"),
        ({**entry, "graph": "bwd"}, [blob], "graph must be one of"),
        ({**entry, "device": 1}, [blob], "not a built device and graph"),
        # content-addressed: named by its sha256, which the files entry must hold too
        ({**entry, "sha256": "cd" * 32}, [blob], "the 64 hex digits its path is named by"),
        ({**entry, "sha256": None}, [blob], "the 64 hex digits"),
        (entry, [{**blob, "sha256": sha[:32] + "0" * 32}], "another sha256 in the files"),
    ]
    for wrong, files, fragment in bad:
        with pytest.raises(ArtifactError, match=fragment):
            mf.Manifest.from_dict({**with_configs({**config, "precompiled": [wrong]}), "files": files}, source="m")
    with pytest.raises(ArtifactError, match="listed twice"):
        mf.Manifest.from_dict({**with_configs({**config, "precompiled": [entry, entry]}), "files": [blob]}, source="m")


def test_a_manifest_of_format_1_is_refused_and_format_2_needs_every_mask_key() -> None:
    """Format 2 (mask_free, keys by type) has no fallbacks: a format-1 manifest is refused naming both
    formats, and a config without its mask_key is malformed (the label is no longer what a mask computes)."""
    old = with_configs({"params": PARAMS, "devices": [0], "mask_key": "sliding_window(1024)"})
    # 3: marks; 4: content-addressed tier 2; 5: the manifest sealed by its own sha256; 6: ids of every parameter
    for fmt in range(1, mf.FORMAT_VERSION):
        reads = rf"unsupported artifact format {fmt} \(this kernelpack reads {mf.FORMAT_VERSION}\)"
        with pytest.raises(ArtifactError, match=reads):
            mf.Manifest.from_dict({**old, "format": fmt}, source="old")
    with pytest.raises(ArtifactError, match="configs: TypeError: mask_key must be a string"):
        mf.Manifest.from_dict(with_configs({"params": PARAMS, "devices": [0]}), source="old")
    m = mf.Manifest.from_dict(
        with_configs({"params": PARAMS, "devices": [0], "mask_key": "m#1", "mask_free": ["S"]}), source="new"
    )
    assert m.configs[0].mask_free == ("S",) and m.free_sets == (("S",),)
    assert mf.Manifest.from_dict(json.loads(m.to_json()), source="again").configs[0].mask_free == ("S",)


def test_covers_hit_miss_nearest_and_the_one_field_that_differs() -> None:
    from kernelpack.config import Config

    m = mf.Manifest.from_dict(
        with_configs(
            {"params": PARAMS, "devices": [0], "mask_key": "sliding_window(1024)"},
            {"params": {**PARAMS, "window": 2048}, "devices": [0], "mask_key": "sliding_window(2048)"},
        ),
        source="m",
    )
    config = Config.from_dict(PARAMS)
    hit = m.covers(config.signature(0, "fwd+bwd"))
    assert hit.covered and hit.entry is m.configs[0] and hit.nearest == ()
    on_gpu3 = m.covers(config.signature(3, "fwd+bwd"))
    assert not on_gpu3.covered and on_gpu3.only == ("device_index", 0, 3)
    assert on_gpu3.nearest[0].differences == (("device_index", 0, 3),)
    forward_only = m.covers(config.signature(0, "fwd"))  # built fwd+bwd only (`backward = true`)
    assert not forward_only.covered and forward_only.only == ("graph", "fwd+bwd", "fwd")
    longer = Config.from_dict({**PARAMS, "q_len": 8192, "kv_len": 8192}).signature(0, "fwd+bwd")
    miss = m.covers(longer)
    assert miss.only is None and len(miss.nearest) == 2
    assert miss.nearest[0].describe().endswith("(differs in: q_len 4096 vs 8192, kv_len 4096 vs 8192)")
    assert "mask 'sliding_window(2048)' vs 'sliding_window(1024)'" in miss.nearest[1].describe()


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"params": {**PARAMS, "dtype": "float64"}}, "configs: dtype: unknown value (got 'float64')"),
        ({"params": {**PARAMS, "q_len": "4096"}}, "configs: q_len: must be a positive integer"),
        ({"params": {**PARAMS, "colour": 1}}, "configs: colour: unknown field"),
        ({"params": PARAMS, "devices": [-1], "mask_key": "sliding_window(1024)"}, "bad device index -1"),
        ({"params": PARAMS, "mask_key": 7}, "mask_key must be a string"),
    ],
)
def test_a_config_that_cannot_be_built_is_named(tmp_path: Path, config: dict, fragment: str) -> None:
    raw_artifact(tmp_path / "m.kpack", with_configs(config), [])
    with pytest.raises(ArtifactError, match=r"manifest\.json is malformed") as exc:
        art.read_manifest(tmp_path / "m.kpack")
    assert fragment in str(exc.value)


@pytest.mark.parametrize("command", ["inspect", "push", "merge"])
def test_a_bad_build_key_is_a_clear_error_in_every_command(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """At ecc4142 push and merge of such a manifest ended in a KeyError traceback."""
    from kernelpack.cli import main

    bad = tmp_path / "bad.kpack"
    raw_artifact(bad, {**manifest_for([]), "build_key": {"torch_version": "2.13.0"}}, [])
    args = {
        "inspect": ["inspect", str(bad)],
        "push": ["push", str(bad), str(tmp_path / "reg")],
        "merge": ["merge", str(bad), str(bad), "-o", str(tmp_path / "merged")],
    }[command]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "error: " in err and "build_key" in err and "torch_git" in err and "Traceback" not in err
    assert not (tmp_path / "reg").exists() and not (tmp_path / "merged").exists()


def test_merge_refuses_artifacts_without_a_built_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kernelpack.cli import main

    make_tree(tmp_path / "t")
    pack_tree(tmp_path / "t", tmp_path / "a.kpack")
    assert main(["merge", str(tmp_path / "a.kpack"), str(tmp_path / "a.kpack"), "-o", str(tmp_path / "m")]) == 1
    assert "holds a built config" in capsys.readouterr().err and not (tmp_path / "m").exists()


def test_a_part_is_compressed_against_the_first_config_s_part_and_reads_alone(tmp_path: Path) -> None:
    """Buckets of one call are the same kernels at other sizes: each part is compressed against the first config's
    part of its tier (a zstd raw-content dictionary), so 8 near-copies cost little more than one, and any part still
    reads alone (its dictionary part decompressed first, kept for the next). A dictionary part that is damaged fails
    the parts that use it, as ArtifactErrors; a manifest whose dictionary chain has two levels is refused."""
    import random

    rng = random.Random(0)
    kernel = rng.randbytes(256 << 10)  # incompressible alone: only the dictionary can shrink the copies
    tree, owners = tmp_path / "t", {}
    for i in range(8):
        rel = f"triton/0/K{i}/kernel.cubin"
        (tree / rel).parent.mkdir(parents=True)
        (tree / rel).write_bytes(kernel[: 1000 * i] + bytes([i]) + kernel[1000 * i + 1 :])  # one byte differs
        owners[rel] = {f"c{i}@0"}
    entries = art.hash_files(art.scan_tree(tree))
    configs = []
    for i in range(8):
        params = {**SMALL, "window": i + 1}
        configs.append({"id": mf.Config.from_dict(params).id, "params": params, "devices": [0], "mask_key": "m"})
    ids = [c["id"] for c in configs]
    owners = {rel: {f"{ids[int(rel.split('/')[2][1:])]}@0"} for rel in owners}
    data = manifest_for(entries, configs=configs)
    out, m = art.pack(tmp_path / "a.kpack", mf.Manifest.from_dict(data, source="a"), art.scan_tree(tree), owners=owners)
    reference = next(i for i, p in enumerate(m.parts) if p.owners == (f"{ids[0]}@0",))
    assert all(p.dictionary == reference for i, p in enumerate(m.parts) if i != reference)
    assert m.parts[reference].dictionary is None and m.parts[reference].size > 200 << 10
    assert sum(p.size for p in m.parts) < 1.2 * m.parts[reference].size  # 7 copies for a fifth of one
    last = len(m.parts) - 1 if reference != len(m.parts) - 1 else 0
    dictionaries: dict[int, bytes] = {}
    members = art.iter_members(out, m, [last], dictionaries=dictionaries)
    member, buf = next(members), io.BytesIO()
    member.write(buf)
    assert list(members) == [] and buf.getvalue() == (tree / member.path).read_bytes()
    assert set(dictionaries) == {reference}  # decompressed once, kept for the next part
    assert consume(out, art.read_manifest(out)) == {rel: (tree / rel).read_bytes() for rel in owners}
    # a damaged dictionary part: the parts compressed against it fail too, naming the artifact
    bad = bytearray(out.read_bytes())
    base = art.parts_base(out)
    bad[base + m.parts[reference].offset + m.parts[reference].size // 2] ^= 0xFF
    (tmp_path / "bad.kpack").write_bytes(bytes(bad))
    with pytest.raises(ArtifactError):
        consume_parts(tmp_path / "bad.kpack", m, [last])
    # two levels of dictionaries: refused when the manifest is read
    chained = m.to_dict()
    chained["parts"][reference]["dictionary"] = last
    with pytest.raises(ArtifactError, match="dictionary"):
        mf.Manifest.from_dict(chained, source="c")


SMALL = {
    "device": "cpu", "mask": "sliding_window", "batch": 1, "q_heads": 1, "kv_heads": 1, "q_len": 128, "kv_len": 128,
    "head_dim": 16, "dtype": "float32", "graphs": ["fwd"],
}  # fmt: skip


def consume_parts(path: Path, m: mf.Manifest, parts: list[int]) -> None:
    for member in art.iter_members(path, m, parts):
        if member.link_to is None:
            member.write(io.BytesIO())
