"""What a mask_mod or score_mod is: its code and every value it closes over, read by one walker.

Five questions were answered by five walkers over a function's code and closure (its key, whether a rebuilt function
is the job's, whether two functions run the same code, what its graph recording depends on, which globals it reads),
with three depth limits between them; a fix in one was missed in the others. :func:`tree` is now the one place that
reads ``__code__``, ``__closure__``, ``__defaults__`` and ``__kwdefaults__``, with one depth limit, and every answer is
a fold over its :class:`Node` s. PyTorch does the same for the functions it saves (its Dynamo package's
``FunctionPicklerBase``).

A node has a **path** in the user's words (``S``, ``mask_functions[1].sliding_window``, a default by its parameter's
name) and a **source** in Dynamo's (``.__closure__[3].cell_contents``, appended to where Dynamo reaches the function:
``L['block_mask'].mask_mod``), so that what Dynamo's guards say of a source can be said of a path
(:func:`kernelpack._torch.dynamo.free_sources`).

A key (:func:`key`) is a digest of the code and the values; a value whose path is in ``free`` enters by its type only
(a closure int a dynamic graph keeps symbolic: DFlash's context length), a tensor's dimension ``path.shape[i]`` in
``free`` by ``?`` (a dimension the graph keeps symbolic). A tensor always enters by dtype, shape and device type, never
by its values: they are data the graph reads at run time.

Nothing here imports torch at module level.
"""

from __future__ import annotations

import hashlib
import inspect
import re
import types
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

# how deep functions and sequences nest before the walker stops (one limit for every question)
MAX_DEPTH = 6

Kind = Literal["function", "tuple", "list", "scalar", "none", "dtype", "tensor", "empty", "other", "deep"]


@dataclass(frozen=True, slots=True)
class Node:
    """One value in a function's tree: the function itself, a sequence, or a leaf."""

    path: str  # "" for the root; "S", "mask_functions[1].window", "w" (a default, by its parameter's name)
    source: str  # below the root, as Dynamo names it: ".__closure__[3].cell_contents"
    kind: Kind
    value: Any
    # a function's closure cells, defaults and keyword defaults, as (label, node): the label is the name (a cell's
    # free variable, a default's parameter) and, for describe's sake, which of the three it is
    children: tuple[tuple[str, str, Node], ...] = ()  # (part, label, node); part: "closure", "defaults", "kwdefaults"

    def walk(self) -> Iterator[Node]:
        """This node, then every node below it, depth first in a fixed order."""
        yield self
        for _, _, child in self.children:
            yield from child.walk()

    @property
    def code(self) -> types.CodeType | None:
        return getattr(self.value, "__code__", None) if self.kind == "function" else None


def tree(fn: Any) -> Node:
    """The tree of ``fn`` (a function, or any value: then a single leaf)."""
    return _node(fn, "", "", 0)


def _join(path: str, label: str) -> str:
    return f"{path}{label}" if label.startswith("[") else (f"{path}.{label}" if path else label)


def _node(value: Any, path: str, source: str, depth: int) -> Node:
    if isinstance(value, _Empty):
        return Node(path, source, "empty", None)
    if value is None:
        return Node(path, source, "none", None)
    if isinstance(value, (bool, int, float, str)):
        return Node(path, source, "scalar", value)
    kind_of = type(value).__module__ + "." + type(value).__qualname__
    if kind_of == "torch.dtype":
        return Node(path, source, "dtype", value)
    if is_tensor(value):
        return Node(path, source, "tensor", value)
    if isinstance(value, (types.FunctionType, tuple, list)) and depth >= MAX_DEPTH:
        return Node(path, source, "deep", value)
    if isinstance(value, types.FunctionType):
        return Node(path, source, "function", value, _function_children(value, path, source, depth))
    if isinstance(value, (tuple, list)):
        items = tuple(
            ("items", f"[{i}]", _node(v, _join(path, f"[{i}]"), f"{source}[{i}]", depth + 1))
            for i, v in enumerate(value)
        )
        return Node(path, source, "tuple" if isinstance(value, tuple) else "list", value, items)
    return Node(path, source, "other", value)


def _function_children(fn: types.FunctionType, path: str, source: str, depth: int) -> tuple[tuple[str, str, Node], ...]:
    code = fn.__code__
    out: list[tuple[str, str, Node]] = []
    for i, (name, cell) in enumerate(zip(code.co_freevars, fn.__closure__ or (), strict=True)):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a variable assigned after the function was made, never)
            value = _Empty()
        out.append(
            ("closure", name, _node(value, _join(path, name), f"{source}.__closure__[{i}].cell_contents", depth + 1))
        )
    defaults = fn.__defaults__ or ()
    # a default is named by its parameter: the last len(defaults) positional parameters
    names = code.co_varnames[code.co_argcount - len(defaults) : code.co_argcount]
    for i, (name, value) in enumerate(zip(names, defaults, strict=True)):
        out.append(("defaults", name, _node(value, _join(path, name), f"{source}.__defaults__[{i}]", depth + 1)))
    for name, value in sorted((fn.__kwdefaults__ or {}).items()):
        out.append(
            ("kwdefaults", name, _node(value, _join(path, name), f"{source}.__kwdefaults__[{name!r}]", depth + 1))
        )
    return tuple(out)


