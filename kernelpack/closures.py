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
(``{"dtype": "bfloat16"}``), a tuple (``{"tuple": [...]}``), a list, functions (references), and tensors by shape and
dtype (``{"tensor": {"shape": ["batch", "q_len // 16"], "dtype": "int64"}}``: a tensor is an input of the graph, its
values are data; :func:`rebuild` makes an example). An int or a size may be an expression of the call's dimensions
(``{"dim": "kv_len - q_len"}``), which :func:`rebuild` evaluates against a recipe point, and an int that varied
without following one is ``{"example": 1500, "seen": [1024, 4096]}``. The walk over a function is
:mod:`kernelpack.functions`. Nothing here imports torch at module level.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import types
from collections.abc import Callable
from typing import Any

from . import functions
from .errors import KernelpackError, NotRebuildable

# the call's dimensions a tensor's shape or an int may follow (``{"dim": "kv_len - q_len"}``), by Config field name
DIMS = ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim")


def describe(fn: Any, kind: str = "mask") -> dict[str, Any]:
    """The reference of ``fn``; raises :class:`NotRebuildable` when there is none, or when rebuilding it would not
    give the same function (checked: same code object, same closure values)."""
    from .signature import mask_key

    ref = _describe(fn, kind)
    # example tensors are made where the job's are, so that the key (which holds the device type) compares
    device = next((n.value.device for n in functions.tree(fn).walk() if n.kind == "tensor"), None)
    try:
        try:
            rebuilt = rebuild(ref, device=device)
        except _Ambiguous:  # two nested functions of one name (if/else, two lambdas): the line tells them apart
            ref["line"] = fn.__code__.co_firstlineno
            rebuilt = rebuild(ref, device=device)
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
        if "tensor" in v:
            spec = v["tensor"]
            return f"tensor[{', '.join(map(str, spec.get('shape', ())))}]:{spec.get('dtype')}"
        if "dim" in v:
            return str(v["dim"])
        if "example" in v:
            return "int"
        return label(v)
    if isinstance(v, list):
        return "[" + ", ".join(map(_label_value, v)) + "]"
    return repr(v)


def rebuild(ref: dict[str, Any], dims: Any = None, device: Any = None) -> Callable[..., Any]:
    """The function a reference names. Raises :class:`KernelpackError` naming the reference when it cannot be
    made here (the module is not importable, the function is gone, a closure variable is missing).

    ``dims``: what the reference's dimension expressions (``{"dim": "kv_len - q_len"}``, a tensor shape's
    ``"q_len // 16"``) are evaluated against: anything with the attributes of :data:`DIMS` (a recipe Config); a
    reference that has expressions needs it. ``device``: where example tensors are made (default: the CPU).

    A tensor the function closes over is made as an **example**: its recorded shape and dtype, zeros (ones for a
    bool tensor). Its values are read at run time, never compiled in, so they need only keep the function's
    indexing in bounds: an index of 0 is in bounds of any dimension that is not empty, and a bool tensor of ones
    (keep everything) leaves no query row fully masked that the job's mask would not."""
    return _rebuild(ref, 0, _Values(dims, device))  # type: ignore[no-any-return]


class _Values:
    """How a reference's values are made: its dimension expressions against ``dims``, its tensors on ``device``."""

    def __init__(self, dims: Any, device: Any) -> None:
        self.dims = dims
        self.device = device

    def dim(self, expr: Any) -> int:
        if isinstance(expr, int) and not isinstance(expr, bool):
            return expr
        if self.dims is None:
            raise KernelpackError(
                f"the dimension {expr!r} needs the call's dimensions", hint="rebuild(ref, dims=config)"
            )
        return evaluate(expr, {d: int(getattr(self.dims, d)) for d in DIMS})

    def tensor(self, spec: Any) -> Any:
        import torch

        if not isinstance(spec, dict) or not isinstance(spec.get("shape"), list):
            raise KernelpackError(
                f"a tensor reference needs a shape list and a dtype, got {spec!r}",
                hint='{tensor = {shape = ["batch", "q_len // 16"], dtype = "int64"}}',
            )
        dtype = _dtype(spec.get("dtype"))
        shape = [self.dim(d) for d in spec["shape"]]
        if any(n < 0 for n in shape):
            raise KernelpackError(f"tensor shape {spec['shape']} is {shape} here: a negative size", hint="")
        fill = torch.ones if dtype == torch.bool else torch.zeros
        return fill(shape, dtype=dtype, device=self.device or "cpu")


_EXPR = re.compile(r"\s*([a-z_]+|\d+)\s*(?:(//|\*|-|\+)\s*([a-z_]+|\d+)\s*)?")


