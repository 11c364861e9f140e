"""The README's examples run as written: every Python block (except those whose first line says they need a GPU),
each in a fresh process, in a directory where the Quick start ran (out/smoke-cpu-*.kpack) and with the registry the
README's registry paragraph makes; and every `kernelpack.x.y` it names exists."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.M | re.S)
NOT_HERE = ("# GPU example",)


def python_blocks(text: str) -> list[str]:
    return [textwrap.dedent(m.group(2)) for m in BLOCK.finditer(text)]


def test_the_readme_has_runnable_and_gpu_examples() -> None:
    blocks = python_blocks(README.read_text())
    runnable = [b for b in blocks if not b.startswith(NOT_HERE)]
    assert len(runnable) >= 3 and len(blocks) > len(runnable)


@pytest.fixture
def quick_start_dir(smoke_artifact: Path, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A directory as the README leaves it: the Quick start's out/, then the registry paragraph's command."""
    (tmp_path / "out").mkdir()
    shutil.copy(smoke_artifact, tmp_path / "out" / smoke_artifact.name)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "KERNELPACK_DOWNLOAD_DIR": str(tmp_path / "downloads"),
    }
    (command,) = re.findall(r"`(kernelpack push out/[^`]*)`", README.read_text())
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return tmp_path, env


def test_every_python_example_runs_as_written(quick_start_dir: tuple[Path, dict[str, str]]) -> None:
    cwd, env = quick_start_dir
    ran = 0
    for block in python_blocks(README.read_text()):
        if block.startswith(NOT_HERE):
            continue
        proc = subprocess.run(
            [sys.executable, "-c", block], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
        )
        assert proc.returncode == 0, f"README example failed:\n{block}\n{proc.stderr[-3000:]}"
        promised = re.search(r"# 0 of (\d+) compiles missed \(\.\.\.\); (\d+) first calls", block)
        if promised:  # an example that prints report().summary() prints what its comment promises: nothing
            # compiled after activate(), every first call the warm-up's
            compiles, first = promised.groups()
            assert proc.stdout.startswith(f"0 of {compiles} compiles missed (0 FX-graph misses"), proc.stdout
            out = proc.stdout
            assert f"; {first} first calls (" in out and f", {first} by the warm-up)" in out, out
        assert "runtime.report()" not in block or promised, block
        ran += 1
    assert ran >= 3


def resolve(dotted: str) -> object:
    """``kernelpack.a.b`` as Python resolves it: attributes first, then submodules (``import kernelpack.a``)."""
    parts = dotted.split(".")
    obj: object = importlib.import_module(parts[0])
    for i, name in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def test_every_api_the_readme_names_exists() -> None:
    """At ecc4142 the README said `kernelpack.install.rank_cache_dir()`, an AttributeError."""
    names = set(re.findall(r"`(kernelpack(?:\.\w+)+)", README.read_text()))
    assert "kernelpack.rank_cache_dir" in names and "kernelpack.runtime.pin_local_gpu" in names
    missing = []
    for name in sorted(names):
        try:
            resolve(name)
        except (AttributeError, ImportError) as e:
            missing.append(f"{name}: {e}")
    assert missing == []
    with pytest.raises((AttributeError, ImportError)):
        resolve("kernelpack.install.rank_cache_dir")
