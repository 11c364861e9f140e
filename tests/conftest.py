from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "recipes" / "smoke-cpu.toml"


def tree_digest(root: Path) -> str:
    """Every path, type, mode and content under root: equal digests mean the tree is byte-for-byte the same."""
    h = hashlib.sha256()
    if not root.exists():
        return "absent"
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = Path(dirpath, name)
            st = p.lstat()
            h.update(f"{p.relative_to(root)}\0{st.st_mode}\0".encode())
            if p.is_file() and not p.is_symlink():
                h.update(p.read_bytes())
    return h.hexdigest()


def build_once(tmp_path_factory: pytest.TempPathFactory, recipe: Path, *options: str, jobs: int = 2) -> Path:
    """``recipe`` built once per test run (``kernelpack build RECIPE -o DIR --jobs JOBS OPTIONS...``, as the README
    says), and shared: by the pytest-xdist workers of one run (under a lock, in the run's base temp dir, which they
    share) and by .ci/other-torch's one pytest process per file (``KERNELPACK_TEST_ARTIFACTS``). Keyed by the
    recipe's bytes, the options and this torch. Only for tests that read the artifact, never change it: a test that
    repacks or damages one works on a copy."""
    import fcntl
    import shutil

    import torch

    from kernelpack.cli import main

    shared = os.environ.get("KERNELPACK_TEST_ARTIFACTS")
    if shared:
        root = Path(shared)
    else:
        root = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's base temp is popen-gwN under the run's
            root = root.parent
    key = hashlib.sha256(recipe.read_bytes() + "\0".join([*options, torch.__version__]).encode()).hexdigest()[:16]
    out = root / "built" / f"{recipe.stem}-{key}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other workers wait for the one build, then read it
        if not out.is_dir():
            work = out.parent / f"{out.name}.partial"
            shutil.rmtree(work, ignore_errors=True)  # a worker killed mid-build left it
            assert main(["build", str(recipe), "-o", str(work), "--jobs", str(jobs), *options]) == 0
            work.rename(out)  # whole, or not there
    (artifact,) = out.glob("*.kpack")
    return artifact


@pytest.fixture(scope="session")
def smoke_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The smoke recipe built once per test run through the CLI, exactly as the README says."""
    return build_once(tmp_path_factory, SMOKE)


@pytest.fixture(scope="session")
def smoke_shards(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The smoke recipe built again, as CI's build-kernels workflow builds a recipe: in 2 shards (one config each).
    Merged, they are a rebuild of ``smoke_artifact``: same inputs, other bytes."""
    return [build_once(tmp_path_factory, SMOKE, "--shard", f"{i}/2") for i in (1, 2)]


def run_json(
    cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 600, cwd: Path | None = None
) -> Any:
    """Run ``cmd`` in a fresh process (a job script, a scenario, a bench script) and return the JSON value on the last
    line of its stdout. ``env`` is added to this process's environment. A non-zero exit fails the test with the end of
    the process's stderr."""
    proc = subprocess.run(
        list(cmd),
        env=None if env is None else {**os.environ, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def repack(artifact: Path, out: Path, work: Path, *, drop=lambda rel: False, **overrides: object) -> Path:
    """A copy of ``artifact`` with manifest fields replaced and/or files dropped, packed by kernelpack's packer."""
    from kernelpack import artifact as art
    from kernelpack import manifest as mf

    tree = work / "tree"
    source = art.unpack(artifact, tree)
    data = source.to_dict()
    data.pop("parts", None)  # the packer lays out the parts again, from each file's owners
    files = {rel: p for rel, p in art.scan_tree(tree).items() if not drop(rel)}
    entries = art.hash_files(files)
    for c in data["configs"]:  # a dropped precompiled function is dropped from its config's list too
        c["precompiled"] = [p for p in c.get("precompiled", []) if p["path"] in files]
    data = {**data, **overrides, "files": [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in entries]}
    art.pack(out, mf.Manifest.from_dict(data, source=str(out)), files, owners=source.owners())
    return out


def torch_release() -> tuple[int, int]:
    """This torch's (major, minor), for tests that skip where a torch release is known to fail."""
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)
