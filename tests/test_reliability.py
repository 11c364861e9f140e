"""Faults: mutated artifacts, crowds of installers, installers killed at random points, resource limits.

Every case ends in a clear KernelpackError with the target tree byte-for-byte as it was, or (a benign mutation, a
crowd) in a tree whose every file matches the manifest. Counts go to $KERNELPACK_RELIABILITY_REPORT (JSON) when set,
for docs/RELIABILITY.md.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import pytest
import zstandard
from conftest import repack, tree_digest

from kernelpack import artifact as art
from kernelpack import manifest as mf
from kernelpack.errors import KernelpackError
from kernelpack.installer import install_artifact

MUTATIONS = int(os.environ.get("KERNELPACK_MUTATIONS", "540"))
KILL_TRIALS = int(os.environ.get("KERNELPACK_KILL_TRIALS", "50"))


def record(section: str, data: dict) -> None:
    path = os.environ.get("KERNELPACK_RELIABILITY_REPORT")
    if not path:
        return
    report = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    report[section] = data
    Path(path).write_text(json.dumps(report, indent=1, sort_keys=True))


# ---------------------------------------------------------------------------------------------- mutations


def _members(raw: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        return tar.getmembers()


def _recompress(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(raw)


def _frames(original: bytes) -> list[bytes]:
    """The artifact's zstd frames: the manifest's, one per part, the tar's end."""
    f, out, pos = io.BytesIO(original), [], 0
    while pos < len(original):
        end = art._frame_end(f, pos, len(original), "a.kpack")
        out.append(original[pos:end])
        pos = end
    return out


def _raw(frame: bytes, dictionary: bytes | None = None) -> bytes:
    raw_content = zstandard.DICT_TYPE_RAWCONTENT
    d = None if dictionary is None else zstandard.ZstdCompressionDict(dictionary, dict_type=raw_content)
    return zstandard.ZstdDecompressor(dict_data=d).decompressobj().decompress(frame)


def _part_raws(manifest: dict, frames: list[bytes]) -> list[bytes]:
    """Each part's tar bytes: a part compressed against a dictionary part read with it."""
    plain = {i: _raw(f) for i, f in enumerate(frames) if manifest["parts"][i].get("dictionary") is None}
    return [plain.get(i) or _raw(f, plain[manifest["parts"][i]["dictionary"]]) for i, f in enumerate(frames)]


def _assemble(manifest: dict, parts: list[bytes]) -> bytes:
    """An artifact laid out as the packer lays it out, from a manifest and each part's tar bytes: each part
    compressed into its frame (against its dictionary part's bytes, as given), the manifest's offsets and sizes made
    to match and resealed (a lie the packer would write: what is tried is the installer's checks behind the seal,
    not the layout's)."""

    def compress(i: int) -> bytes:
        d = manifest["parts"][i].get("dictionary")
        if d is None:
            return _recompress(parts[i])
        dictionary = zstandard.ZstdCompressionDict(parts[d], dict_type=zstandard.DICT_TYPE_RAWCONTENT)
        return zstandard.ZstdCompressor(level=3, dict_data=dictionary).compress(parts[i])

    frames = [compress(i) for i in range(len(parts))]
    offset = 0
    for part, frame in zip(manifest["parts"], frames, strict=True):
        part["offset"], part["size"] = offset, len(frame)
        offset += len(frame)
    return _manifest_frame(mf.seal(manifest)) + b"".join(frames) + _recompress(bytes(1024))


def _manifest_frame(blob: bytes) -> bytes:
    out = io.BytesIO()
    ti = tarfile.TarInfo(mf.MANIFEST_NAME)
    ti.size = len(blob)
    out.write(ti.tobuf(tarfile.PAX_FORMAT) + blob + bytes(-len(blob) % 512))
    return _recompress(out.getvalue())


def _flip(data: bytes, lo: int, hi: int, rng: random.Random) -> bytes:
    b = bytearray(data)
    i = rng.randrange(lo, hi)
    b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


