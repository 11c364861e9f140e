"""Registries with real components: a local dir, memory://, a static http server and an S3-compatible server (moto)
on loopback through s3fs, and real processes pulling at once."""

from __future__ import annotations

import dataclasses
import functools
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SMOKE, repack

from kernelpack import artifact as art
from kernelpack import manifest as mf
from kernelpack.cli import main
from kernelpack.errors import KernelpackError
from kernelpack.installer import install_artifact
from kernelpack.store import (
    LockMismatchError,
    NoMatchingArtifactError,
    Registry,
    RegistryError,
    pull,
    write_lock,
)


@pytest.fixture(autouse=True)
def download_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "downloads"
    monkeypatch.setenv("KERNELPACK_DOWNLOAD_DIR", str(d))
    return d


class _Handler(http.server.SimpleHTTPRequestHandler):
    gets: Counter[str]
    truncate: bool = False
    slow: bool = False

    def do_GET(self) -> None:
        self.gets[self.path] += 1
        if self.slow and self.path.endswith(mf.SUFFIX):
            data = Path(self.translate_path(self.path)).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            for i in range(0, len(data), 4096):  # about 2.5 s for the smoke artifact: time to kill the client
                self.wfile.write(data[i : i + 4096])
                self.wfile.flush()
                time.sleep(0.1)
            return
        if self.truncate and self.path.endswith(mf.SUFFIX):
            data = Path(self.translate_path(self.path)).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])  # the server dies mid-transfer
            self.wfile.flush()
            self.close_connection = True
            return
        super().do_GET()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_registry(tmp_path: Path, smoke_artifact: Path) -> Iterator[tuple[str, Counter[str], type[_Handler]]]:
    """A registry directory pushed to as a path and served read-only over http on loopback."""
    root = tmp_path / "served"
    Registry(str(root)).push(smoke_artifact)
    gets: Counter[str] = Counter()
    handler = type("H", (_Handler,), {"gets": gets, "truncate": False})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", gets, handler
    finally:
        server.shutdown()
        server.server_close()


def test_local_push_is_idempotent_and_refuses_overwrite(smoke_artifact: Path, tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "reg"))
    entry, status, _ = reg.push(smoke_artifact)
    assert status == "pushed" and entry.sha256 == art.sha256_file(smoke_artifact)
    assert (tmp_path / "reg" / entry.path).read_bytes() == smoke_artifact.read_bytes()
    assert reg.push(smoke_artifact)[1] == "unchanged"
    other = repack(
        smoke_artifact, tmp_path / smoke_artifact.name, tmp_path / "w", created=1, kernelpack_version="0.0.1"
    )  # other inputs
    with pytest.raises(RegistryError, match="already holds another artifact"):
        reg.push(other)
    assert reg.push(other, force=True)[1] == "replaced"
    (only,) = reg.entries("smoke-cpu")
    assert only.sha256 == art.sha256_file(other)
    index = json.loads((tmp_path / "reg" / "index.json").read_text())
    assert [e["sha256"] for e in index["entries"]] == [only.sha256]


def test_pull_selects_this_build_and_explains_every_rejection(smoke_artifact: Path, tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "reg"))
    m = art.read_manifest(smoke_artifact).to_dict()
    alien = repack(
        smoke_artifact,
        tmp_path / "alien.kpack",
        tmp_path / "w",
        build_key={**m["build_key"], "torch_git": "70d99e998b49" + "0" * 28},
    )
    reg.push(alien)
    with pytest.raises(NoMatchingArtifactError) as exc:
        pull(str(tmp_path / "reg"), "smoke-cpu")
    assert "torch_git '70d99e998b49" in str(exc.value) and "!= here" in str(exc.value)
    reg.push(smoke_artifact)
    r = pull(str(tmp_path / "reg"), "smoke-cpu")
    installed = install_artifact(r.path, tmp_path / "cache")
    assert r.entry.sha256 == art.sha256_file(smoke_artifact) and r.downloaded
    assert installed.written == installed.files
    assert not pull(str(tmp_path / "reg"), "smoke-cpu").downloaded  # node-local cache reused