def evaluate(expr: Any, dims: dict[str, int]) -> int:
    """A dimension expression: ``q_len``, ``q_len // 16``, ``kv_len - q_len``, ``2 * batch`` (one operator at
    most, on dimension names and integers)."""
    match = _EXPR.fullmatch(expr) if isinstance(expr, str) else None
    names = [g for g in (match.groups() if match else ()) if g and g.isidentifier()]
    if match is None or any(n not in dims for n in names):
        raise KernelpackError(
            f"dimension expression {expr!r} is not one kernelpack reads",
            hint=f"a dimension ({', '.join(DIMS)}) or an integer, or two joined by one of // * - +",
        )
    a, op, b = match.groups()

    def term(t: str) -> int:
        return dims[t] if t.isidentifier() else int(t)

    if op is None:
        return term(a)
    x, y = term(a), term(b)
    if op == "//" and y == 0:
        raise KernelpackError(f"dimension expression {expr!r} divides by zero", hint="")
    return {"//": lambda: x // y, "*": lambda: x * y, "-": lambda: x - y, "+": lambda: x + y}[op]()


def dim_expressions(value: int, dims: dict[str, int]) -> list[str]:
    """The expressions of :func:`evaluate`'s kind that give ``value`` at these dimensions, simplest first: what a
    tensor's size or an int a mask closes over may follow (``q_len // 16``: DFlash's anchor count)."""
    # the lengths first: a tensor a mask closes over is indexed by positions (q_idx, kv_idx), not by heads
    out = [d for d in ("batch", "q_len", "kv_len") if dims[d] == value]
    for d in ("q_len", "kv_len"):
        for k in (2, 4, 8, 16, 32, 64, 128, 256):
            if dims[d] % k == 0 and dims[d] // k == value:
                out.append(f"{d} // {k}")
    if dims["kv_len"] - dims["q_len"] == value:
        out.append("kv_len - q_len")
    if dims["q_len"] - dims["kv_len"] == value:
        out.append("q_len - kv_len")
    out += [d for d in ("q_heads", "kv_heads", "head_dim") if dims[d] == value]
    return out


def varying(ref: dict[str, Any]) -> dict[str, str]:
    """The values of a reference that are not one constant, by path (as :mod:`kernelpack.functions` names them):
    ``{"S": "kv_len - q_len", "N": "example", "anchors.shape[1]": "q_len // 16"}``: an int or a tensor size that
    follows the call's dimensions (its expression), or an int that varied without following one ("example")."""
    out: dict[str, str] = {}

    def visit(v: Any, path: str) -> None:
        if isinstance(v, dict):
            if "dim" in v and len(v) == 1:
                out[path] = str(v["dim"])
            elif "example" in v:
                out[path] = "example"
            elif "tensor" in v and len(v) == 1:
                for i, d in enumerate(v["tensor"].get("shape", ()) if isinstance(v["tensor"], dict) else ()):
                    if isinstance(d, str):
                        out[f"{path}.shape[{i}]"] = d
            elif "tuple" in v and len(v) == 1:
                for i, x in enumerate(v["tuple"]):
                    visit(x, f"{path}[{i}]")
            elif "function" in v:
                for name, x in (v.get("closure") or {}).items():
                    visit(x, f"{path}.{name}" if path else name)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                visit(x, f"{path}[{i}]")

    visit(ref, "")
    return out


def modules(ref: dict[str, Any]) -> set[str]:
    """The modules a reference's functions live in, nested ones too: what :func:`rebuild` imports."""
    found: set[str] = set()

    def visit(v: Any) -> None:
        if isinstance(v, dict):
            spec = v.get("function")
            if isinstance(spec, str) and ":" in spec:
                found.add(spec.partition(":")[0])
            for x in v.values():
                visit(x)
        elif isinstance(v, list | tuple):
            for x in v:
                visit(x)

    visit(ref)
    return found


def _dtype(name: Any) -> Any:
    import torch

    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise KernelpackError(f"unknown dtype {name!r} in a function reference", hint="e.g. bfloat16, int64, bool")
    return dtype


class _Ambiguous(KernelpackError):
    def __init__(self, message: str) -> None:
        super().__init__(message, hint="record again, or write a factory")


def same_function(a: Any, b: Any) -> bool:
    """Whether ``b`` is ``a`` made again: the same code objects, defaults and closure values (a tensor by dtype and
    shape: :func:`kernelpack.functions.same`)."""
    return functions.same(a, b, values=True)


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


# ------------------------------------------------------------------------------------------------ describe


def _describe(fn: Any, kind: str, depth: int = 0) -> dict[str, Any]:
    if isinstance(fn, types.MethodType):
        raise NotRebuildable(
            f"{_name(fn)} is a bound method (of {type(fn.__self__).__name__})", hint=_factory_hint(kind, fn)
        )
    root = functions.tree(fn)
    if root.kind != "function":
        raise NotRebuildable(f"{kind} {fn!r} is a {type(fn).__name__}, not a function", hint=_factory_hint(kind, fn))
    return _function_ref(root, fn, kind)


def _function_ref(node: functions.Node, root: Any, kind: str) -> dict[str, Any]:
    fn = node.value
    parts: dict[str, Any] = {"closure": {}, "defaults": [], "kwdefaults": {}}
    for part, label, child in node.children:  # values first: an unnameable one is the problem wherever fn lives
        value = _value(child, fn, root, kind)
        if part == "defaults":
            parts["defaults"].append(value)
        else:
            parts[part][label] = value
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
    ref.update({k: v for k, v in parts.items() if v})
    return ref


def _value(node: functions.Node, fn: Any, root: Any, kind: str) -> Any:
    """A closure (or default) value of ``fn`` as a reference value."""
    if node.kind in ("none", "empty"):
        return {"none": True}
    if node.kind == "scalar":
        return node.value
    if node.kind == "function":
        return _function_ref(node, root, kind)
    if node.kind == "tuple":
        return {"tuple": [_value(c, fn, root, kind) for _, _, c in node.children]}
    if node.kind == "list":
        return [_value(c, fn, root, kind) for _, _, c in node.children]
    if node.kind == "dtype":
        return {"dtype": str(node.value).removeprefix("torch.")}
    if node.kind == "tensor" and kind != "mask":  # a score_mod's tensor may require grad: it is not an example
        shape = "x".join(map(str, node.value.shape)) or "0-d"
        raise NotRebuildable(
            f"{_name(fn)} closes over {node.path}, a tensor ({shape} {_dtype_name(node.value.dtype)})",
            hint=_factory_hint(kind, root),
        )
    if node.kind == "tensor":
        # an input of the graph, not code: its shape and dtype select the graph, its values are read at run time
        return {"tensor": {"shape": [int(n) for n in node.value.shape], "dtype": _dtype_name(node.value.dtype)}}
    where = f"{_name(fn)} closes over {node.path or 'a value'}"
    if node.kind == "deep":
        raise NotRebuildable(
            f"{where}: functions nested deeper than {functions.MAX_DEPTH}", hint=_factory_hint(kind, root)
        )
    raise NotRebuildable(f"{where}, a {type(node.value).__name__}", hint=_factory_hint(kind, root))


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _factory_hint(kind: str, fn: Any = None) -> str:
    """The factory the user writes instead, as a template for ``fn``. The factory must return the job's very
    function (same code, same qualname: both enter the mask key), so it calls the code that makes it."""
    qualname = str(getattr(fn, "__qualname__", "") or "")
    module = getattr(fn, "__module__", None)
    outer = qualname.split(".<locals>.")[0] if ".<locals>." in qualname else None
    short = str(outer or getattr(fn, "__name__", None) or kind).replace(".", "_")
    short = short if short.isidentifier() else kind
    option = f"--{'mask' if kind == 'mask' else 'score'}-factory"
    if outer is not None and module not in (None, "__main__", "__mp_main__"):
        body = f"    from {module} import {outer.split('.')[0]}  # what makes your {kind}, as your job calls it\n\n"
        body += f"    def make_{short}(config):\n        return {outer}(...)  # as your job calls it\n"
    else:
        moved = (
            f" (first move {qualname or 'it'} out of the script you run into a module)" if module == "__main__" else ""
        )
        body = f"    def make_{short}(config):\n        ...  # return your {kind} function itself{moved}\n"
    return (
        f"write a factory that kernelpack calls with each recipe point (kernelpack.config.Config) and that returns "
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


def _rebuild(ref: Any, depth: int, values: _Values) -> Any:
    if depth > functions.MAX_DEPTH + 1:
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
    cells = tuple(types.CellType(_rebuild_value(closure_values[n], depth, values)) for n in code.co_freevars)
    defaults = ref.get("defaults")
    fn = types.FunctionType(
        code,
        globals_,
        code.co_name,
        tuple(_rebuild_value(v, depth, values) for v in defaults) if defaults else None,
        cells or None,
    )
    fn.__qualname__ = ref.get("qualname", qualname)
    if ref.get("kwdefaults"):
        fn.__kwdefaults__ = {k: _rebuild_value(v, depth, values) for k, v in ref["kwdefaults"].items()}
    return fn


def _rebuild_value(v: Any, depth: int, values: _Values) -> Any:
    if isinstance(v, dict):
        if v.get("none") is True and len(v) == 1:
            return None
        if "tuple" in v and len(v) == 1:
            return tuple(_rebuild_value(x, depth + 1, values) for x in v["tuple"])
        if "dtype" in v and len(v) == 1:
            return _dtype(v["dtype"])
        if "tensor" in v and len(v) == 1:
            return values.tensor(v["tensor"])
        if "dim" in v and len(v) == 1:  # an int that follows the call's dimensions (DFlash's S = kv_len - q_len)
            return values.dim(v["dim"])
        if "example" in v:  # an int that varied in the job without following a dimension: one value of it
            return v["example"]
        return _rebuild(v, depth + 1, values)
    if isinstance(v, list):
        return [_rebuild_value(x, depth + 1, values) for x in v]
    return v