def _rewrite(raw: bytes, edit_manifest=None, duplicate: str | None = None) -> bytes:  # type: ignore[no-untyped-def]
    """Rebuild a tar (one frame's) with an edited manifest and/or one member written twice; no end blocks, as a
    part's frame has none."""
    src = tarfile.open(fileobj=io.BytesIO(raw))
    out = io.BytesIO()
    for ti in src.getmembers():
        data = src.extractfile(ti).read() if ti.isreg() else None  # type: ignore[union-attr]
        if ti.name == mf.MANIFEST_NAME and edit_manifest is not None:
            m = json.loads(data)  # type: ignore[arg-type]
            edit_manifest(m)
            # resealed: a lie the packer would write, so the installer's checks behind the seal are what is tried
            data = mf.seal(m)
            ti.size = len(data)
        for _ in range(2 if ti.name == duplicate else 1):
            out.write(ti.tobuf(tarfile.PAX_FORMAT))
            if data is not None:
                out.write(data + bytes(-len(data) % 512))
    return out.getvalue()


# Kinds that change what an install would deliver or believe: every one must be refused. The others may leave the
# content intact (a tar header bit tar never reads; a zstd frame-header bit; bytes after the frame ends) and then must
# install identically.
MUST_REJECT = (
    "flip_payload",
    "flip_manifest",
    "truncate",
    "manifest_lies_sha256",
    "manifest_lies_size",
    "duplicate_member",
)
KINDS = (
    "flip_compressed",
    "flip_tar_header",
    "flip_payload",
    "flip_manifest",
    "truncate",
    "append_garbage",
    "manifest_lies_sha256",
    "manifest_lies_size",
    "duplicate_member",
)


def mutate(original: bytes, kind: str, rng: random.Random) -> bytes:
    frames = _frames(original)
    head = _raw(frames[0])
    manifest = json.loads(tarfile.open(fileobj=io.BytesIO(head)).extractfile(mf.MANIFEST_NAME).read())  # type: ignore[union-attr]
    parts = _part_raws(manifest, frames[1:-1])
    k = rng.randrange(len(parts))  # the part a member mutation lands in
    members = _members(parts[k])
    files = [m for m in members if m.isreg() and m.size > 0]
    if kind == "flip_compressed":
        return _flip(original, 0, len(original), rng)
    if kind == "truncate":
        return original[: rng.randrange(0, len(original))]
    if kind == "append_garbage":
        return original + rng.randbytes(rng.randrange(1, 4096))
    if kind == "flip_tar_header":
        m = rng.choice(members)
        parts[k] = _flip(parts[k], m.offset, m.offset_data, rng)
        return _assemble(manifest, parts)
    if kind == "flip_payload":
        m = rng.choice(files)
        parts[k] = _flip(parts[k], m.offset_data, m.offset_data + m.size, rng)
        return _assemble(manifest, parts)
    if kind == "flip_manifest":  # not resealed: the seal must catch it
        m = _members(head)[0]
        return _recompress(_flip(head, m.offset_data, m.offset_data + m.size, rng)) + b"".join(frames[1:])
    if kind in ("manifest_lies_sha256", "manifest_lies_size"):
        f = rng.choice(manifest["files"])
        if kind == "manifest_lies_sha256":
            f["sha256"] = hashlib.sha256(rng.randbytes(8)).hexdigest()
        else:
            f["size"] += rng.choice((-1, 1))
        return _assemble(manifest, parts)
    if kind == "duplicate_member":
        parts[k] = _rewrite(parts[k], duplicate=rng.choice(files).name)
        return _assemble(manifest, parts)
    raise AssertionError(kind)


def test_mutated_artifacts_are_rejected_or_install_identically(smoke_artifact: Path, tmp_path: Path) -> None:
    run_mutations(smoke_artifact, tmp_path, MUTATIONS, seed=20261129)


@pytest.mark.manual
def test_many_more_mutations(smoke_artifact: Path, tmp_path: Path) -> None:
    run_mutations(smoke_artifact, tmp_path, 10 * MUTATIONS, seed=1)


