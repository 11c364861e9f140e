"""Post-import hooks: run a function once a module is imported, now if it already is.

kernelpack watches torch's compilers (Dynamo's per-compile metrics, inductor's C++ builds, Triton's listener) and
raises Dynamo's recompile limit. Importing Dynamo and inductor to do that costs a job's start 1.5-3.5 s (issue 36),
and nothing can compile before they are imported: so each hook attaches the moment its module finishes importing, in
the importing thread, before any code can use it (PEP 369's post-import hooks; wrapt's ``register_post_import_hook``
works the same way). One case is not hooked: a module that another thread is importing at the moment the hook is
registered (past the finder); its compiles are still counted by torch, and report() says what it saw no record of.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
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
