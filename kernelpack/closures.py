"""Functions by reference: a mask_mod or score_mod named by ``module:qualname`` plus the values it closes over, so
that the builder can make the very same function again in another process (``kernelpack record``).

A reference is JSON::

    {"function": "transformers.masking_utils:and_masks.<locals>.and_mask",
     "closure": {"mask_functions": {"tuple": [
         {"function": "transformers.masking_utils:sliding_window_overlay.<locals>.inner_mask",
          "closure": {"sliding_window": 1024}},
         {"function": "transformers.masking_utils:causal_mask_function"}]}}}

:func:`rebuild` imports the module, finds the code object (a nested function's code is a constant of its enclosing
function's code: the very object the job's closure runs) and makes a function of it with those closure values. The
rebuilt function has the job's code object and closure values, so it has the job's mask key
(:func:`kernelpack.signature.mask_key`), its graph and Dynamo's guards on it pass.

Values a reference holds: int, float, bool, str, None (``{"none": true}``: TOML has no null), a torch dtype
(``{"dtype": "bfloat16"}``), a tuple (``{"tuple": [...]}``), a list, and functions (references). A tensor is not
one: its values are data, not code; a mask over a tensor needs a factory (:func:`describe` raises
:class:`NotRebuildable` with a template). Nothing here imports torch at module level.
"""

from __future__ import annotations

import importlib
import inspect
import json
import types
from collections.abc import Callable
from typing import Any

from .errors import KernelpackError

_DEPTH = 6


class NotRebuildable(KernelpackError):
    """A function that cannot be named by reference: why, and what to write instead."""


def describe(fn: Any, kind: str = "mask") -> dict[str, Any]:
    """The reference of ``fn``; raises :class:`NotRebuildable` when there is none, or when rebuilding it would not
    give the same function (checked: same code object, same closure values)."""
    from .signature import mask_key

    ref = _describe(fn, kind, 0)
    try:
        try:
            rebuilt = rebuild(ref)
        except _Ambiguous:  # two nested functions of one name (if/else, two lambdas): the line tells them apart
            ref["line"] = fn.__code__.co_firstlineno
            rebuilt = rebuild(ref)
    except KernelpackError as e:  # a decorated factory, two functions of one name, ...: say what to write instead
        raise NotRebuildable(
            f"{_name(fn)} cannot be made again from {ref['function']}: {e.message}", hint=_factory_hint(kind, fn)
        ) from None
    if not same_function(fn, rebuilt) or mask_key(rebuilt) != mask_key(fn):
        raise NotRebuildable(
            f"{_name(fn)}: rebuilt from {ref['function']} it is not the same function",
            hint=_factory_hint(kind, fn),
        )
    return ref


def closure_json(ref: dict[str, Any]) -> str:
    """A reference's ``closure`` and ``defaults`` as canonical JSON (what a recipe config stores)."""
    return json.dumps({k: v for k, v in ref.items() if k != "function"}, sort_keys=True, separators=(",", ":"))


def label(ref: dict[str, Any]) -> str:
    """A short name for what a reference makes: ``and_mask(mask_functions=(inner_mask(sliding_window=64),
    causal_mask_function))``."""
    name = str(ref.get("function", "?")).rpartition(".")[2].rpartition(":")[2]
    args = [f"{k}={_label_value(v)}" for k, v in sorted(ref.get("closure", {}).items())]
    return f"{name}({', '.join(args)})" if args else name


def _label_value(v: Any) -> str:
    if isinstance(v, dict):
        if v.get("none") is True:
            return "None"
        if "tuple" in v:
            return "(" + ", ".join(map(_label_value, v["tuple"])) + ")"
        if "dtype" in v:
            return str(v["dtype"])
        return label(v)
    if isinstance(v, list):
        return "[" + ", ".join(map(_label_value, v)) + "]"
    return repr(v)