def run_mutations(smoke_artifact: Path, tmp_path: Path, count: int, seed: int) -> None:
    original = smoke_artifact.read_bytes()
    manifest = art.read_manifest(smoke_artifact)
    rng = random.Random(seed)
    target = tmp_path / "cache"
    outcomes: Counter[str] = Counter()
    failures = []
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        bad = tmp_path / "m.kpack"
        bad.write_bytes(mutate(original, kind, rng))
        shutil.rmtree(target, ignore_errors=True)
        (target / "fxgraph" / "zz").mkdir(parents=True)
        (target / "fxgraph" / "zz" / "existing-entry").write_bytes(b"an entry that was there before")
        before = tree_digest(target)
        try:
            install_artifact(bad, target)
        except KernelpackError:
            outcomes[f"{kind}: rejected"] += 1
            if tree_digest(target) != before:
                failures.append(f"#{i} {kind}: rejected but the target changed")
            continue
        except Exception as e:  # anything else is a bug: a traceback instead of a clear error
            failures.append(f"#{i} {kind}: {type(e).__name__}: {e}")
            continue
        outcomes[f"{kind}: benign"] += 1
        for rel, e in manifest.files.items():
            if hashlib.sha256((target / rel).read_bytes()).hexdigest() != e.sha256:
                failures.append(f"#{i} {kind}: installed {rel} differs from the original")
    record(f"mutations_seed{seed}", {"tried": count, "outcomes": dict(sorted(outcomes.items())), "failures": failures})
    assert not failures, failures[:10]
    benign = {kind: outcomes[f"{kind}: benign"] for kind in MUST_REJECT if outcomes[f"{kind}: benign"]}
    assert not benign, f"installed without complaint: {benign}"
    tried = {kind: sum(n for k, n in outcomes.items() if k.startswith(f"{kind}:")) for kind in KINDS}
    for kind in ("flip_compressed", "flip_tar_header"):  # mostly real damage: a test that never rejects proves nothing
        assert outcomes[f"{kind}: rejected"] > 0.8 * tried[kind], (kind, outcomes)


# ---------------------------------------------------------------------------------------------- crowds

READER = r"""
import hashlib, json, os, sys, time
target, manifest_json, stop = sys.argv[1:4]
expected = json.loads(open(manifest_json).read())
checks = violations = 0
while not os.path.exists(stop):
    for dirpath, dirnames, filenames in os.walk(target):
        dirnames[:] = [d for d in dirnames if not d.startswith(".kernelpack")]
        for name in filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, target)
            if rel in expected:
                try:
                    data = open(p, "rb").read()
                except FileNotFoundError:
                    continue
                checks += 1
                if hashlib.sha256(data).hexdigest() != expected[rel]:
                    violations += 1
    time.sleep(0.002)
print(json.dumps({"checks": checks, "violations": violations}))
"""

INSTALLER = "import sys; from kernelpack.installer import install_artifact; install_artifact(sys.argv[1], sys.argv[2])"


def disjoint_copy(artifact: Path, out: Path, work: Path) -> Path:
    """Another artifact with the same build key and no path in common (top-level dirs renamed)."""
    tree = work / "tree"
    data = art.unpack(artifact, tree).to_dict()
    moved = work / "moved"
    for p in tree.rglob("*"):
        if p.is_file():
            rel = p.relative_to(tree)
            dest = moved / f"{rel.parts[0]}-b" / Path(*rel.parts[1:])
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, dest)
    files = art.scan_tree(moved)
    entries = art.hash_files(files)
    for c in data["configs"]:  # its precompiled functions moved out of kernelpack-precompiled/: not listed
        c.pop("precompiled", None)
    data = {**data, "files": [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in entries]}
    data.pop("parts")  # other files: the packer makes the parts
    art.pack(out, mf.Manifest.from_dict(data, source=str(out)), files)
    return out


def crowd(installs: list[Path], target: Path, tmp_path: Path) -> dict:
    expected = {}
    for a in installs:
        expected.update({rel: e.sha256 for rel, e in art.read_manifest(a).files.items()})
    (tmp_path / "expected.json").write_text(json.dumps(expected))
    stop = tmp_path / "stop"
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(target), str(tmp_path / "expected.json"), str(stop)],
        stdout=subprocess.PIPE,
        text=True,
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", INSTALLER, str(a), str(target)], stderr=subprocess.PIPE, text=True)
        for a in installs
    ]
    codes = [(p.wait(timeout=600), p.communicate()[1]) for p in procs]
    stop.write_text("")
    seen = json.loads(reader.communicate(timeout=60)[0])
    assert [c for c, _ in codes] == [0] * len(procs), [e for _, e in codes if e][:2]
    for rel, sha in expected.items():
        assert hashlib.sha256((target / rel).read_bytes()).hexdigest() == sha, rel
    assert not list(target.glob(".kernelpack-tmp-*"))
    return seen


def test_32_installers_of_one_artifact_with_a_reader(smoke_artifact: Path, tmp_path: Path) -> None:
    seen = crowd([smoke_artifact] * 32, tmp_path / "cache", tmp_path)
    record("crowd_same", {"installers": 32, **seen})
    assert seen["violations"] == 0 and seen["checks"] > 0


