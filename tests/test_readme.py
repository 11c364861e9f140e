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


def test_the_cli_reference_matches_the_commands() -> None:
    """The README's CLI table names every option of every command, and only those; an option that is not required
    (it has a default) is shown in brackets. The table is checked against click's commands, not copied from them."""
    import click

    from kernelpack.cli import commands

    text = README.read_text()
    rows = {}
    for line in text[text.index("## CLI reference") :].splitlines():
        if line.startswith("| `kernelpack "):
            synopsis = line.split("`")[1]
            rows[synopsis.split()[1]] = synopsis
    assert sorted(rows) == sorted(commands.commands), "one row per command"
    for name, command in commands.commands.items():
        synopsis = rows[name]
        options = [p for p in command.params if isinstance(p, click.Option) and p.name != "help"]
        known = {o for p in options for o in p.opts}
        for token in synopsis.replace("[", " ").replace("]", " ").replace("|", " ").split():
            if token.startswith("-") and token != "--":
                assert token in known, f"`kernelpack {name}`: the README names {token}, which it does not take"
        for p in options:
            shown = [o for o in p.opts if f"{o} " in synopsis + " " or f"{o}]" in synopsis]
            assert shown, f"`kernelpack {name}`: the README does not show {max(p.opts, key=len)}"
            at = synopsis.index(shown[0])
            bracketed = synopsis[:at].count("[") > synopsis[:at].count("]")
            assert bracketed == (not p.required), f"`kernelpack {name}` {shown[0]}: bracketed={bracketed}"