def rebuild(ref: dict[str, Any]) -> Callable[..., Any]:
    """The function a reference names. Raises :class:`KernelpackError` naming the reference when it cannot be
    made here (the module is not importable, the function is gone, a closure variable is missing)."""
    return _rebuild(ref, 0)  # type: ignore[no-any-return]


class _Ambiguous(KernelpackError):
    def __init__(self, message: str) -> None:
        super().__init__(message, hint="record again, or write a factory")


def same_function(a: Any, b: Any, depth: int = 0) -> bool:
    """Whether ``b`` is ``a`` made again: the same code object, defaults and closure values (functions among them
    compared the same way)."""
    if a is b:
        return True
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if code_a is None or code_a is not code_b or depth > _DEPTH:
        return False
    cells_a = [_cell(c) for c in (a.__closure__ or ())]
    cells_b = [_cell(c) for c in (b.__closure__ or ())]
    return (
        _same_value(a.__defaults__, b.__defaults__, depth)
        and _same_value(a.__kwdefaults__, b.__kwdefaults__, depth)
        and _same_value(cells_a, cells_b, depth)
    )


def _same_value(a: Any, b: Any, depth: int) -> bool:
    if hasattr(a, "__code__") or hasattr(b, "__code__"):
        return same_function(a, b, depth + 1)
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (
            type(a) is type(b) and len(a) == len(b) and all(_same_value(x, y, depth) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, dict) or isinstance(b, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same_value(a[k], b[k], depth) for k in a)
    return type(a) is type(b) and a == b


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


# ------------------------------------------------------------------------------------------------ describe


def _describe(fn: Any, kind: str, depth: int) -> dict[str, Any]:
    if depth > _DEPTH:
        raise NotRebuildable(f"{_name(fn)}: functions nested deeper than {_DEPTH}", hint=_factory_hint(kind, fn))
    if isinstance(fn, types.MethodType):
        raise NotRebuildable(
            f"{_name(fn)} is a bound method (of {type(fn.__self__).__name__})", hint=_factory_hint(kind, fn)
        )
    if not isinstance(fn, types.FunctionType):
        raise NotRebuildable(f"{kind} {fn!r} is a {type(fn).__name__}, not a function", hint=_factory_hint(kind, fn))
    closure = {}  # first: a tensor needs a factory wherever the function is defined
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        closure[name] = _value(_cell(cell), fn, name, kind, depth)
    module = fn.__module__
    if module in (None, "__main__", "__mp_main__"):
        raise NotRebuildable(
            f"{kind} {fn.__qualname__} is defined in the script that was run (__main__): the builder cannot import it",
            hint=f"move {fn.__qualname__} into a module the builder can import (the script then imports it), or "
            + _factory_hint(kind, fn),
        )
    try:
        defining = importlib.import_module(module)
    except Exception as e:
        raise NotRebuildable(f"{_name(fn)}: its module does not import: {e}", hint=_factory_hint(kind, fn)) from e
    if fn.__globals__ is not vars(defining):
        raise NotRebuildable(f"{_name(fn)} was not made by its module's code (exec?)", hint=_factory_hint(kind, fn))
    # where the code is (co_qualname, 3.11+: a functools.wraps copy does not change it), and the name the job's
    # function carries (it enters the mask key) when that differs
    location = getattr(fn.__code__, "co_qualname", fn.__qualname__)
    ref: dict[str, Any] = {"function": f"{module}:{location}"}
    if fn.__qualname__ != location:
        ref["qualname"] = fn.__qualname__
    if closure:
        ref["closure"] = closure
    if fn.__defaults__:
        ref["defaults"] = [_value(v, fn, "a default", kind, depth) for v in fn.__defaults__]
    if fn.__kwdefaults__:
        ref["kwdefaults"] = {
            k: _value(v, fn, f"default {k}", kind, depth) for k, v in sorted(fn.__kwdefaults__.items())
        }
    return ref


def _value(v: Any, fn: Any, name: str, kind: str, depth: int) -> Any:
    """A closure (or default) value ``name`` of ``fn`` as a reference value."""
    if v is None:
        return {"none": True}
    if isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, types.FunctionType):
        return _describe(v, kind, depth + 1)
    if isinstance(v, tuple):
        return {"tuple": [_value(x, fn, name, kind, depth + 1) for x in v]}
    if isinstance(v, list):
        return [_value(x, fn, name, kind, depth + 1) for x in v]
    kind_of = type(v).__module__ + "." + type(v).__qualname__
    if kind_of == "torch.dtype":
        return {"dtype": str(v).removeprefix("torch.")}
    where = f"{_name(fn)} closes over {name}"
    if kind_of in ("torch.Tensor", "torch.nn.parameter.Parameter"):
        shape = "x".join(map(str, v.shape)) or "0-d"
        raise NotRebuildable(
            f"{where}, a tensor ({shape} {str(v.dtype).removeprefix('torch.')}): its values are data, not code",
            hint=_factory_hint(kind, fn, tensor=(name, v.shape, v.dtype)),
        )
    raise NotRebuildable(f"{where}, a {type(v).__name__}", hint=_factory_hint(kind, fn))