def test_8_installers_of_two_artifacts_give_the_union(smoke_artifact: Path, tmp_path: Path) -> None:
    other = disjoint_copy(smoke_artifact, tmp_path / "b.kpack", tmp_path / "w")
    seen = crowd([smoke_artifact, other] * 4, tmp_path / "cache", tmp_path)
    record("crowd_two", {"installers": 8, **seen})
    assert seen["violations"] == 0


# ---------------------------------------------------------------------------------------------- crashes

# One process imports torch and kernelpack once, then forks an installer per trial: each trial is a real process
# killed by a real SIGKILL mid-install, without 50 torch imports (3 min of CI's time) before the kills.
ZYGOTE = r"""
import json, os, sys
from kernelpack import keys
from kernelpack.installer import install_artifact
keys.probe("cpu")  # what an installer has imported before it installs
for line in sys.stdin:
    artifact, target = json.loads(line)
    pid = os.fork()
    if pid == 0:
        print(f"READY {os.getpid()}", flush=True)
        install_artifact(artifact, target)
        print(f"DONE {os.getpid()}", flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(f"EXIT {pid} {status}", flush=True)
"""


def test_sigkill_at_random_points_leaves_no_partial_file(smoke_artifact: Path, tmp_path: Path) -> None:
    manifest = art.read_manifest(smoke_artifact)
    rng = random.Random(7)
    outcomes: Counter[str] = Counter()
    zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert zygote.stdin is not None and zygote.stdout is not None

    def fork(target: Path) -> str:
        assert zygote.stdin is not None and zygote.stdout is not None
        zygote.stdin.write(json.dumps([str(smoke_artifact), str(target)]) + "\n")
        zygote.stdin.flush()
        ready, pid = zygote.stdout.readline().split()
        assert ready == "READY", ready
        return pid

    try:
        # installs unkilled, timed (the fastest of 3; the first pays lazy imports): the kills fall anywhere from an
        # install's start to a little past its end
        spans = []
        for i in range(3):
            t = time.perf_counter()
            fork(tmp_path / f"timed{i}")
            assert zygote.stdout.readline().startswith("DONE") and zygote.stdout.readline().startswith("EXIT")
            spans.append(time.perf_counter() - t)
        span = min(spans) * 1.2
        for trial in range(KILL_TRIALS):
            target = tmp_path / f"t{trial}"
            pid = fork(target)
            time.sleep(rng.uniform(0, span))
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:  # exited already; the zygote has not reaped it yet
                pass
            lines = []
            while not (line := zygote.stdout.readline()).startswith("EXIT"):
                assert line, "the zygote died"
                lines.append(line)
            outcomes["finished before the kill" if f"DONE {pid}\n" in lines else "killed mid-install"] += 1
            for f in target.rglob("*") if target.exists() else []:
                rel = f.relative_to(target).as_posix()
                if f.is_file() and not rel.startswith((".kernelpack-tmp-", ".kernelpack-init-", ".kernelpack/")):
                    assert hashlib.sha256(f.read_bytes()).hexdigest() == manifest.files[rel].sha256, rel
            # a re-run completes, and the killed installer's staging directory is gone
            install_artifact(smoke_artifact, target)
            assert not list(target.glob(".kernelpack-tmp-*"))
            for rel, e in manifest.files.items():
                assert hashlib.sha256((target / rel).read_bytes()).hexdigest() == e.sha256
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=60)
    record("sigkill", {"trials": KILL_TRIALS, "install_seconds": round(span / 1.2, 3), "outcomes": dict(outcomes)})
    assert outcomes["killed mid-install"] > 0


# ---------------------------------------------------------------------------------------------- resources

EFBIG = (
    "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
    "from kernelpack.cli import main; from kernelpack import keys; keys.probe('cpu');"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536));"
    "sys.exit(main(['install', sys.argv[1], '--cache-dir', sys.argv[2]]))"
)


