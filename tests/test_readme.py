"""The README's and docs/'s examples run as written: every Python block (except those whose first line says they need
a GPU), each in a fresh process, in one directory where the Quick start ran (out/smoke-cpu-*.kpack) and with the
registry the README's "In CI" paragraph makes; every `kernelpack.x.y` they name exists; docs/cli.md documents every
command and option click defines, and only those; docs/environment.md names every KERNELPACK_* variable
kernelpack/settings.py reads, and only those."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
CLI_PAGE = DOCS / "cli.md"
ENV_PAGE = DOCS / "environment.md"
SETTINGS = ROOT / "kernelpack" / "settings.py"
BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.M | re.S)
NOT_HERE = ("# GPU example",)


def python_blocks(text: str) -> list[str]:
    return [textwrap.dedent(m.group(2)) for m in BLOCK.finditer(text)]


def runnable(page: Path) -> list[str]:
    return [b for b in python_blocks(page.read_text()) if not b.startswith(NOT_HERE)]


def test_the_readme_has_runnable_and_gpu_examples() -> None:
    blocks = python_blocks(README.read_text())
    assert len(runnable(README)) >= 2 and len(blocks) > len(runnable(README))
    assert sum(len(runnable(p)) for p in PAGES) >= 6


def test_the_readme_links_every_docs_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200, "the README is the front page: move the detail to a docs/ page"
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if f"](docs/{p.name})" not in text]
    assert unlinked == [], "link every docs/ page from the README's 'Where to read next'"


@pytest.fixture(scope="module")
def quick_start_dir(smoke_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A directory as the README leaves it: the Quick start's out/, then the "In CI" paragraph's push and lock. Every
    page's examples run here, one after the other, reusing the one smoke artifact."""
    cwd = tmp_path_factory.mktemp("quick-start")
    (cwd / "out").mkdir()
    shutil.copy(smoke_artifact, cwd / "out" / smoke_artifact.name)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "TORCHINDUCTOR_CACHE_DIR": str(cwd / "inductor"),
        "KERNELPACK_DOWNLOAD_DIR": str(cwd / "downloads"),
    }
    (command,) = re.findall(r"`(kernelpack push out/[^`]*)`", README.read_text())
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return cwd, env


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: p.name)
def test_every_python_example_runs_as_written(page: Path, quick_start_dir: tuple[Path, dict[str, str]]) -> None:
    cwd, env = quick_start_dir
    for block in runnable(page):
        proc = subprocess.run(
            [sys.executable, "-c", block], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
        )
        assert proc.returncode == 0, f"{page.name} example failed:\n{block}\n{proc.stderr[-3000:]}"
        promised = re.search(r"# 0 of (\d+) compiles missed \(\.\.\.\); (\d+) first calls", block)
        if promised:  # an example that prints report().summary() prints what its comment promises: nothing
            # compiled after activate(), and as many first calls (the warm-up's and the precompiled loads at a
            # signature's first call) as it says
            compiles, first = promised.groups()
            assert proc.stdout.startswith(f"0 of {compiles} compiles missed (0 FX-graph misses"), proc.stdout
            out = proc.stdout
            assert f"; {first} first calls (" in out and "by the warm-up)" in out, out
        assert "runtime.report()" not in block or promised, block


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


def test_every_api_the_docs_name_exists() -> None:
    """At ecc4142 the README said `kernelpack.install.rank_cache_dir()`, an AttributeError."""
    named = {(p.name, n) for p in PAGES for n in re.findall(r"`(kernelpack(?:\.\w+)+)", p.read_text())}
    names = {n for _, n in named}
    assert "kernelpack.rank_cache_dir" in names and "kernelpack.runtime.pin_local_gpu" in names
    missing = []
    for page, name in sorted(named):
        try:
            resolve(name)
        except (AttributeError, ImportError) as e:
            missing.append(f"{page}: {name}: {e}")
    assert missing == []
    with pytest.raises((AttributeError, ImportError)):
        resolve("kernelpack.install.rank_cache_dir")


# ---------------------------------------------------------------------------------------------------- docs/cli.md

OPTION = re.compile(r"(?<![^\s\[(`])(--?[A-Za-z][\w-]*)")  # after a space, a [, a ( or a backtick
SECTION = re.compile(r"^## `kernelpack (\w+)`$", re.M)
SPAN = re.compile(r"`([^`\n]+)`")


def cli_sections(text: str) -> dict[str, str]:
    """docs/cli.md's ``## `kernelpack NAME` `` sections, by command name, and its global options as ``""``."""
    heads = list(SECTION.finditer(text))
    sections = {
        m.group(1): text[m.end() : n.start() if n else len(text)]
        for m, n in zip(heads, [*heads[1:], None], strict=True)
    }
    start = text.index("## Global options")
    sections[""] = text[start : heads[0].start()]
    return sections