def _factory_hint(kind: str, fn: Any = None, tensor: tuple[str, Any, Any] | None = None) -> str:
    """The factory the user writes instead, as a template for ``fn``. The factory must return the job's very
    function (same code, same qualname: both enter the mask key), so it calls the code that makes it."""
    qualname = str(getattr(fn, "__qualname__", "") or "")
    module = getattr(fn, "__module__", None)
    outer = qualname.split(".<locals>.")[0] if ".<locals>." in qualname else None
    short = str(outer or getattr(fn, "__name__", None) or kind).replace(".", "_")
    short = short if short.isidentifier() else kind
    option = f"--{'mask' if kind == 'mask' else 'score'}-factory"
    example = ""
    if tensor is not None:
        name, shape, dtype = tensor
        example = (
            f"\n        # example values: only the shape and dtype enter the graph; derive the shape from config "
            f"(config.q_len, config.kv_len, config.batch, ...)\n        {name} = torch.zeros({tuple(shape)}, "
            f"dtype={dtype}, device=config.device)"
        )
    if outer is not None and module not in (None, "__main__", "__mp_main__"):
        body = f"    from {module} import {outer.split('.')[0]}  # what makes your {kind}, as your job calls it\n\n"
        body += f"    def make_{short}(config):{example}\n        return {outer}(...)  # as your job calls it\n"
    else:
        moved = (
            f" (first move {qualname or 'it'} out of the script you run into a module)" if module == "__main__" else ""
        )
        body = f"    def make_{short}(config):{example}\n        ...  # return your {kind} function itself{moved}\n"
    return (
        f"write a factory that kernelpack calls with each recipe point (kernelpack.recipe.Config) and that returns "
        f"your very {kind} function (the same code and name: both enter its key), in a module the builder can "
        f"import:\n\n    # my_masks.py\n    import torch\n{body}\n"
        f"then record again with {option} '{qualname or 'QUALNAME'}=my_masks:make_{short}' (or write "
        f'{"mask" if kind == "mask" else "score_mod"} = "my_masks:make_{short}" in the recipe)'
    )


# ------------------------------------------------------------------------------------------------ rebuild


