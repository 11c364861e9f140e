from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
from conftest import repack, tree_digest

from kernelpack import artifact as art
from kernelpack import install
from kernelpack import manifest as mf
from kernelpack.cli import main
from kernelpack.errors import ArtifactError, InstallError, KernelpackWarning, KeyMismatchError
from kernelpack.installer import marker_path


def assert_installed(target: Path, artifact: Path) -> None:
    m = art.read_manifest(artifact)
    for rel, e in m.files.items():
        p = target / rel
        assert hashlib.sha256(p.read_bytes()).hexdigest() == e.sha256, rel
    leftovers = [p for p in target.iterdir() if p.name.startswith(".kernelpack-tmp")]
    assert not leftovers


def test_install_into_empty_dir_then_noop(
    smoke_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    target = tmp_path / "cache"
    r = install(smoke_artifact, target)
    assert not r.noop and r.written == r.files == len(art.read_manifest(smoke_artifact).files)
    assert_installed(target, smoke_artifact)
    assert marker_path(target, r.sha256).is_file()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(target)  # the API points inductor at it
    before = tree_digest(target)
    again = install(smoke_artifact, target)
    assert again.noop and again.written == 0 and tree_digest(target) == before


def test_default_target_is_torchinductor_cache_dir(
    smoke_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "env-cache"))
    r = install(smoke_artifact)
    assert r.cache_dir == str(tmp_path / "env-cache")
    assert_installed(tmp_path / "env-cache", smoke_artifact)


def test_marker_is_not_trusted_when_files_vanished(smoke_artifact: Path, tmp_path: Path) -> None:
    r = install(smoke_artifact, tmp_path / "c")
    victim = next(iter(art.read_manifest(smoke_artifact).files))
    (tmp_path / "c" / victim).unlink()
    r2 = install(smoke_artifact, tmp_path / "c")
    assert not r2.noop and r2.written == 1 and r2.present == r.files - 1
    assert_installed(tmp_path / "c", smoke_artifact)


def corrupt_copy(src: Path, dst: Path, offset_fraction: float) -> Path:
    data = bytearray(src.read_bytes())
    i = int(len(data) * offset_fraction)
    data[i] ^= 0xFF
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("where", [0.5, 0.9])
@pytest.mark.parametrize("prepopulated", [False, True])
def test_corrupt_artifact_leaves_target_exactly_as_it_was(
    smoke_artifact: Path, tmp_path: Path, where: float, prepopulated: bool
) -> None:
    target = tmp_path / "cache"
    if prepopulated:
        (target / "fxgraph" / "zz").mkdir(parents=True)
        (target / "fxgraph" / "zz" / "existing").write_bytes(b"someone else's entry")
    before = tree_digest(target)
    bad = corrupt_copy(smoke_artifact, tmp_path / "bad.kpack", where)
    with pytest.raises(ArtifactError):
        install(bad, target)
    assert tree_digest(target) == before