def test_file_size_limit_is_a_clear_error_and_the_tree_is_unchanged(smoke_artifact: Path, tmp_path: Path) -> None:
    target = tmp_path / "cache"
    (target / "fxgraph").mkdir(parents=True)
    (target / "fxgraph" / "old").write_bytes(b"x")
    before = tree_digest(target)
    proc = subprocess.run(
        [sys.executable, "-c", EFBIG, str(smoke_artifact), str(target)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "error: " in proc.stderr and "File too large" in proc.stderr and "Traceback" not in proc.stderr
    assert tree_digest(target) == before


def test_environment_drift_is_refused_field_by_field(smoke_artifact: Path, tmp_path: Path) -> None:
    from kernelpack.errors import KeyMismatchError

    m = art.read_manifest(smoke_artifact).to_dict()
    drift = {"torch_git": "0" * 40, "gpu_name": "NVIDIA H100 80GB HBM3", "triton": "3.5.0"}
    alien = repack(smoke_artifact, tmp_path / "a.kpack", tmp_path / "w", build_key={**m["build_key"], **drift})
    with pytest.raises(KeyMismatchError) as exc:
        install_artifact(alien, tmp_path / "cache")
    assert sorted(d[0] for d in exc.value.differences) == sorted(drift)
    assert not (tmp_path / "cache").exists()


def test_read_only_target_is_a_clear_error(smoke_artifact: Path, tmp_path: Path) -> None:
    """A read-only bind mount of the target (root ignores permission bits, not a read-only filesystem)."""
    target = tmp_path / "cache"
    (target / "fxgraph").mkdir(parents=True)
    (target / "fxgraph" / "old").write_bytes(b"x")
    before = tree_digest(target)
    script = (
        f"mount --bind {target} {target} && mount -o remount,bind,ro {target} || exit 77; "
        f"exec {sys.executable} -m kernelpack.cli install {smoke_artifact} --cache-dir {target}"
    )
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, check=False)
    if proc.returncode == 77 or "unshare failed" in proc.stderr or "Operation not permitted" in proc.stderr:
        pytest.skip(f"cannot make a read-only mount here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "error: " in proc.stderr and "Traceback" not in proc.stderr
    assert "is not writable by this process: torch writes its locks" in proc.stderr, proc.stderr
    assert tree_digest(target) == before
    # the artifact already there: "already installed" and then torch's InductorError at the first load
    # ("Read-only file system: '<cache>/locks'") became one refusal up front
    subprocess.run([sys.executable, "-m", "kernelpack.cli", "install", str(smoke_artifact), "--cache-dir",
                    str(target)], check=True, capture_output=True)  # fmt: skip
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "already installed" not in proc.stdout, proc.stdout + proc.stderr
    assert "is not writable by this process" in proc.stderr, proc.stderr


PUSHER = (
    "import sys; from kernelpack.store import Registry; reg = Registry(sys.argv[2]);"
    "print('READY', flush=True); reg.push(sys.argv[1]); print('DONE', flush=True)"
)


def test_a_killed_push_is_never_listed(smoke_artifact: Path, tmp_path: Path) -> None:
    """A big artifact (so the upload takes a while) pushed and SIGKILLed at random points: every entry that a
    listing shows has its complete payload behind it."""
    from kernelpack.store import Registry

    tree = tmp_path / "tree"
    (tree / "fxgraph" / "aa").mkdir(parents=True)
    (tree / "fxgraph" / "aa" / "big").write_bytes(os.urandom(192 << 20))  # incompressible
    files = art.scan_tree(tree)
    entries = art.hash_files(files)
    m = art.read_manifest(smoke_artifact).to_dict()
    for c in m["configs"]:  # not among these files
        c.pop("precompiled", None)
    data = {**m, "files": [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in entries]}
    data.pop("parts")  # other files: the packer makes the parts
    big = tmp_path / smoke_artifact.name
    art.pack(big, mf.Manifest.from_dict(data, source=str(big)), files, level=1)
    shutil.rmtree(tree)
    rng = random.Random(11)
    outcomes: Counter[str] = Counter()
    for trial in range(6):
        reg_dir = tmp_path / f"reg{trial}"
        p = subprocess.Popen([sys.executable, "-c", PUSHER, str(big), str(reg_dir)], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "READY"
        time.sleep(rng.uniform(0, 0.4))
        p.send_signal(signal.SIGKILL)
        p.wait()
        outcomes["finished" if "DONE" in p.stdout.read() else "killed"] += 1
        if not reg_dir.exists():
            continue
        for entry in Registry(str(reg_dir)).entries():
            payload = reg_dir / entry.path
            assert payload.stat().st_size == entry.size and art.sha256_file(payload) == entry.sha256
    record("push_kill", {"trials": 6, "outcomes": dict(outcomes)})
    assert outcomes["killed"] > 0
