"""Post-import hooks (run a function once a module is imported), and imports made alone in one thread.

kernelpack watches torch's compilers (Dynamo's per-compile metrics, inductor's C++ builds, Triton's listener) and
raises Dynamo's recompile limit. Importing Dynamo and inductor to do that costs a job's start 1.5-3.5 s,
and nothing can compile before they are imported: so each hook attaches the moment its module finishes importing, in
the importing thread, before any code can use it (PEP 369's post-import hooks; wrapt's ``register_post_import_hook``
works the same way). One case is not hooked: a module that another thread is importing at the moment the hook is
registered (past the finder); its compiles are still counted by torch, and report() says what it saw no record of.

A background start imports Dynamo and inductor in its own thread while the job's main thread builds its model. Two
threads importing torch's compiler stack at once deadlock on Python's per-module import locks, and Python breaks
the cycle by handing one of them a partly initialized module: ``ImportError: cannot import name 'IndentedBuffer'
from partially initialized module`` (inductor's utils module; measured: CPU, torch 2.13, a background inductor import
while the main thread imported Dynamo). :func:`importing_alone` makes the other threads wait before such an import
instead, until the background thread's imports are done.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

_lock = threading.RLock()
_hooks: dict[str, list[Callable[[ModuleType], None]]] = {}


def after_import(name: str, hook: Callable[[ModuleType], None]) -> None:
    """``hook(module)`` once ``name`` is imported: now, if it is (fully) already (an error is raised to the caller);
    else right after its import finishes, in the importing thread (an error is logged: it never breaks the job's
    import)."""
    with _lock:
        module = sys.modules.get(name)
        if module is not None and not _initializing(module):
            ready = True
        else:
            ready = False
            _hooks.setdefault(name, []).append(hook)
            if not any(isinstance(f, _Finder) for f in sys.meta_path):
                sys.meta_path.insert(0, _Finder())
    if ready:
        hook(module)  # type: ignore[arg-type]  # in the caller's thread: its error is the caller's


def _initializing(module: ModuleType) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _call(hook: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        hook(module)
    except Exception:
        import logging

        logging.getLogger(__name__).warning("kernelpack: a hook on %s failed", module.__name__, exc_info=True)


def _imported(name: str) -> None:
    with _lock:
        hooks = _hooks.pop(name, [])
    for hook in hooks:
        _call(hook, sys.modules[name])


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a hooked module it asks the finders after it, and wraps the loader they return so
    that the hooks run after the module's code."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        with _lock:
            if fullname not in _hooks:
                return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        # the wrapped loader stays what the module's __loader__ says (pkgutil, importlib.resources read it)
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        _imported(self._name)

    def __getattr__(self, name: str) -> Any:  # get_data, get_resource_reader, is_package, ...
        return getattr(self._inner, name)


# ----------------------------------------------------------------------------------------------- imports alone


class _Alone:
    """One thread's imports under ``prefixes``, which every other thread but its helpers waits for."""

    def __init__(self, prefixes: tuple[str, ...], timeout: float) -> None:
        self.owner = threading.get_ident()
        # the threads the owner starts (a compile pool's), and theirs: they must never wait for it
        self.helpers: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self.prefixes = prefixes
        self.timeout = timeout
        self.done = threading.Event()
        self.timed_out = False

    def _covers(self, name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in self.prefixes)

    def exempt(self, thread: threading.Thread) -> bool:
        return thread.ident == self.owner or thread in self.helpers

    def wait_before(self, name: str, fromlist: Sequence[str] | None) -> None:
        if self.done.is_set() or self.exempt(threading.current_thread()):
            return
        names = [name] + [f"{name}.{f}" for f in fromlist or () if isinstance(f, str) and f != "*"]
        if not any(self._covers(n) and not _loaded(n) for n in names):
            return
        if not self.done.wait(self.timeout) and not self.timed_out:
            self.timed_out = True
            logging.getLogger(__name__).warning(
                "kernelpack: the background start's imports did not end within %.0f s; %s is imported alongside "
                "them (Python may then hand either thread a partly initialized module)",
                self.timeout,
                name,
            )