def test_builds_for_two_cuda_versions_get_two_names_and_pull_takes_this_torchs(
    smoke_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One torch release and commit built against CUDA 12.8 and 13.0: two file names, two registry entries, and the
    pull (what activate(registry=...) does) takes the one of ``torch.version.cuda``."""
    import torch

    from kernelpack.keys import BuildKey

    reg = Registry(str(tmp_path / "reg"))
    built = {}
    for cuda in ("12.8", "13.0"):
        data = art.read_manifest(smoke_artifact).to_dict()
        key = BuildKey.from_dict({**data["build_key"], "cuda": cuda})
        name = mf.artifact_name("smoke-cpu", key.tag)
        built[cuda] = repack(smoke_artifact, tmp_path / name, tmp_path / f"w{cuda}", build_key=key.to_dict())
        reg.push(built[cuda])
    assert len({p.name for p in built.values()}) == 2 and all(
        f"-cu{c.replace('.', '')}-" in built[c].name for c in built
    )
    assert len({e.path for e in reg.entries("smoke-cpu")}) == 2
    for cuda in ("13.0", "12.8"):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        assert pull(str(tmp_path / "reg"), "smoke-cpu").entry.sha256 == art.sha256_file(built[cuda])
    monkeypatch.setattr(torch.version, "cuda", "13.2")
    with pytest.raises(NoMatchingArtifactError) as exc:
        pull(str(tmp_path / "reg"), "smoke-cpu")
    assert "cuda '12.8' != here '13.2'" in str(exc.value) and "cuda '13.0' != here '13.2'" in str(exc.value)


def test_lock_pins_and_pull_refuses_anything_else(smoke_artifact: Path, tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "reg"))
    reg.push(smoke_artifact)
    lock_file = tmp_path / "kernelpack.lock"
    data = write_lock(reg, "smoke-cpu", lock_file).to_dict()
    assert [p["sha256"] for p in data["artifacts"]] == [art.sha256_file(smoke_artifact)]
    assert pull(str(tmp_path / "reg"), "smoke-cpu", lock=lock_file).entry.sha256 == data["artifacts"][0]["sha256"]
    # the registry's artifact changes under the same build key: the pin refuses it, naming both hashes
    other = repack(
        smoke_artifact, tmp_path / smoke_artifact.name, tmp_path / "w", created=2, kernelpack_version="0.0.1"
    )
    reg.push(other, force=True)
    # push --force keeps the replaced artifact for the locks that pin it; a registry without it (pruned, or
    # overwritten by something other than kernelpack) refuses
    assert pull(str(tmp_path / "reg"), "smoke-cpu", lock=lock_file).entry.sha256 == data["artifacts"][0]["sha256"]
    for kept in (tmp_path / "reg").rglob("superseded"):
        shutil.rmtree(kept)
    with pytest.raises(LockMismatchError) as exc:
        pull(str(tmp_path / "reg"), "smoke-cpu", lock=lock_file)
    assert art.sha256_file(other) in str(exc.value) and data["artifacts"][0]["sha256"] in str(exc.value)
    (tmp_path / "bad.lock").write_text("{}")
    with pytest.raises(KernelpackError, match="not a kernelpack lock file"):
        pull(str(tmp_path / "reg"), "smoke-cpu", lock=tmp_path / "bad.lock")


def test_memory_registry(smoke_artifact: Path, tmp_path: Path) -> None:
    url = f"memory://kp-{os.getpid()}-{tmp_path.name}"
    Registry(url).push(smoke_artifact)
    assert [e.recipe for e in Registry(url).entries()] == ["smoke-cpu"]
    assert pull(url, "smoke-cpu").path.read_bytes() == smoke_artifact.read_bytes()


def test_http_registry_is_read_only_and_pullable(
    http_registry: tuple, smoke_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _, _ = http_registry
    assert main(["ls", url]) == 0
    assert "smoke-cpu" in capsys.readouterr().out
    r = pull(url, "smoke-cpu")
    assert r.path.read_bytes() == smoke_artifact.read_bytes() and install_artifact(r.path, tmp_path / "c").written
    assert main(["push", str(smoke_artifact), url]) == 1
    assert "read-only" in capsys.readouterr().err


def test_eight_processes_pull_at_once_download_once(http_registry: tuple, smoke_artifact: Path, tmp_path: Path) -> None:
    url, gets, _ = http_registry
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kernelpack.cli",
                "pull",
                url,
                "--recipe",
                "smoke-cpu",
                "--install",
                "--cache-dir",
                str(tmp_path / f"rank{i}"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(8)
    ]
    outs = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    assert [rc for rc, _, _ in outs] == [0] * 8, [err for _, _, err in outs]
    payload_gets = {path: n for path, n in gets.items() if path.endswith(mf.SUFFIX)}
    assert list(payload_gets.values()) == [1], gets
    assert sum("downloaded" in out for _, out, _ in outs) == 1
    m = art.read_manifest(smoke_artifact)
    for i in range(8):
        assert all((tmp_path / f"rank{i}" / rel).stat().st_size == e.size for rel, e in m.files.items())


def test_server_dying_mid_download_leaves_nothing_that_looks_complete(
    http_registry: tuple, download_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _, handler = http_registry
    handler.truncate = True
    assert main(["pull", url, "--recipe", "smoke-cpu"]) == 1
    err = capsys.readouterr().err
    assert "error: " in err and "downloading smoke-cpu/" in err
    assert not list(download_dir.glob(f"*{mf.SUFFIX}")) and not list(download_dir.glob("*.tmp"))
    handler.truncate = False  # a later pull completes
    assert main(["pull", url, "--recipe", "smoke-cpu"]) == 0


def test_a_killed_download_is_never_reused(http_registry: tuple, download_dir: Path, smoke_artifact: Path) -> None:
    url, _, handler = http_registry
    handler.slow = True
    p = subprocess.Popen(
        [sys.executable, "-m", "kernelpack.cli", "pull", url, "--recipe", "smoke-cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while not list(download_dir.glob("*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(download_dir.glob("*.tmp")), "the download never started"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not list(download_dir.glob(f"*{mf.SUFFIX}"))  # only an orphaned temp file, which nothing reads
    handler.slow = False
    r = pull(url, "smoke-cpu")
    assert r.downloaded and r.path.read_bytes() == smoke_artifact.read_bytes()
    assert not list(download_dir.glob("*.tmp"))  # the killed download's temp file was cleaned up


def test_partial_files_in_the_download_cache_are_never_reused(
    smoke_artifact: Path, tmp_path: Path, download_dir: Path
) -> None:
    Registry(str(tmp_path / "reg")).push(smoke_artifact)
    sha = art.sha256_file(smoke_artifact)
    download_dir.mkdir(parents=True)
    (download_dir / f"{sha}{mf.SUFFIX}").write_bytes(b"half")  # e.g. copied by hand, or a foreign tool
    r = pull(str(tmp_path / "reg"), "smoke-cpu")
    assert r.downloaded and r.path.read_bytes() == smoke_artifact.read_bytes()


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield {"endpoint_url": f"http://{host}:{port}"}
    finally:
        server.stop()


def test_s3_push_ls_pull_lock_and_errors(
    s3: dict[str, str], smoke_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import fsspec

    opt = ["--storage-option", f"endpoint_url={s3['endpoint_url']}"]
    # a missing bucket is a clear error, and is never created
    assert main(["push", str(smoke_artifact), "s3://kp-missing/reg", *opt]) == 1
    assert "bucket 'kp-missing' does not exist" in capsys.readouterr().err
    assert main(["ls", "s3://kp-missing/reg", *opt]) == 1
    assert "does not exist" in capsys.readouterr().err
    fs = fsspec.filesystem("s3", **s3)
    assert not fs.exists("kp-missing")
    fs.mkdir("kp-registry")
    url = "s3://kp-registry/reg"
    assert main(["push", str(smoke_artifact), url, *opt]) == 0
    assert main(["push", str(smoke_artifact), url, *opt]) == 0 and "unchanged" in capsys.readouterr().out
    other = repack(
        smoke_artifact, tmp_path / smoke_artifact.name, tmp_path / "w", created=3, kernelpack_version="0.0.1"
    )
    assert main(["push", str(other), url, *opt]) == 1
    assert "already holds another artifact" in capsys.readouterr().err
    assert main(["ls", url, "--json", *opt]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["sha256"] == art.sha256_file(smoke_artifact)
    assert main(["lock", url, "--recipe", "smoke-cpu", "-o", str(tmp_path / "k.lock"), *opt]) == 0
    assert (
        main(
            [
                "pull",
                url,
                "--recipe",
                "smoke-cpu",
                "--lock",
                str(tmp_path / "k.lock"),
                "--install",
                "--cache-dir",
                str(tmp_path / "c"),
                *opt,
            ]
        )
        == 0
    )
    assert "installed" in capsys.readouterr().out
    # the payload vanishes behind its entry: a clear error, nothing in the download cache
    fs.rm(f"kp-registry/reg/{entry['path']}")
    os.environ["KERNELPACK_DOWNLOAD_DIR"] = str(tmp_path / "fresh-downloads")
    assert main(["pull", url, "--recipe", "smoke-cpu", *opt]) == 1
    assert "not found" in capsys.readouterr().err
    assert not list((tmp_path / "fresh-downloads").glob(f"*{mf.SUFFIX}"))


def test_shards_merge_into_one_artifact_that_verifies(
    tmp_path: Path, smoke_artifact: Path, smoke_shards: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from kernelpack.verify import verify_artifact as verify

    shards = smoke_shards  # kernelpack build SMOKE --shard 1/2, then 2/2
    assert len(set(shards)) == 2 and all(".shard-" in s.name for s in shards), shards
    assert [len(art.read_manifest(s).to_dict()["configs"]) for s in shards] == [1, 1]
    assert main(["merge", *map(str, shards), "-o", str(tmp_path / "merged")]) == 0
    (merged,) = (tmp_path / "merged").glob("*.kpack")
    m = art.read_manifest(merged).to_dict()
    assert merged.name == smoke_artifact.name and "shard" not in m
    assert sorted(c["id"] for c in m["configs"]) == sorted(
        c["id"] for c in art.read_manifest(smoke_artifact).to_dict()["configs"]
    )
    report = verify(merged)
    assert (
        report.to_dict()["totals"]["inductor.fxgraph_cache_miss"] == 0
        and report.to_dict()["totals"]["cpp_compiled"] == 0
    )
    # shards of another build refuse to merge, naming the field
    alien = repack(
        shards[1], tmp_path / "alien.kpack", tmp_path / "w", build_key={**m["build_key"], "torch_key": "ab" * 32}
    )
    assert main(["merge", str(shards[0]), str(alien), "-o", str(tmp_path / "x")]) == 1
    assert "torch_key" in capsys.readouterr().err


def test_bad_shard_and_storage_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["build", str(SMOKE), "--shard", "3/2"]) == 1
    assert "bad shard 3/2" in capsys.readouterr().err
    assert main(["ls", str(tmp_path), "--storage-option", "novalue"]) == 1  # usage: error:/hint:, exit 1
    assert "error: Invalid value for --storage-option: 'novalue' is not key=value" in capsys.readouterr().err


def test_entry_round_trip() -> None:
    from kernelpack.keys import BuildKey
    from kernelpack.store import Entry, key_id

    key = BuildKey(**{f.name: "x" for f in dataclasses.fields(BuildKey)} | {"device_type": "cpu"})
    e = Entry(
        recipe="r",
        name="n.kpack",
        path=f"r/{key_id(key)}/n.kpack",
        sha256="0" * 64,
        size=1,
        created=2,
        build_key=key.to_dict(),
        configs=3,
        devices=[0],
    )
    assert Entry.from_dict(dataclasses.asdict(e)) == e


def test_activate_from_a_registry(smoke_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelpack import runtime

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))
    Registry(str(tmp_path / "reg")).push(smoke_artifact)
    act = runtime.activate(registry=str(tmp_path / "reg"), recipe="smoke-cpu", cache_dir=tmp_path / "cache")
    try:
        assert len(act.covered) == 2 and act.install is not None and act.install.cache_dir == str(tmp_path / "cache")
        assert act.artifact is not None and Path(act.artifact).read_bytes() == smoke_artifact.read_bytes()
    finally:
        if act.warmup is not None:  # the default start's thread: done before the next test
            act.warmup.done.wait(300)
        runtime.deactivate()