def test_truncated_artifact_leaves_target_untouched(smoke_artifact: Path, tmp_path: Path) -> None:
    data = smoke_artifact.read_bytes()
    (tmp_path / "t.kpack").write_bytes(data[: len(data) * 2 // 3])
    target = tmp_path / "cache"
    target.mkdir()
    before = tree_digest(target)
    with pytest.raises(ArtifactError):
        install(tmp_path / "t.kpack", target)
    assert tree_digest(target) == before


def test_existing_entries_are_never_replaced(smoke_artifact: Path, tmp_path: Path) -> None:
    rel = next(iter(art.read_manifest(smoke_artifact).files))
    target = tmp_path / "cache"
    (target / rel).parent.mkdir(parents=True)
    (target / rel).write_bytes(b"an entry torch wrote itself")
    r = install(smoke_artifact, target)
    assert r.kept == 1 and r.written == r.files - 1
    assert (target / rel).read_bytes() == b"an entry torch wrote itself"


def test_key_mismatch_is_refused_with_each_field(smoke_artifact: Path, tmp_path: Path) -> None:
    m = art.read_manifest(smoke_artifact).to_dict()
    # a commit no torch here has (70d99e998b49, once used here, is torch 2.11's own: CI runs this file on it)
    alien_key = {**m["build_key"], "torch_git": "de" * 20, "torch_key": "00" * 32}
    alien = repack(smoke_artifact, tmp_path / "alien.kpack", tmp_path / "w", build_key=alien_key)
    target = tmp_path / "cache"
    with pytest.raises(KeyMismatchError) as exc:
        install(alien, target)
    fields = [d[0] for d in exc.value.differences]
    assert fields == ["torch_git", "torch_key"]
    assert f"artifact '{'de' * 20}' != here" in str(exc.value)
    assert not target.exists()
    with pytest.warns(KernelpackWarning, match="torch_git"):
        r = install(alien, target, allow_mismatch=True)
    assert r.mismatches and r.written == r.files


def test_cli_install_mismatch_error_and_allow(
    smoke_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    m = art.read_manifest(smoke_artifact).to_dict()
    alien = repack(
        smoke_artifact,
        tmp_path / "alien.kpack",
        tmp_path / "w",
        build_key={**m["build_key"], "torch_dir": "/other/venv/torch"},
    )
    assert main(["install", str(alien), "--cache-dir", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert "torch_dir: artifact '/other/venv/torch' != here" in err and "hint: " in err
    assert main(["install", str(alien), "--cache-dir", str(tmp_path / "c"), "--allow-mismatch"]) == 0
    out = capsys.readouterr()
    assert "warning: " in out.err and "installed " in out.out


def test_triton_files_follow_triton_cache_dir(
    smoke_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "w" / "extra"
    kernel = b"\x7fELF fake cubin"
    (src / "triton" / "0" / "HASH").mkdir(parents=True)
    (src / "triton" / "0" / "HASH" / "k.cubin").write_bytes(kernel)
    files = art.scan_tree(src)
    entries = art.hash_files(files)
    m = art.read_manifest(smoke_artifact).to_dict()
    configs = [{k: v for k, v in c.items() if k != "precompiled"} for c in m["configs"]]  # not among these files
    data = {**m, "configs": configs, "files": [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in entries]}
    data.pop("parts")  # other files: the packer makes the parts
    art.pack(tmp_path / "t.kpack", mf.Manifest.from_dict(data, source="t.kpack"), files)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-elsewhere"))
    install(tmp_path / "t.kpack", tmp_path / "cache")
    assert (tmp_path / "triton-elsewhere" / "HASH" / "k.cubin").read_bytes() == kernel
    assert not (tmp_path / "cache" / "triton").exists()


def test_warns_when_torch_already_compiled_elsewhere(smoke_artifact: Path, tmp_path: Path) -> None:
    code = (
        "import os, torch, warnings; os.environ['TORCHINDUCTOR_CACHE_DIR'] = os.environ['FIRST'];"
        "torch.compile(lambda x: x + 1, backend='eager')(torch.ones(2));"
        "from kernelpack import install;"
        "warnings.simplefilter('error');"
        "install(os.environ['ART'], os.environ['SECOND'])"
    )
    env = dict(os.environ, FIRST=str(tmp_path / "a"), SECOND=str(tmp_path / "b"), ART=str(smoke_artifact))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "already compiled" in proc.stderr and "KernelpackWarning" in proc.stderr


@pytest.mark.once  # the installer's files and locks: no torch internal
def test_eight_concurrent_installers(smoke_artifact: Path, tmp_path: Path) -> None:
    target = tmp_path / "shared"
    code = "import sys; from kernelpack import install; r = install(sys.argv[1], sys.argv[2]); print(r.noop)"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(smoke_artifact), str(target)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    results = [(p.wait(timeout=300), p.communicate()) for p in procs]
    assert [rc for rc, _ in results] == [0] * 8, [err for _, (_, err) in results]
    noops = [out.strip() for _, (out, _) in results]
    assert noops.count("False") >= 1  # somebody installed; with the lock the rest found it done
    assert_installed(target, smoke_artifact)
    digest = tree_digest(target)
    install(smoke_artifact, target)
    assert tree_digest(target) == digest


def test_umask_is_respected(smoke_artifact: Path, tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        install(smoke_artifact, tmp_path / "c")
    finally:
        os.umask(old)
    modes = {p.stat().st_mode & 0o777 for p in (tmp_path / "c").rglob("*") if p.is_file()}
    assert modes and all(mode & 0o027 == 0 for mode in modes), modes


def test_marker_content(smoke_artifact: Path, tmp_path: Path) -> None:
    r = install(smoke_artifact, tmp_path / "c")
    data = json.loads(marker_path(tmp_path / "c", r.sha256).read_text())
    assert data["sha256"] == hashlib.sha256(smoke_artifact.read_bytes()).hexdigest()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        install(smoke_artifact, tmp_path / "c")


def test_failed_install_does_not_touch_the_process_env(
    smoke_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))
    bad = corrupt_copy(smoke_artifact, tmp_path / "bad.kpack", 0.5)
    with pytest.raises(ArtifactError):
        install(bad, tmp_path / "target")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "before")


def test_kept_entries_do_not_defeat_the_noop(smoke_artifact: Path, tmp_path: Path) -> None:
    rel = next(iter(art.read_manifest(smoke_artifact).files))
    target = tmp_path / "cache"
    (target / rel).parent.mkdir(parents=True)
    (target / rel).write_bytes(b"x")  # other size than the artifact's copy
    assert install(smoke_artifact, target).kept == 1
    again = install(smoke_artifact, target)
    assert again.noop and (target / rel).read_bytes() == b"x"


def test_failure_while_committing_rolls_back_what_it_placed(smoke_artifact: Path, tmp_path: Path) -> None:
    """A plain file where the artifact needs the fxgraph/ directory: the commit fails part-way (aotautograd/ sorts
    first and is placed), and everything this install created is removed again."""
    target = tmp_path / "cache"
    target.mkdir()
    (target / "fxgraph").write_bytes(b"a file, not a directory")
    before = tree_digest(target)
    with pytest.raises(InstallError, match="fxgraph"):
        install(smoke_artifact, target)
    assert tree_digest(target) == before


@pytest.mark.once  # the installer's files and locks: no torch internal
def test_eight_concurrent_installers_without_the_lock(smoke_artifact: Path, tmp_path: Path) -> None:
    """Correctness must not depend on the node lock (network filesystems can lie about flock)."""
    target = tmp_path / "shared"
    code = "import sys; from kernelpack import install; install(sys.argv[1], sys.argv[2])"
    env = dict(os.environ, KERNELPACK_INSTALL_LOCK="0")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(smoke_artifact), str(target)], env=env, stderr=subprocess.PIPE, text=True
        )
        for _ in range(8)
    ]
    errs = [(p.wait(timeout=300), p.communicate()[1]) for p in procs]
    assert [rc for rc, _ in errs] == [0] * 8, errs
    assert_installed(target, smoke_artifact)
    assert "kept existing" not in "".join(e for _, e in errs)


def test_rank_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelpack import rank_cache_dir
    from kernelpack.errors import KernelpackError

    monkeypatch.setenv("LOCAL_RANK", "5")
    assert rank_cache_dir(tmp_path) == tmp_path / "rank5"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind"))
    assert rank_cache_dir() == tmp_path / "ind" / "rank5"
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(KernelpackError, match="LOCAL_RANK"):
        rank_cache_dir()


def test_never_writes_through_a_symlink_leaving_the_cache(smoke_artifact: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    target = tmp_path / "cache"
    target.mkdir()
    (target / "fxgraph").symlink_to(outside, target_is_directory=True)
    before = tree_digest(target)
    with pytest.raises(InstallError, match="leads outside the cache directory"):
        install(smoke_artifact, target)
    assert list(outside.iterdir()) == [] and tree_digest(target) == before


def test_no_world_writable_files_even_with_umask_zero(smoke_artifact: Path, tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        install(smoke_artifact, tmp_path / "c")
    finally:
        os.umask(old)
    modes = {p.stat().st_mode & 0o777 for p in (tmp_path / "c").rglob("*") if not p.is_symlink()}
    assert modes and all(mode & 0o022 == 0 for mode in modes), sorted(oct(m) for m in modes)


def test_a_cache_dir_others_can_change_is_refused_before_anything_is_written(
    smoke_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # torch's default /tmp/torchinductor_<user> can be made by any local user before the job starts
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(InstallError, match=r"writable by other users \(mode 0o777\).*every worker loads"):
        install(smoke_artifact, shared)
    assert list(shared.iterdir()) == []
    # not made yet, in a directory others can write without the sticky bit: whoever can rename it swaps the cache
    with pytest.raises(InstallError, match=r"lies in .*shared, which other users can write"):
        install(smoke_artifact, shared / "cache")
    assert list(shared.iterdir()) == []
    assert main(["install", str(smoke_artifact), "--cache-dir", str(shared)]) == 1
    err = capsys.readouterr().err
    assert "writable by other users" in err and "chmod go-w" in err and "Traceback" not in err
    # group write is harmless on this user's private group (umask 002 on most clusters makes directories 0775), and
    # refused for a group others are in
    import grp
    import pwd

    own = tmp_path / "own-group"
    own.mkdir()
    own.chmod(0o775)
    me = pwd.getpwuid(os.getuid())
    private = grp.getgrgid(me.pw_gid).gr_name == me.pw_name and not set(grp.getgrgid(me.pw_gid).gr_mem) - {me.pw_name}
    if private:
        assert install(smoke_artifact, own).written > 0
    if os.getuid() == 0:
        grouped = tmp_path / "grouped"
        grouped.mkdir()
        os.chown(grouped, 0, 65534)
        grouped.chmod(0o770)
        with pytest.raises(InstallError, match=r"writable by other users \(mode 0o770\)"):
            install(smoke_artifact, grouped)
    if os.getuid() == 0:  # only root can hand a directory to another user
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        with pytest.raises(InstallError, match="is owned by uid 65534, not by this user"):
            install(smoke_artifact, theirs)
        assert list(theirs.iterdir()) == []


@pytest.mark.skipif(os.getuid() == 0, reason="root writes into a read-only mode directory")
def test_a_read_only_cache_dir_is_refused_even_when_the_artifact_is_already_there(
    smoke_artifact: Path, tmp_path: Path
) -> None:
    target = tmp_path / "c"
    install(smoke_artifact, target)
    target.chmod(0o555)
    try:
        with pytest.raises(InstallError, match="not writable by this process: torch writes its locks"):
            install(smoke_artifact, target)
    finally:
        target.chmod(0o755)


def test_a_cache_dir_torch_cannot_use_is_refused_naming_why(smoke_artifact: Path, tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(InstallError, match=r"lies under .*afile, which is not a directory"):
        install(smoke_artifact, afile / "cache")
    assert art.read_manifest(smoke_artifact).build_key.device_type == "cpu"
    spaced = tmp_path / "my cache"
    with pytest.raises(InstallError, match="torch's C\\+\\+ build command splits paths there"):
        install(smoke_artifact, spaced)
    assert not spaced.exists()


def test_a_marker_that_cannot_be_written_takes_the_committed_files_with_it(
    smoke_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk at the marker, after the files were committed, exited 1 with the files in place. The
    marker is part of the commit now: the target ends exactly as it was. (ENOSPC injected at the marker's write:
    a real full disk at exactly that byte is not reproducible here.)"""
    import errno

    from kernelpack import _fs, installer

    real = _fs.write_bytes

    def full_at_the_marker(final: Path, data: bytes) -> None:
        if final.parent.name == "installed":
            raise OSError(errno.ENOSPC, "No space left on device", str(final))
        real(final, data)

    target = tmp_path / "cache"
    target.mkdir()
    (target / "theirs").write_text("x")
    before = tree_digest(target)
    monkeypatch.setattr(installer._fs, "write_bytes", full_at_the_marker)
    with pytest.raises(InstallError, match=r"cannot write the install marker: OSError: .*No space left"):
        install(smoke_artifact, target)
    assert tree_digest(target) == before
    monkeypatch.setattr(installer._fs, "write_bytes", real)
    assert not install(smoke_artifact, target).noop  # and the next install does it all


def test_a_pinned_install_copies_nothing_and_leaves_nothing(
    smoke_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pinned install copied the artifact into $TMPDIR/kernelpack-pinned-* on every rank, and a killed
    one left its copy for ever. It reads the pinned bytes through the descriptor it hashed them through now."""
    import tempfile

    from kernelpack import _fs
    from kernelpack.installer import install_artifact

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    sha = _fs.sha256_file(smoke_artifact)
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:  # a copy exists only while an install runs: look for one all along
        while not done.is_set():
            seen.update(p.name for p in tmp.iterdir() if p.name.startswith("kernelpack-pinned"))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        first = install_artifact(smoke_artifact, tmp_path / "c", sha256=sha)
        again = install_artifact(smoke_artifact, tmp_path / "c", sha256=sha)
    finally:
        done.set()
        watcher.join()
    assert not seen
    assert first.written == first.files and again.noop
    assert not [p for p in tmp.iterdir() if p.name.startswith("kernelpack-pinned")]  # no copy, nothing to reap
    assert json.loads(marker_path(tmp_path / "c", sha).read_text())["artifact"] == smoke_artifact.name
    damaged = tmp_path / "damaged.kpack"
    damaged.write_bytes(smoke_artifact.read_bytes()[:-5000])
    with pytest.raises(ArtifactError) as e:
        install_artifact(damaged, tmp_path / "d", sha256=_fs.sha256_file(damaged))
    assert str(damaged) in e.value.message and "/proc/self/fd" not in str(e.value)
    assert "the cache dir was left as it was" in str(e.value)


def test_activate_refuses_a_cache_dir_variable_torch_cannot_use_before_torch_reads_it(
    smoke_artifact: Path, tmp_path: Path
) -> None:
    """TORCHINDUCTOR_CACHE_DIR naming a file gave a raw torch traceback from activate() (importing
    inductor makes that directory). kernelpack refuses it first, naming it."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    code = (
        "import sys\nfrom kernelpack.errors import InstallError\nfrom kernelpack.runtime import activate\n"
        f"try:\n    activate({str(smoke_artifact)!r})\nexcept InstallError as e:\n    print(e)\n    sys.exit(3)\n"
    )
    for value, fragment in ((afile, "afile: is not a directory"), (afile / "sub", "which is not a directory")):
        r = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(value)},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert r.returncode == 3 and fragment in r.stdout, r.stdout + r.stderr[-2000:]


def _files(root: Path) -> set[str]:
    return set(_contents(root))


def _contents(root: Path) -> dict[str, tuple[int, str]]:
    """The cache tree's files (not kernelpack's markers): path -> (mode, sha256)."""
    return {
        p.relative_to(root).as_posix(): (p.stat().st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in root.rglob("*")
        if p.is_file() and ".kernelpack" not in p.parts
    }


def _part_files(manifest: mf.Manifest, indices: object) -> set[str]:
    return {rel for i in indices for rel in manifest.parts[i].files}  # type: ignore[attr-defined]


@pytest.mark.parametrize("in_child", [False, True], ids=["in-process", "in-a-child"])
def test_an_install_by_parts_writes_what_each_signature_needs_and_no_more(
    smoke_artifact: Path, tmp_path: Path, in_child: bool
) -> None:
    """A start installs the files of the signatures it calls, part by part: a (config, device)'s precompiled
    function's files (its tier-2 parts), verified, with no install marker and nothing of another config or of the
    inductor cache's own entries (only a trace reads those: ensure(tier1=True) adds them); a second worker finds
    them (each part's marker) and writes nothing; after every part the tree is what a one-part install writes, and
    the marker makes the next install a no-op. ``in_child``: the files are written by the install's child process,
    as a background start writes the first ones."""
    from kernelpack.installer import begin_install

    manifest = art.read_manifest(smoke_artifact)
    owners = [mf.owner(c.id, d) for c, d in manifest.pairs()]
    assert len(owners) >= 2 and any(p.tier1 for p in manifest.parts)  # the smoke artifact has both kinds
    first = _part_files(manifest, manifest.parts_for(owners[0]))
    assert first and not any(rel.startswith(mf.TIER1_ONLY) for rel in first)
    one_part = tmp_path / "one-part"
    install(smoke_artifact, one_part)
    target = tmp_path / "cache"
    a, b = begin_install(smoke_artifact, target), begin_install(smoke_artifact, target)
    a.start(owners[:1], everything=False, in_child=in_child)
    assert _files(target) == first and a.finished and not a.complete
    others = {rel for p in manifest.parts if owners[0] not in p.owners for rel in p.files}
    assert others and not _files(target) & others  # nothing of the other config's, of either tier
    assert not marker_path(target, hashlib.sha256(smoke_artifact.read_bytes()).hexdigest()).exists()
    started = a.result(timeout=0)
    assert started.written == len(first) and started.parts_installed == len(manifest.parts_for(owners[0]))
    before = tree_digest(target)
    b.start(owners[:1], everything=False, in_child=in_child)
    assert tree_digest(target) == before and b.result(timeout=0).noop and b.result(timeout=0).written == 0
    a.ensure(owners[0], tier1=True)  # a trace of it: its inductor-cache entries too
    traced = _part_files(manifest, manifest.parts_for(owners[0], tier1=True))
    assert _files(target) == traced and traced > first
    # another config's part is compressed against the first config's: its bytes are kept for the next such part
    assert any(manifest.parts[i].dictionary is not None for i in manifest.parts_for(owners[1]))
    a.ensure(owners[1])
    assert a._dictionaries
    done = a.finish(in_child=in_child)
    assert not a._dictionaries  # every part installed: nothing reads them again
    assert done.written == len(manifest.files) and not done.noop and done.parts_installed == len(manifest.parts)
    assert a.complete and a.finish() == done  # idempotent
    assert done.seconds >= done.timings["extract"] > 0  # the time the install says it took holds its writes
    assert _files(target) == set(manifest.files) and _contents(target) == _contents(one_part)
    assert b.finish().noop and begin_install(smoke_artifact, target).finish().noop
    later = begin_install(smoke_artifact, target)  # a later start on this node: its parts are there
    later.start(owners, everything=False)
    assert later.result(timeout=0).noop


def test_parts_installed_later_come_from_the_artifact_the_install_opened(smoke_artifact: Path, tmp_path: Path) -> None:
    """A job's parts are installed at their signatures' first calls, minutes after its start: a new file renamed
    onto the artifact's path meanwhile (a rebuild, as ``kernelpack build`` writes one), or the file removed, changes
    nothing. They come from the file whose manifest the install read, in the job's process and in the install's
    child alike; read from the path, the new file's frames are not where the manifest says."""
    from kernelpack.installer import begin_install

    manifest = art.read_manifest(smoke_artifact)
    owners = [mf.owner(c.id, d) for c, d in manifest.pairs()]
    path = tmp_path / "job.kpack"
    path.write_bytes(smoke_artifact.read_bytes())
    target = tmp_path / "cache"
    a = begin_install(path, target)
    a.start(owners[:1], everything=False)
    # a rebuild: the same files under a longer name, so that every part's frame moved
    other = repack(smoke_artifact, tmp_path / "rebuilt.kpack", tmp_path / "work", name=manifest.name + "-rebuilt" * 50)
    os.replace(other, path)
    later = [i for o in owners[1:] for i in manifest.parts_for(o)]
    with pytest.raises(ArtifactError):  # what reading those parts from the path gives now
        list(art.iter_members(str(path), manifest, later))
    a.start(owners[1:], everything=False, in_child=True)
    assert _files(target) == _part_files(manifest, {i for o in owners for i in manifest.parts_for(o)})
    path.unlink()
    done = a.finish()
    assert done.parts_installed == len(manifest.parts)
    one_part = tmp_path / "one-part"
    install(smoke_artifact, one_part)
    assert _contents(target) == _contents(one_part)


@pytest.mark.parametrize("in_child", [False, True], ids=["in-process", "in-a-child"])
def test_a_corrupt_part_fails_with_the_target_unchanged(smoke_artifact: Path, tmp_path: Path, in_child: bool) -> None:
    """A part's members are each checked as they are read: a flipped byte in a part's frame fails the install of
    that part before a file of it is visible, in the install's child process too (its error is raised in the
    job's process as the same ArtifactError, naming the artifact); a part whose frame is whole still installs from
    the same file, and a whole install (every part) fails on the bad one with nothing of it written."""
    from kernelpack.installer import begin_install

    manifest = art.read_manifest(smoke_artifact)
    base = art.parts_base(smoke_artifact)
    # the largest part no other part is compressed against (a bad dictionary part fails the parts that use it too)
    references = {p.dictionary for p in manifest.parts}
    bad_index = max(set(range(len(manifest.parts))) - references, key=lambda i: manifest.parts[i].size)
    bad_part = manifest.parts[bad_index]
    data = bytearray(smoke_artifact.read_bytes())
    data[base + bad_part.offset + bad_part.size // 2] ^= 0xFF
    bad = tmp_path / "bad.kpack"
    bad.write_bytes(bytes(data))
    target = tmp_path / "cache"
    installing = begin_install(bad, target)
    owner = bad_part.owners[0]
    if bad_part.tier1:
        with pytest.raises(ArtifactError, match="the cache dir was left as it was"):
            installing.ensure(owner, tier1=True)
    else:
        installing.start([owner], everything=False, in_child=in_child)
        with pytest.raises(ArtifactError, match="the cache dir was left as it was"):
            installing.result(timeout=0)
        assert isinstance(installing.error, ArtifactError) and str(bad) in str(installing.error)
    assert not _files(target) & set(bad_part.files)
    whole = [i for i in range(len(manifest.parts)) if i != bad_index]  # each read alone, or against its dictionary
    other = begin_install(bad, tmp_path / "other")
    other.install_parts(whole)
    assert _files(tmp_path / "other") == _part_files(manifest, whole)
    with pytest.raises(ArtifactError, match="the cache dir was left as it was"):
        begin_install(bad, tmp_path / "all").finish(in_child=in_child)
    assert not _files(tmp_path / "all") & set(bad_part.files)


def test_a_pinned_install_in_a_child_owns_what_it_installs(smoke_artifact: Path, tmp_path: Path) -> None:
    """The install's child process reads the pinned artifact through the descriptor the job hashed it
    through (passed under the same number), and refuses a planted file at one of its paths as the job's process
    does, naming it, with nothing written; without the planted file it installs every file."""
    from kernelpack import _fs
    from kernelpack.installer import begin_install

    sha = _fs.sha256_file(smoke_artifact)
    rel = sorted(art.read_manifest(smoke_artifact).files)[-1]
    target = tmp_path / "planted"
    (target / rel).parent.mkdir(parents=True)
    (target / rel).write_bytes(b"planted")
    before = tree_digest(target)
    installing = begin_install(smoke_artifact, target, sha256=sha)
    with pytest.raises(InstallError, match="hold other content") as e:
        installing.finish(in_child=True)
    assert rel in str(e.value) and tree_digest(target) == before
    good = begin_install(smoke_artifact, tmp_path / "good", sha256=sha).finish(in_child=True)
    assert good.written == good.files
    assert_installed(tmp_path / "good", smoke_artifact)


def test_a_cancelled_extract_rolls_back_at_every_file_until_its_markers(smoke_artifact: Path, tmp_path: Path) -> None:
    """The install's child stops on a flag (its stdin closed), checked before each file is staged, before each is
    linked, and once before the markers: cancelled at any of those checks, the extract raises InstallError with the
    target exactly as it was (no file, no directory, no staging directory, no marker); never cancelled, it installs
    everything and its marker."""
    from kernelpack.staging import extract

    class CancelAt(threading.Event):
        """Set from the ``n``-th look on: the extract cancelled at that point of its work."""

        def __init__(self, n: int) -> None:
            super().__init__()
            self.n, self.looks = n, 0

        def is_set(self) -> bool:
            self.looks += 1
            return self.looks >= self.n

    manifest = art.read_manifest(smoke_artifact)
    checks = 2 * len(manifest.files) + 1
    for n in range(1, checks + 1):
        target = tmp_path / f"c{n}"
        target.mkdir()
        marker = target / "m.json"
        with pytest.raises(InstallError, match="the install was stopped"):
            extract(str(smoke_artifact), manifest, target, marks=[(marker, {}, None)], cancel=CancelAt(n))
        assert list(target.iterdir()) == [], (n, list(target.rglob("*")))
    target = tmp_path / "never"
    counts = extract(
        str(smoke_artifact), manifest, target, marks=[(target / "m.json", {}, None)], cancel=CancelAt(checks + 1)
    )
    assert counts.written == len(manifest.files) and (target / "m.json").is_file()


_KILLED_PARENT = """
import signal, sys, time
if sys.argv[3] == "ignored":  # as under `nohup job &`: the shell ignores SIGINT in a background command
    signal.signal(signal.SIGINT, signal.SIG_IGN)
from kernelpack.installer import begin_install
installing = begin_install(sys.argv[1], sys.argv[2])
print("started", flush=True)
installing.finish(in_child=True)
print("finished", flush=True)
"""


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_the_install_s_child_rolls_back_when_the_job_dies(smoke_artifact: Path, tmp_path: Path, sigint: str) -> None:
    """The job (the child's parent) SIGKILLed while its child extracts: the child sees its stdin close,
    stops and removes what it staged and linked. Nothing is left half-written: no file of the artifact, no staging
    directory, no marker; and the child does not outlive the job by more than a moment. The child is paused
    (SIGSTOP) while it holds staged files, so that the kill lands mid-install. ``ignored``: a job whose SIGINT is
    ignored (started as ``nohup job &``), which its child inherits (the child once stopped through a simulated
    SIGINT, which an ignored SIGINT dropped).

    Staged files outlive the commit by a moment (the install marker is written before the staging directory goes):
    a pause there finds the install done, and a whole install is what must then be left (CI at dc04d4d paused there
    once). Such an attempt is checked for that and the kill tried again, until one lands before the commit."""
    artifact = _big_artifact(smoke_artifact, tmp_path)
    sha = hashlib.sha256(artifact.read_bytes()).hexdigest()
    files = set(art.read_manifest(artifact).files)
    for attempt in range(5):
        target = tmp_path / f"cache{attempt}"
        committed, left = _kill_mid_install(artifact, target, sigint, marker_path(target, sha))
        assert not list(target.glob(".kernelpack-tmp-*")), "a staging directory outlived the install's child"
        if not committed:
            assert left == [], left
            return
        # paused after the install marker: the rollback may still run (nothing left), or the install stays, whole
        assert left == [] or (marker_path(target, sha).is_file() and files <= set(left)), left
    pytest.fail("every kill landed after the install's commit: the install is too fast to catch in the middle")


def _kill_mid_install(artifact: Path, target: Path, sigint: str, marker: Path) -> tuple[bool, list[str]]:
    """Start a job that installs ``artifact`` into ``target`` in its child, pause the child once it has staged a
    file, SIGKILL the job, let the child go on; return whether the install marker was there at the pause, and the
    files left in ``target`` once the child is gone."""
    import signal
    import time

    parent = subprocess.Popen(
        [sys.executable, "-c", _KILLED_PARENT, str(artifact), str(target), sigint],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 120
        kids: list[int] = []
        while not kids and parent.poll() is None and time.monotonic() < deadline:
            kids = _children(parent.pid)  # found first: the poll below then costs a glob, not a scan of /proc
            time.sleep(0.002)
        assert len(kids) == 1, f"the job should have one child (its install's), has {kids}"
        child = kids[0]
        paused = False
        while not paused and _alive(child) and time.monotonic() < deadline:
            if any(p.name != ".owner" for p in target.glob(".kernelpack-tmp-*/*")):
                os.kill(child, signal.SIGSTOP)
                paused = True
            else:
                time.sleep(0.001)
        assert paused, "the install finished before it could be paused"
        committed = marker.exists()  # the child is stopped: this is where it stands
    finally:
        parent.kill()
        parent.wait()
    os.kill(child, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the install's child outlived the job"
    return committed, [p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()]


def _big_artifact(smoke_artifact: Path, tmp_path: Path) -> Path:
    """The smoke artifact plus 40 files of 1 MiB (random bytes: zstd cannot shrink them), so that an install takes
    long enough to be caught in the middle."""
    import dataclasses
    import random

    rng = random.Random(0)
    tree = tmp_path / "tree"
    manifest = art.unpack(smoke_artifact, tree)
    files = dict(manifest.files)
    for i in range(40):
        rel = f"triton/0/{hashlib.sha256(str(i).encode()).hexdigest()[:52]}/kernel.cubin"
        (tree / rel).parent.mkdir(parents=True)
        data = rng.randbytes(1 << 20)
        (tree / rel).write_bytes(data)
        files[rel] = mf.FileEntry(rel, len(data), hashlib.sha256(data).hexdigest())
    big = dataclasses.replace(manifest, files=dict(sorted(files.items())))
    return art.pack(tmp_path / "big.kpack", big, {rel: tree / rel for rel in files}, level=1)[0]


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