def table_options(section: str) -> set[str]:
    """The options a section's table documents: those in the first cell of each row."""
    return {o for line in section.splitlines() if line.startswith("| `-") for o in OPTION.findall(line.split("|")[1])}


def command_mentions(text: str) -> Iterator[tuple[str, str]]:
    """(command, option) for every option of a ``kernelpack COMMAND ...`` in a code span or a code block line: what
    the text tells a reader to type. Past ``--`` is record's command; past ``#`` a comment."""
    pieces = [s for span in SPAN.findall(text) for s in re.split(r"&&|;| \| ", span)]
    pieces += [s for line in text.splitlines() for s in re.split(r"&&|;| \| ", line)]
    for piece in pieces:
        m = re.match(r"\s*(?:python -m )?kernelpack (\w+)\b(.*)", piece)
        if m is None:
            continue
        args = m.group(2).split(" -- ")[0].split(" #")[0]
        for option in OPTION.findall(args):
            yield m.group(1), option


def test_the_cli_page_documents_every_command_and_option() -> None:
    """docs/cli.md has one section per command, whose table lists each of its options (every spelling: -o and --out)
    and whose synopsis shows each, in brackets when it is not required; no option it names (in the synopsis, the
    table, a code span that starts with it) is one click does not define; and every `kernelpack COMMAND --option`
    written anywhere in the README or docs/ exists. Checked against click's commands, not copied from them."""
    import click

    from kernelpack.cli import commands

    def opts(command: click.Command) -> list[click.Option]:
        return [p for p in command.params if isinstance(p, click.Option) and p.name != "help"]

    text = CLI_PAGE.read_text()
    sections = cli_sections(text)
    assert sorted(n for n in sections if n) == sorted(commands.commands), "one section per command"
    assert "python -m kernelpack" in text
    group = {o for p in opts(commands) for o in p.opts} | {"-h", "--help"}
    assert table_options(sections[""]) == group, "the global options table"
    known = {name: {o for p in opts(c) for o in p.opts} | group for name, c in commands.commands.items()}
    for name, command in commands.commands.items():
        section = sections[name]
        (synopsis,) = re.findall(rf"^kernelpack {name} .*$", section, re.M)
        mine = {o for p in opts(command) for o in p.opts}
        assert table_options(section) == mine, f"`kernelpack {name}`: its table's options are not click's"
        for token in OPTION.findall(synopsis.replace("[", " ").replace("]", " ").replace("|", " ")):
            assert token in known[name], f"`kernelpack {name}`: the synopsis names {token}, which it does not take"
        for span in SPAN.findall(section):
            if span.startswith("-"):
                token = OPTION.findall(span)[0]
                assert token in known[name], f"`kernelpack {name}`: docs/cli.md names {token}, which it does not take"
        for p in opts(command):
            shown = [o for o in p.opts if f"{o} " in synopsis + " " or f"{o}]" in synopsis]
            assert shown, f"`kernelpack {name}`: the synopsis does not show {max(p.opts, key=len)}"
            at = synopsis.index(shown[0])
            bracketed = synopsis[:at].count("[") > synopsis[:at].count("]")
            assert bracketed == (not p.required), f"`kernelpack {name}` {shown[0]}: bracketed={bracketed}"
    wrong = sorted(
        {
            f"{page.name}: kernelpack {name} {option}"
            for page in PAGES
            for name, option in command_mentions(page.read_text())
            if name in known and option not in known[name]
        }
    )
    assert wrong == [], "options the commands do not take"


# ---------------------------------------------------------------------------------------------------- environment

VARIABLE = re.compile(r"\bKERNELPACK_[A-Z0-9_]*[A-Z0-9]\b")


def test_the_environment_page_names_every_variable_settings_reads() -> None:
    """Every KERNELPACK_* name in kernelpack/settings.py (the one module that reads the environment:
    tests/test_layers.py) is in docs/environment.md's tables, and every one the page names is in settings.py."""
    read = set(VARIABLE.findall(SETTINGS.read_text()))
    page = ENV_PAGE.read_text()
    tabled = {v for line in page.splitlines() if line.startswith("| `KERNELPACK_") for v in VARIABLE.findall(line)[:1]}
    assert "KERNELPACK_ARTIFACT" in read and "KERNELPACK_RECORD_DIR" in read
    assert sorted(read - tabled) == [], "variables settings.py reads that docs/environment.md does not document"
    assert sorted(set(VARIABLE.findall(page)) - read) == [], "variables docs/environment.md names that nothing reads"