# the kinds of node that are values, not structure
_LEAVES = frozenset(("scalar", "none", "dtype", "tensor", "empty"))


class _Empty:
    """An empty closure cell."""


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor, without importing torch."""
    import sys

    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported
    return torch is not None and isinstance(value, torch.Tensor)


# ------------------------------------------------------------------------------------------------ answers


def key(fn: Any, free: Collection[str] = ()) -> str:
    """A digest of what ``fn`` computes: every function's code (bytecode, names, constants; not its file or line)
    and every value it closes over, a value whose path is in ``free`` by type, a tensor by dtype, shape (its
    dimension ``path.shape[i]`` in ``free`` as ``?``) and device type. Equal across processes for the same code
    and values."""
    return each_key(fn, (free,))[0]


def each_key(fn: Any, frees: Sequence[Collection[str]]) -> list[str]:
    """:func:`key` of ``fn`` for each of ``frees``, from one walk (a served call keys its mask by every value and by
    each set a dynamic config keeps free: one walk of a mask rebuilt every step, not one per set)."""
    digests = [hashlib.sha256() for _ in frees]
    # the paths some set names, a tensor's dimensions by the tensor's path: any other node is encoded once for all
    named = {p for free in frees for f in free for p in (f, _SHAPE.sub("", f))}
    for node in tree(fn).walk():
        head = f"|{node.path}:{node.kind}:".encode()
        shared = None if node.path in named else head + _encoding(node, ())
        for h, free in zip(digests, frees, strict=True):
            h.update(shared if shared is not None else head + _encoding(node, free))
    return [h.hexdigest() for h in digests]


_SHAPE = re.compile(r"\.shape(\[\d+\])?$")  # "anchors.shape[1]", "anchors.shape": the tensor "anchors"'s


def _encoding(node: Node, free: Collection[str]) -> bytes:
    if node.kind == "function":
        assert node.code is not None
        return code_digest(node.code)
    if node.kind in ("tuple", "list"):
        return str(len(node.value)).encode()
    if node.kind == "tensor":
        return tensor_spec(node.value, node.path, free).encode()
    if node.kind in ("scalar", "dtype", "none"):
        return (type(node.value).__name__ if node.path in free else repr(node.value)).encode()
    return type(node.value).__name__.encode()  # an object, an empty cell, nesting too deep: by type


def tensor_spec(t: Any, path: str = "", free: Collection[str] = ()) -> str:
    """A tensor as a key sees it: ``tensor(int64,[1,?],cpu)``."""
    every = f"{path}.shape" in free  # a tensor the graph does not read: no dimension of it selects the graph
    dims = ["?" if every or f"{path}.shape[{i}]" in free else str(int(n)) for i, n in enumerate(t.shape)]
    return f"tensor({str(t.dtype).removeprefix('torch.')},[{','.join(dims)}],{t.device.type})"


def code_digest(code: types.CodeType) -> bytes:
    """A code object's bytecode, names and constants, nested code objects by digest (their repr holds a memory
    address, different in every process). Made once per code object: a mask rebuilt every step runs one."""
    known = _code_digests.get(id(code))
    if known is not None and known[0] is code:
        return known[1]
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_names).encode())  # `torch.minimum` and `torch.maximum` differ only here
    for const in code.co_consts:
        h.update(code_digest(const) if isinstance(const, types.CodeType) else repr(const).encode())
    digest = h.digest()
    if len(_code_digests) >= _CODE_DIGESTS_MAX:
        _code_digests.clear()
    _code_digests[id(code)] = (code, digest)  # the code object kept: its id stays its own
    return digest


_code_digests: dict[int, tuple[types.CodeType, bytes]] = {}
_CODE_DIGESTS_MAX = 4096


def same(a: Any, b: Any, *, values: bool = True) -> bool:
    """Whether ``b`` runs the code of ``a``: every function in their trees the same code object, in the same
    shape; with ``values``, every value equal too (a tensor by dtype, shape and device type: its values are data).
    ``values=False`` is what Dynamo's identity guard on a mask_mod's code object checks; the values are its other
    guards'."""
    if a is b:
        return True
    if not values:
        return code_shape(a) == code_shape(b)
    nodes_a, nodes_b = list(tree(a).walk()), list(tree(b).walk())
    if len(nodes_a) != len(nodes_b):
        return False
    for x, y in zip(nodes_a, nodes_b, strict=True):
        if x.path != y.path:
            return False
        if x.kind != y.kind:
            # a leaf of another kind (None where the other has an int) is another value of the same code
            if values or x.kind not in _LEAVES or y.kind not in _LEAVES:
                return False
            continue
        if x.kind == "function":
            if x.code is not y.code:
                return False
        elif x.kind in ("tuple", "list"):
            if len(x.value) != len(y.value):
                return False
        elif x.kind == "tensor":
            if values and tensor_spec(x.value) != tensor_spec(y.value):
                return False
        elif x.kind in ("other", "deep"):
            # an object is compared by identity: a builtin it calls is code too
            if (values or callable(x.value)) and x.value is not y.value:
                return False
        elif values and (type(x.value) is not type(y.value) or x.value != y.value):
            return False
    return True