def _loaded(name: str) -> bool:
    """``name`` is fully imported, or an attribute of a fully imported parent (``from pkg import value``)."""
    module = sys.modules.get(name)
    if module is not None:
        return not _initializing(module)
    parent, _, attr = name.rpartition(".")
    module = sys.modules.get(parent) if parent else None
    # its __dict__, not hasattr: a module __getattr__ (torch's lazy submodules) would import, through the gate
    return module is not None and not _initializing(module) and attr in getattr(module, "__dict__", {})


_alone: _Alone | None = None
_original_import = builtins.__import__
_original_import_module = importlib.import_module


def _absolute(name: str, globals: Any, level: int) -> str:
    if level == 0 or not isinstance(globals, dict):
        return name
    package = globals.get("__package__") or globals.get("__name__", "").rpartition(".")[0]
    base = package.rsplit(".", level - 1)[0] if package else ""
    return f"{base}.{name}" if name and base else (base or name)


def _gated_import(
    name: str, globals: Any = None, locals: Any = None, fromlist: Sequence[str] | None = (), level: int = 0
) -> ModuleType:
    alone = _alone
    if alone is not None:
        alone.wait_before(_absolute(name, globals, level), fromlist)
    return _original_import(name, globals, locals, fromlist or (), level)


_original_start = threading.Thread.start


def _gated_start(self: threading.Thread) -> None:
    alone = _alone
    if alone is not None and alone.exempt(threading.current_thread()):
        alone.helpers.add(self)
    _original_start(self)


def _gated_import_module(name: str, package: str | None = None) -> ModuleType:
    # torch's lazy submodules (Dynamo's, as an attribute of torch) are imported through importlib.import_module,
    # which does not call builtins.__import__
    alone = _alone
    if alone is not None:
        absolute = name
        if name.startswith(".") and package:
            level = len(name) - len(name.lstrip("."))
            absolute = _absolute(name[level:], {"__package__": package}, level)
        alone.wait_before(absolute, ())
    return _original_import_module(name, package)


@contextlib.contextmanager
def importing_alone(prefixes: tuple[str, ...], timeout: float = 120.0) -> Iterator[_Alone | None]:
    """While the block runs in this thread, every other thread waits, before importing a module under ``prefixes``
    that is not imported yet, until the block ends (each wait at most ``timeout`` seconds, then it imports anyway
    and a warning says so). The wait comes before Python takes any import lock, so the two threads never hold one
    each. Not held: the threads this one starts meanwhile (``threading.Thread.start``; a compile pool's), and the
    ones they start: it may be waiting for them. One such block at a time: inside another thread's, a second yields
    None and holds no one. A child forked meanwhile holds no one either (the importing thread does not exist
    there). Put back at the block's end: ``builtins.__import__``, ``importlib.import_module`` (torch's lazy
    submodules are imported through it) and ``threading.Thread.start``."""
    global _alone
    with _lock:
        if _alone is not None:
            alone = None
        else:
            alone = _alone = _Alone(prefixes, timeout)
            builtins.__import__ = _gated_import
            importlib.import_module = _gated_import_module  # type: ignore[assignment]
            threading.Thread.start = _gated_start  # type: ignore[method-assign]
    try:
        yield alone
    finally:
        if alone is not None:
            with _lock:
                alone.done.set()
                _alone = None
                # put back only what is still ours: a wrapper installed over ours keeps calling ours (inert now)
                if builtins.__import__ is _gated_import:
                    builtins.__import__ = _original_import
                if importlib.import_module is _gated_import_module:
                    importlib.import_module = _original_import_module
                if threading.Thread.start is _gated_start:
                    threading.Thread.start = _original_start  # type: ignore[method-assign]


def _forked_child() -> None:
    global _alone
    _alone = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked_child)