def import_module(name: str, what: str) -> types.ModuleType:
    """The module a recipe names (``what`` says for what), or an error saying it must be importable here."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # ImportError, or whatever the module's own code raised while importing
        why = str(e) if isinstance(e, ImportError) else f"{type(e).__name__}: {e}"
        raise KernelpackError(
            f"{what}: cannot import module {name!r}: {why}",
            hint="the module must be importable in the builder and in every worker (pip install it or set PYTHONPATH)",
        ) from e


def _rebuild(ref: Any, depth: int) -> Any:
    if depth > _DEPTH + 1:
        raise KernelpackError("a function reference nested too deep", hint="write a factory instead")
    if not isinstance(ref, dict) or not isinstance(ref.get("function"), str):
        raise KernelpackError(f"not a function reference: {ref!r}", hint='{function = "pkg.module:qualname", ...}')
    spec = ref["function"]
    module_name, _, qualname = spec.partition(":")
    obj: Any = import_module(module_name, f"function {spec!r}")
    globals_ = vars(obj)
    parts = qualname.split(".")
    code: types.CodeType | None = None
    i = 0
    while i < len(parts):
        part = parts[i]
        if part == "<locals>":
            if i + 1 >= len(parts):
                break
            outer = code if code is not None else getattr(inspect.unwrap(obj), "__code__", None)
            if outer is None:
                raise KernelpackError(f"function {spec!r}: {'.'.join(parts[:i])} is not a function", hint="")
            found = [c for c in outer.co_consts if isinstance(c, types.CodeType) and c.co_name == parts[i + 1]]
            if len(found) > 1 and i + 2 == len(parts) and "line" in ref:  # siblings of one name: by first line
                found = [c for c in found if c.co_firstlineno == ref["line"]]
            if len(found) > 1:
                raise _Ambiguous(f"function {spec!r}: {len(found)} functions named {parts[i + 1]!r} in {outer.co_name}")
            if len(found) != 1:
                raise KernelpackError(
                    f"function {spec!r}: {len(found)} functions named {parts[i + 1]!r} in {outer.co_name}",
                    hint="the module changed since the recipe was recorded? record again, or write a factory",
                )
            code, obj = found[0], None
            i += 2
            continue
        if code is not None:  # a comprehension's code (Python < 3.12) and the like: a constant of the enclosing code
            found = [c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == part]
            if len(found) != 1:
                raise KernelpackError(f"function {spec!r}: {len(found)} {part!r} in {code.co_name}", hint="")
            code = found[0]
            i += 1
            continue
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise KernelpackError(
                f"function {spec!r}: module {module_name!r} has no {'.'.join(parts[: i + 1])}",
                hint="the module changed since the recipe was recorded? record again, or write a factory",
            ) from None
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        i += 1
    closure_values = ref.get("closure", {})
    if code is None:  # a function reachable by attributes
        if not isinstance(obj, types.FunctionType):
            raise KernelpackError(f"function {spec!r} names a {type(obj).__name__}", hint="name a function")
        code, globals_ = obj.__code__, obj.__globals__
        if not closure_values and not obj.__code__.co_freevars and "defaults" not in ref and "kwdefaults" not in ref:
            return obj
    missing = [n for n in code.co_freevars if n not in closure_values]
    extra = sorted(set(closure_values) - set(code.co_freevars))
    if missing or extra:
        raise KernelpackError(
            f"function {spec!r} closes over {list(code.co_freevars)}; the reference gives {sorted(closure_values)}",
            hint="the module changed since the recipe was recorded? record again",
        )
    cells = tuple(types.CellType(_rebuild_value(closure_values[n], depth)) for n in code.co_freevars)
    defaults = ref.get("defaults")
    fn = types.FunctionType(
        code,
        globals_,
        code.co_name,
        tuple(_rebuild_value(v, depth) for v in defaults) if defaults else None,
        cells or None,
    )
    fn.__qualname__ = ref.get("qualname", qualname)
    if ref.get("kwdefaults"):
        fn.__kwdefaults__ = {k: _rebuild_value(v, depth) for k, v in ref["kwdefaults"].items()}
    return fn


def _rebuild_value(v: Any, depth: int) -> Any:
    if isinstance(v, dict):
        if v.get("none") is True and len(v) == 1:
            return None
        if "tuple" in v and len(v) == 1:
            return tuple(_rebuild_value(x, depth + 1) for x in v["tuple"])
        if "dtype" in v and len(v) == 1:
            import torch

            dtype = getattr(torch, str(v["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise KernelpackError(f"unknown dtype {v['dtype']!r} in a function reference", hint="e.g. bfloat16")
            return dtype
        return _rebuild(v, depth + 1)
    if isinstance(v, list):
        return [_rebuild_value(x, depth + 1) for x in v]
    return v