def code_shape(fn: Any) -> tuple[Any, ...]:
    """What :func:`same` compares with ``values=False``, as one value: equal for two functions exactly when every
    function in their trees is the same code object, in trees of the same shape, and every other callable they
    close over is the same object; a leaf (an int, None, a tensor) is any leaf. It names objects by ``id``: compare
    two shapes only while both functions are alive (a served call compares its mask with the warmed ones, which the
    warm-up keeps)."""
    out: list[tuple[Any, ...]] = []
    for n in tree(fn).walk():
        if n.kind in _LEAVES:
            out.append((n.path, "leaf"))
        elif n.kind == "function":
            out.append((n.path, "function", id(n.code)))
        elif n.kind in ("tuple", "list"):
            out.append((n.path, n.kind, len(n.value)))
        else:  # an object (a builtin it calls is code too), or nesting too deep: callables by identity
            out.append((n.path, n.kind, id(n.value) if callable(n.value) else None))
    return tuple(out)


def each_function(fn: Any) -> Iterator[types.FunctionType]:
    """Every function in ``fn``'s tree (itself first)."""
    return (n.value for n in tree(fn).walk() if n.kind == "function")


def global_reads(fn: Any) -> Iterator[tuple[str, Any]]:
    """(name, value) of every global that a function in ``fn``'s tree (or a function nested in its code: a lambda it
    makes) reads, as its module holds it now."""
    for f in each_function(fn):
        scope = f.__globals__
        stack = [f.__code__]
        depth = 0
        while stack and depth <= MAX_DEPTH:
            nested: list[types.CodeType] = []
            for code in stack:
                for name in code.co_names:
                    if name in scope:
                        yield name, scope[name]
                nested += [c for c in code.co_consts if isinstance(c, types.CodeType)]
            stack, depth = nested, depth + 1


def plain_value(value: Any) -> bool:
    """A global that is data, not code: not a module, class or routine."""
    return not isinstance(value, (types.ModuleType, type)) and not inspect.isroutine(value)


def recording_key(fn: Callable[..., Any], kind: str) -> tuple[Any, ...] | None:
    """What the graph recorded from running ``fn`` (:func:`kernelpack.signature.mod_graph`) depends on: its code
    objects, its values (a tensor by metadata) and the simple globals it reads. None when some part is neither
    (an object, nesting too deep): then the graph is recorded for every call."""
    if not hasattr(fn, "__code__"):
        return None
    parts: list[Any] = [kind]
    for node in tree(fn).walk():
        if node.kind == "function":
            parts.append(node.code)
            # a default (``def m(b, h, q, kv, w=w)``) is a node of its own below
        elif node.kind in ("tuple", "list"):
            parts.append((node.kind, len(node.value)))
        elif node.kind == "tensor":
            parts.append(tensor_spec(node.value))
        elif node.kind in ("scalar", "none", "dtype"):
            parts.append((type(node.value).__name__, node.value))
        elif node.kind == "empty":
            parts.append(None)
        else:
            return None
    for name, value in global_reads(fn):
        if isinstance(value, (int, float, bool, str)):
            parts.append((name, value))
        elif is_tensor(value):
            parts.append((name, tensor_spec(value)))
    return tuple(parts)


def differences(covered: Any, call: Any, free: Collection[str] = ()) -> list[tuple[str, str, str]]:
    """What differs between two functions' trees, as (path, value in ``covered``, value in ``call``): each value
    that differs when both run the same code (``window``: ``2048`` vs ``None``), else one ("code", qualname,
    qualname). A value in ``free`` differs only by type, as in :func:`key`."""
    a, b = list(tree(covered).walk()), list(tree(call).walk())
    if not same(covered, call, values=False):
        return [("code", _qualname(covered), _qualname(call))]
    out = []
    for x, y in zip(a, b, strict=True):
        if x.kind in ("function", "tuple", "list"):
            continue
        if _encoding(x, free) != _encoding(y, free) or x.kind != y.kind:
            out.append((x.path or "value", _shown(x), _shown(y)))
    return out


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _shown(node: Node) -> str:
    if node.kind == "tensor":
        return tensor_spec(node.value)
    return repr(node.value)[:80]
