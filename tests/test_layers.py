"""kernelpack's own imports go down the layers only and form no cycle (docs/architecture.md, "Layout"), counting the
imports inside functions too: a function-level import that hides a cycle is still a cycle. And only
kernelpack.settings reads the environment."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kernelpack"

# lower number = lower layer; a module may import its own layer or any lower one
LAYERS = {
    # ground: no torch at import time, no knowledge of the format
    "_version": 0,
    "errors": 0,
    "settings": 0,
    "keys": 0,
    "_fs": 0,
    "_imports": 0,
    "_toml": 0,  # the one TOML writer (record, recipe_for)
    "records": 0,  # the typed JSON records: the lock file, a build worker's result, verify's report
    "_lock": 0,
    "_worker": 0,
    "_torch": 0,  # torch's internals, one module per area (imports errors only; torch lazily)
    # format: what a call, a recipe, an artifact and the evidence are
    "signature": 1,
    "closures": 1,
    "functions": 1,
    "config": 1,  # one point of a recipe, validated
    "recipe": 1,  # the recipe file format
    "manifest": 1,  # what an artifact holds and covers, typed
    "parts": 1,  # the archive's parts: which files a signature needs
    "artifact": 1,  # the archive around it: pack, read, unpack, merge
    "evidence": 1,
    # mechanisms: each does one thing to files, torch or a registry; none starts a job
    "compiled": 2,
    "precompiled": 2,
    "masks": 2,
    "canonical": 2,
    "staging": 2,  # an artifact's files into a cache dir: staged, verified, linked, rolled back
    "installer": 2,
    "store": 2,
    "recipe_writer": 2,  # what record writes: the recorded calls as one recipe, checked by making their masks
    # process: the one module with process side effects
    "runtime": 3,
    # clients of the runtime: integrations with libraries (runtime names them in INTEGRATIONS, never imports them)
    "integrations": 4,
    "record": 4,
    # tools
    "workload": 5,
    "build": 5,
    "verify": 5,
    "_render": 5,
    "cli": 5,
    "__main__": 5,  # python -m kernelpack: the CLI
}


def imports_of(path: Path, depth: int = 1) -> set[str]:
    """The kernelpack modules ``path`` imports, anywhere in the file (module level, functions, TYPE_CHECKING);
    ``depth`` 2 for a module of a subpackage (its ``from ..x`` imports are kernelpack's)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and depth == 2:
            if node.level == 2 and node.module is None:
                found.update(alias.name for alias in node.names)
            elif node.level == 2 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 0 and node.module and node.module.startswith("kernelpack."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:  # from . import a, b
                found.update(alias.name for alias in node.names)
            elif node.level == 1 and node.module:  # from .a import x
                found.add(node.module.split(".")[0])
            elif node.level == 0 and node.module and node.module.startswith("kernelpack."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("kernelpack."))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}  # the facade resolves lazily
    subpackages = ("integrations", "_torch", "runtime")
    graph = {name: imports_of(path) & (modules.keys() | set(subpackages)) for name, path in sorted(modules.items())}
    # a subpackage is one node: the union of its modules' imports (its own modules' imports of each other are inside)
    for sub in subpackages:
        inside = {p.stem for p in (PACKAGE / sub).glob("*.py")}
        graph[sub] = set().union(*(imports_of(p, 2) for p in (PACKAGE / sub).glob("*.py"))) - inside
        graph[sub] &= modules.keys() | set(subpackages)
    return graph


def upward_edges(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    return [f"{a} -> {b}" for a, deps in graph.items() for b in sorted(deps) if layers[b] > layers[a]]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_module_has_a_layer() -> None:
    assert sorted(import_graph()) == sorted(LAYERS), "place a new module in LAYERS (and docs/architecture.md's Layout)"


def test_no_module_is_over_800_lines() -> None:
    """One room per idea: a module past 800 lines holds two (runtime.py held ten jobs in 1,865 lines)."""
    long = {
        p.relative_to(PACKAGE).as_posix(): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 800
    }
    assert long == {}, "split it where its ideas part"


def test_imports_only_go_down() -> None:
    assert upward_edges(import_graph(), LAYERS) == []


def test_no_import_cycle() -> None:
    assert find_cycle(import_graph()) is None


def test_the_checks_can_fail() -> None:
    """The checker itself, on the graph ecc4142 had: install -> runtime -> install (and store -> install)."""
    old = {"install": {"runtime", "artifact"}, "runtime": {"install", "masks", "store"}, "masks": {"runtime"}}
    old |= {"store": {"install"}, "artifact": set()}
    assert find_cycle(old) in (["install", "runtime", "install"], ["masks", "runtime", "masks"])
    layers = {"install": 2, "runtime": 3, "masks": 2, "store": 2, "artifact": 1}
    assert upward_edges(old, layers) == ["install -> runtime", "masks -> runtime"]


def test_only_settings_reads_the_environment() -> None:
    """Every KERNELPACK_* (and other) variable is read, validated, through kernelpack.settings at call time."""
    readers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.stem == "settings":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            text = ast.unparse(node) if isinstance(node, (ast.Call, ast.Subscript)) else ""
            is_read = isinstance(node, ast.Call) and text.startswith(("os.environ.get(", "os.getenv("))
            is_read |= isinstance(node, ast.Subscript) and text.startswith("os.environ[") and _is_load(node)
            if is_read:
                readers.append(f"{path.name}:{node.lineno}: {text}")
    assert readers == []


def _is_load(node: ast.Subscript) -> bool:
    return isinstance(node.ctx, ast.Load)


@pytest.mark.parametrize("module", ["kernelpack", "kernelpack.cli", "kernelpack.artifact", "kernelpack.store"])
def test_importing_does_not_import_torch(module: str) -> None:
    import subprocess
    import sys

    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_no_public_function_shares_its_name_with_a_module() -> None:
    """`kernelpack.install` was a module and a function at ecc4142: which one a user got depended on import order."""
    modules = {p.stem for p in PACKAGE.rglob("*.py")}
    clashes = [
        f"{path.stem}.{node.name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.parse(path.read_text()).body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in modules
    ]
    assert clashes == []
    import kernelpack

    assert callable(kernelpack.install) and kernelpack.install.__module__ == "kernelpack.runtime.start"


# the runtime package's own floors: its modules import only down these (and session and ranks nothing of it)
RUNTIME_LAYERS = {
    "session": 0,  # the activation's state
    "ranks": 0,  # a rank's GPU and cache dir
    "calls": 1,  # one call, normalized, keyed once
    "refusals": 2,  # why not: each server's rejection, the refusal they make
    "attribution": 3,
    "warmup": 4,
    "serving": 5,  # the chain of servers
    "dispatch": 6,  # the guarded entry
    "reporting": 6,
    "start": 7,
}


def runtime_graph() -> dict[str, set[str]]:
    """The runtime package's modules and which of them each imports (``from . import x``, ``from .x import y``)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / "runtime").glob("*.py")):
        if path.stem == "__init__":
            continue
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found.update(a.name for a in node.names) if node.module is None else found.add(node.module)
        graph[path.stem] = found
    return graph


def test_the_runtime_package_s_modules_import_only_down() -> None:
    graph = runtime_graph()
    assert sorted(graph) == sorted(RUNTIME_LAYERS), "place a new runtime module in RUNTIME_LAYERS"
    assert upward_edges(graph, RUNTIME_LAYERS) == [] and find_cycle(graph) is None
    # the public names stay where a user imports them from: the package's __init__ re-exports, no module of it
    # reaches into another's private names
    private = [
        f"{path.stem}: from .{node.module} import {a.name}"
        for path in sorted((PACKAGE / "runtime").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level == 1
        for a in node.names
        if a.name.startswith("_") and not a.name.startswith("__")
    ]
    assert private == []


def test_the_runtime_names_its_integrations_and_they_sit_above_it() -> None:
    """activate() registers integrations by name (runtime.INTEGRATIONS, as fsspec's known_implementations), never by
    import: the edge runtime -> integration is this table, and each named module exists and imports the runtime."""
    from kernelpack.runtime import INTEGRATIONS

    for library, module in INTEGRATIONS.items():
        assert module.startswith("kernelpack.integrations."), (library, module)
        path = PACKAGE / "integrations" / (module.rsplit(".", 1)[1] + ".py")
        assert path.exists() and "runtime" in imports_of(path, 2), module
