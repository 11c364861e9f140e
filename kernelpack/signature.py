"""The call signature: everything about a flex_attention call that selects a compiled graph.

It is the unit of coverage (an artifact covers a set of signatures), of first-call serialization (the runtime runs
the first call of each signature alone) and of every explanation (a miss is told by :meth:`CallSignature.differences`
against the nearest covered signature).

:class:`CallParams` holds the fields a recipe point and a call share; :class:`config.Config` (a recipe point) adds how
the mask is declared, :class:`CallSignature` (a call) adds what the mask computes and the device index. Adding a field
that selects a graph is one field here, with a default: equality, hashing, ``describe()``, ``differences()``,
the manifest's JSON and the recipe point's id pick it up from the dataclass fields.

Nothing here imports torch at module level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import re
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from . import functions

Device = Literal["cuda", "cpu"]
Dtype = Literal["bfloat16", "float16", "float32"]
Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
# The forward-only graph (no input requires grad, or grad mode is off: inference, and the forward of *reentrant*
# gradient checkpointing, which runs under no_grad) or the training graph (forward + backward).
Graph = Literal["fwd", "fwd+bwd"]
# How q, k, v lie in memory: "bhsd" contiguous [B, H, S, D]; "bshd" a contiguous [B, S, H, D] seen as [B, H, S, D]
# through .transpose(1, 2), what every HF model passes (proj(x).view(B, S, H, D).transpose(1, 2)). Inductor compiles
# static strides into the graph and Dynamo guards on them, so each is its own graph. Either order may lie in wider
# rows, a slice of a fused projection's output (:func:`layout_name`): "bshd(row=128)" is Phi-3's v, a [B, S, H, D]
# slice of qkv_proj(x) ([B, S, 128]); "bshd(head=48,row=384)" GPT-NeoX's, each head's D of a 3*D chunk.
Layout = Literal["bhsd", "bshd"]
DEVICES: tuple[str, ...] = get_args(Device)
DTYPES: tuple[str, ...] = get_args(Dtype)
COMPILE_MODES: tuple[str, ...] = get_args(Mode)
GRAPHS: tuple[str, ...] = get_args(Graph)
LAYOUTS: tuple[str, ...] = get_args(Layout)
# Which auxiliary outputs a call asks for through ``return_aux=AuxRequest(...)`` (torch >= 2.9): each is an output of
# the traced graph. ``return_lse=True`` is the older spelling of "lse" and stays its own field.
RETURN_AUX: tuple[str, ...] = ("none", "lse", "max_scores", "lse+max_scores")
# The BlockMask's batch and head dimensions: broadcast (create_block_mask(m, None, None, ...)), or one block table per
# batch element and/or head. Its tensors are graph inputs, so their shapes select the graph.
MASK_DIMS: tuple[str, ...] = ("broadcast", "per-batch", "per-head", "per-batch+per-head")
# q, k, v passed as one tensor object: Dynamo turns a repeated input into one graph input, so each is its own graph.
ALIASES: tuple[str, ...] = ("none", "k=v", "q=k", "q=v", "q=k=v")
DEFAULT_BLOCK_SIZE = (128, 128)  # torch's _DEFAULT_SPARSE_BLOCK_SIZE, as (Q_BLOCK_SIZE, KV_BLOCK_SIZE)

# shown by describe() in its fixed layout; every other field is shown as name=value when it is not its default
_LAYOUT_FIELDS = frozenset(
    (
        "device",
        "device_index",
        "mask",
        "batch",
        "q_heads",
        "kv_heads",
        "q_len",
        "kv_len",
        "head_dim",
        "dtype",
    )
)


@dataclass(frozen=True, kw_only=True, slots=True)
class CallParams:
    """What a recipe point and a call share. Not validated here: a call may be anything (a float64 call is simply
    never covered); :class:`kernelpack.config.Config` validates what a recipe may ask for."""

    device: Device
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: Dtype
    kernel_options: tuple[tuple[str, Any], ...] = ()
    mode: Mode = "default"
    dynamic: bool = False
    layout: str = "bhsd"  # a Layout, or for a call anything else: "q=bshd k=bhsd v=bhsd", "strided"
    scale: float | None = None  # None: 1/sqrt(head_dim); a float is a constant of the traced graph
    enable_gqa: bool | None = None  # None: q_heads != kv_heads (torch needs it then)
    return_lse: bool = False
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE  # the BlockMask's (Q, KV) block size
    score_mod: str = "none"  # "none", "identity" (any function whose graph returns the score), or its graph's key
    return_aux: str = "none"  # one of RETURN_AUX
    mask_dims: str = "broadcast"  # one of MASK_DIMS; for a call anything else: "B=3", "per-batch+H=2"
    alias: str = "none"  # one of ALIASES

    def __post_init__(self) -> None:
        if self.enable_gqa is None:
            object.__setattr__(self, "enable_gqa", self.q_heads != self.kv_heads)
        layouts = split_layout(self.layout) if isinstance(self.layout, str) else None
        if layouts is not None:  # as layout_of writes it: "q=bshd k=bshd v=bshd" is "bshd"
            object.__setattr__(self, "layout", joined_layout(layouts))
        if isinstance(self.mask_dims, str) and self.mask_dims != "broadcast":
            # one batch element or one head: a per-batch (per-head) table has the broadcast one's shape
            dims = [d for d in self.mask_dims.split("+") if not (d == "per-batch" and self.batch == 1)]
            dims = [d for d in dims if not (d == "per-head" and self.q_heads == 1)]
            object.__setattr__(self, "mask_dims", "+".join(dims) or "broadcast")

    def _describe(self, mask: str, device: str, graphs: str) -> str:
        lens = f"seq={self.q_len}" if self.q_len == self.kv_len else f"q_len={self.q_len} kv_len={self.kv_len}"
        text = (
            f"[{device} {mask} B={self.batch} Hq={self.q_heads} Hkv={self.kv_heads} {lens} D={self.head_dim} "
            f"{self.dtype} {graphs}"
        )
        for f in dataclasses.fields(CallParams):
            value = getattr(self, f.name)
            if f.name == "enable_gqa":  # shown only when not what the head counts imply
                if value != (self.q_heads != self.kv_heads):
                    text += f" enable_gqa={value}"
            elif f.name not in _LAYOUT_FIELDS and value != f.default:
                text += f" {f.name}={dict(value) if f.name == 'kernel_options' else value}"
        return text + "]"


@dataclass(frozen=True, kw_only=True, slots=True)
class CallSignature(CallParams):
    """A call: the shared parameters, the mask by what it computes (:func:`mask_key`), and the CUDA device index
    (inductor's cache keys contain it, pytorch#170123; None on CPU)."""

    mask: str
    device_index: int | None
    graph: Graph

    def describe(self) -> str:
        device = self.device if self.device_index is None else f"{self.device}:{self.device_index}"
        return self._describe(self.mask, device, self.graph)

    def differences(self, other: CallSignature) -> list[tuple[str, Any, Any]]:
        """(field, value here, value there) for every field that differs."""
        return [
            (f.name, getattr(self, f.name), getattr(other, f.name))
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


def graph_of(query: Any, key: Any, value: Any) -> Graph:
    """The graph a call needs: the training graph when autograd will record it, else the forward-only one."""
    import torch

    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    return "fwd+bwd" if grad else "fwd"


_LAYOUT = re.compile(r"(bhsd|bshd)(?:\((?:head=([1-9][0-9]*),)?row=([1-9][0-9]*)\))?")


@dataclass(frozen=True)
class Strides:
    """One tensor's layout: its dim order (a :data:`Layout`) and, for a slice of wider rows, the stride of a head
    (``head``, bshd only) and of a row (``row``: the S stride). None: dense."""

    order: str
    head: int | None = None
    row: int | None = None

    def problem(self, h: int, d: int) -> str | None:
        """Why this layout cannot be one of ``h`` heads of ``d``, or is not written as :func:`layout_name` names
        such a tensor (the call's signature would never equal it); None when it is."""
        head = self.head or d
        if head < d:
            return f"head={head} is narrower than head_dim {d}"
        if self.head == d:
            return f"head={head} is head_dim: write {self.order}(row={self.row}), as a call's layout reads"
        width = d if self.order == "bhsd" else h * head
        if self.row is not None and self.row < width:
            return f"row={self.row} is narrower than {'head_dim' if self.order == 'bhsd' else 'heads x head'} {width}"
        if self.row == width and self.head is None:
            return f"row={self.row} is dense: write {self.order!r}, as a call's layout reads"
        return None

    def strides(self, b: int, h: int, s: int, d: int) -> tuple[int, int, int, int]:
        """The [B, H, S, D] strides of a tensor of these sizes with this layout."""
        if self.order == "bhsd":
            row = self.row or d
            return (h * s * row, s * row, row, 1)
        head = self.head or d
        row = self.row or h * head
        return (s * row, head, row, 1)


def parse_layout(name: str) -> Strides | None:
    """The :class:`Strides` one tensor's layout name says ("bshd", "bshd(row=128)", "bshd(head=48,row=384)"), None
    when it is none. A row or head no wider than dense is written as the dense name (:func:`layout_name`)."""
    m = _LAYOUT.fullmatch(name)
    if m is None or (m.group(1) == "bhsd" and m.group(2)):
        return None
    return Strides(m.group(1), int(m.group(2)) if m.group(2) else None, int(m.group(3)) if m.group(3) else None)


def layout_name(t: Any) -> str:
    """One tensor's layout by its exact strides, as Dynamo's tensor guards compare them (see :func:`_tensor_layout`):
    a :data:`Layout`, either in wider rows, or ``strided(...)`` (no recipe can declare it)."""
    _, h, s, d = t.shape
    stride = tuple(t.stride())
    if stride == (h * s * d, s * d, d, 1):
        return "bhsd"
    if stride == (s * h * d, d, h * d, 1):  # [B, S, H, D] contiguous, seen as [B, H, S, D]
        return "bshd"
    # a slice of wider rows (a fused projection's q, k or v, before anything copies it): the row is the S stride,
    # with its B stride S rows (one buffer [B, S, row]); bshd's head the H stride. Size-1 dims keep their stride:
    # Dynamo guards it too
    row = stride[2]
    if stride[3] == 1 and row > 0:
        if row >= d and stride[:2] == (h * s * row, s * row) and row != d:
            return f"bhsd(row={row})"
        head = stride[1]
        if head >= d and row >= h * head and stride[0] == s * row and (head, row) != (d, h * d):
            return f"bshd(head={head},row={row})" if head != d else f"bshd(row={row})"
    return "strided" + str(stride)


def split_layout(layout: str) -> tuple[str, str, str] | None:
    """The (q, k, v) layouts a layout names: one layout for all three (``"bshd"``, :func:`parse_layout`), or each as
    "q=bshd k=bhsd v=bhsd" (transformers with a KV cache: the cache concatenates k and v into contiguous tensors;
    Phi-3: "q=bhsd k=bhsd v=bshd(row=128)"). None when one of them is not a layout."""
    if parse_layout(layout) is not None:
        return (layout, layout, layout)
    parts = [part.split("=", 1) for part in layout.split()]
    if [p[0] for p in parts] != ["q", "k", "v"] or any(len(p) != 2 or parse_layout(p[1]) is None for p in parts):
        return None  # only in the order layout_of writes: q, k, v
    return (parts[0][1], parts[1][1], parts[2][1])


def layout_of(query: Any, key: Any, value: Any) -> str:
    """The memory layout of q, k, v (see :data:`Layout`): one name when all three share it, else each."""
    return joined_layout([_tensor_layout(t) for t in (query, key, value)])


def joined_layout(names: Sequence[str]) -> str:
    """The layout of q, k, v with these layouts, as a recipe and a signature write it: one name when all three share
    it, else ``"q=... k=... v=..."``."""
    if len(set(names)) == 1:
        return names[0]
    return " ".join(f"{n}={layout}" for n, layout in zip("qkv", names, strict=True))


def _tensor_layout(t: Any) -> str:
    # By the exact strides, as Dynamo's tensor guards compare them, not by is_contiguous(), which ignores the stride
    # of a size-1 dim: with one kv head (multi-query attention, Gemma3) transformers' k and v are
    # proj(x).view(B, S, 1, D).transpose(1, 2), strides (S*D, D, D, 1), which is_contiguous() calls contiguous, but a
    # graph traced on a contiguous [B, 1, S, D] tensor (strides (S*D, S*D, D, 1)) fails its guard ("stride mismatch
    # at index 1") on every call.
    if t.dim() == 4:
        return layout_name(t)
    return "strided" + str(tuple(t.stride()))


# ------------------------------------------------------------------------------------- arguments that mean the same

# torch's defaults for the kernel options a caller may set: the options ``flex_attention`` fills in
# (``_apply_kernel_options``'s ``setdefault`` s, torch 2.11-2.15; tests/test_torch_internals.py holds this table to
# torch's on every torch CI runs). An option at its default traces the same graph as no option: the higher-order op
# is handed the filled-in dict either way. Known here, without torch: a manifest's signatures are made where torch is
# not imported (``kernelpack inspect``).
KERNEL_OPTION_DEFAULTS: Mapping[str, Any] = {
    "BACKEND": "AUTO",
    "PRESCALE_QK": False,
    "ROWS_GUARANTEED_SAFE": False,
    "BLOCKS_ARE_CONTIGUOUS": False,
    "WRITE_DQ": True,
}


def normal_kernel_options(options: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """``kernel_options`` as a signature keys them: sorted, without the options at torch's default
    (:data:`KERNEL_OPTION_DEFAULTS`; ``{}`` and ``{"BACKEND": "AUTO"}`` are no options). ``BACKEND = "FLASH"`` is
    not a default: it stays."""
    return tuple(sorted((k, v) for k, v in (options or {}).items() if not _at_default(k, v)))


def _at_default(name: str, value: Any) -> bool:
    default = KERNEL_OPTION_DEFAULTS.get(name, _NO_DEFAULT)
    return type(value) is type(default) and value == default  # True is not 1 here: torch keeps what it is given


_NO_DEFAULT = object()


def normal_scale(scale: Any, head_dim: int) -> float | None:
    """``scale`` as a signature keys it: None for flex's default, ``1 / sqrt(head_dim)``, given or not (flex computes
    it before the higher-order op, which is handed the float either way: one graph); else the float."""
    if scale is None or isinstance(scale, bool) or not isinstance(scale, (int, float)):
        return scale  # type: ignore[no-any-return]
    return None if float(scale) == 1.0 / math.sqrt(head_dim) else float(scale)


def normalized(arguments: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """A flex_attention call's arguments (by parameter name) with every value that means what torch's default means
    replaced by that default, and whether ``return_aux`` asked for nothing.

    What torch compiles is the same for both spellings, but Dynamo guards on the value as passed (``L['return_aux']
    is None``), so a warmed entry or a precompiled function serves only one of them: calls are keyed and served in
    the default's spelling, the canonical calls are made in it too (:func:`kernelpack.canonical.arguments`).

    - ``return_aux=AuxRequest()`` (nothing requested): None. Such a call returns ``(out, AuxOutput(None, None))``;
      the caller restores that (the second value).
    - ``kernel_options``: without the options at torch's default (:func:`normal_kernel_options`); None when none is
      left (TorchTitan passes ``{}`` on every call).
    - ``scale``: None when it is ``1 / sqrt(head_dim)`` (:func:`normal_scale`).
    - ``enable_gqa``: False when q and k have as many heads (torch only checks the head counts with it).
    """
    out = dict(arguments)
    aux = out.get("return_aux")
    empty_aux = aux is not None and not getattr(aux, "lse", False) and not getattr(aux, "max_scores", False)
    if empty_aux:
        out["return_aux"] = None
    options = out.get("kernel_options")
    if options is not None:
        kept = dict(normal_kernel_options(options))
        out["kernel_options"] = kept or None
    query, key = out["query"], out["key"]
    if out.get("scale") is not None:
        out["scale"] = normal_scale(out["scale"], int(query.shape[-1]))
    if out.get("enable_gqa") and int(query.shape[1]) == int(key.shape[1]):
        out["enable_gqa"] = False
    return out, empty_aux


def signature_of(arguments: Mapping[str, Any], mode: str, dynamic: bool, *, mask: str | None = None) -> CallSignature:
    """The signature of a flex_attention call with these arguments (by flex_attention's parameter names; a missing
    one has its default), keyed in the default's spelling (:func:`normalized`). The graph is the training one when
    autograd will record the call. ``mask``: its mask's key when the caller has it (:func:`mask_key` with the values
    a dynamic config keeps free), else by every value."""
    query, key, value = arguments["query"], arguments["key"], arguments["value"]
    block_mask = arguments.get("block_mask")
    b, hq, q_len, d = query.shape
    scale = normal_scale(arguments.get("scale"), d)
    device = query.device
    return CallSignature(
        device=device.type,
        device_index=device.index if device.type == "cuda" else None,
        mask=mask if mask is not None else mask_key(getattr(block_mask, "mask_mod", None)),
        batch=b,
        q_heads=hq,
        kv_heads=key.shape[1],
        q_len=q_len,
        kv_len=key.shape[2],
        head_dim=d,
        dtype=str(query.dtype).removeprefix("torch."),  # type: ignore[arg-type]
        graph=graph_of(query, key, value),
        kernel_options=normal_kernel_options(arguments.get("kernel_options")),
        mode=mode,  # type: ignore[arg-type]
        dynamic=dynamic,
        layout=layout_of(query, key, value),
        scale=scale,
        enable_gqa=bool(arguments.get("enable_gqa", False)) and hq != key.shape[1],
        return_lse=bool(arguments.get("return_lse", False)),
        block_size=tuple(block_mask.BLOCK_SIZE) if block_mask is not None else DEFAULT_BLOCK_SIZE,  # type: ignore[arg-type]
        score_mod=score_mod_key(arguments.get("score_mod")),
        return_aux=aux_key(arguments.get("return_aux")),
        mask_dims=mask_dims_of(block_mask, b, hq),
        alias=alias_of(query, key, value),
    )


def aux_key(return_aux: Any) -> str:
    """``return_aux=AuxRequest(lse=..., max_scores=...)`` as one of :data:`RETURN_AUX`."""
    if return_aux is None:
        return "none"
    wanted = [name for name in ("lse", "max_scores") if getattr(return_aux, name, False)]
    return "+".join(wanted) or "none"


def mask_dims_of(block_mask: Any, batch: int, heads: int) -> str:
    """The BlockMask's batch and head dimensions (see :data:`MASK_DIMS`), from its block table's shape."""
    table = getattr(block_mask, "kv_num_blocks", None)
    if table is None or table.dim() < 2:
        return "broadcast"
    b, h = int(table.shape[0]), int(table.shape[1])
    dims = []
    if b > 1:
        dims.append("per-batch" if b == batch else f"B={b}")
    if h > 1:
        dims.append("per-head" if h == heads else f"H={h}")
    return "+".join(dims) or "broadcast"


def alias_of(query: Any, key: Any, value: Any) -> str:
    """Which of q, k, v are one tensor object (see :data:`ALIASES`)."""
    if query is key and key is value:
        return "q=k=v"
    for name, (a, b) in (("k=v", (key, value)), ("q=k", (query, key)), ("q=v", (query, value))):
        if a is b:
            return name
    return "none"


def score_mod_key(score_mod: Callable[..., Any] | None) -> str:
    """How the call signature names a score_mod: by what it computes (:func:`mod_graph`), "identity" for any that
    returns the score unchanged (transformers passes such a closure when it has no softcap), else "code#<digest>"."""
    if score_mod is None:
        return "none"
    graph = mod_graph(score_mod, "score")
    if graph is None:
        return "code#" + functions.key(score_mod)[:12] if hasattr(score_mod, "__code__") else "opaque"
    return "identity" if graph.text == "return score" else f"graph#{graph.key}"


# ------------------------------------------------------------------------------------------------ mask fingerprints

_mask_keys: weakref.WeakKeyDictionary[Callable[..., Any], dict[frozenset[str], str]] = weakref.WeakKeyDictionary()


def mask_key(mask_mod: Callable[..., Any] | None, free: Collection[str] = ()) -> str:
    """A name for what a mask_mod computes, equal across processes for the same code and closure values.

    kernelpack's own masks carry it (``sliding_window(1024)``, see :mod:`kernelpack.masks`); any other function is
    named by its qualname and :func:`kernelpack.functions.key` (its code and closure values; function names and
    files do not enter inductor's keys either). ``free``: the closure paths a dynamic graph keeps symbolic, which
    enter by type (the manifest records them per config). Computed once per function object, not per call."""
    return mask_keys(mask_mod, (free,))[0]


def mask_keys(mask_mod: Callable[..., Any] | None, frees: Sequence[Collection[str]]) -> list[str]:
    """:func:`mask_key` for each of ``frees``; the ones not known yet from one walk of the function."""
    if mask_mod is None:
        return ["none"] * len(frees)
    tag = getattr(mask_mod, "kernelpack_mask", None)
    if tag is not None:
        return [str(tag)] * len(frees)
    if getattr(mask_mod, "__code__", None) is None:  # not a plain function: never equal to another
        return [f"{type(mask_mod).__qualname__}@{id(mask_mod):x}"] * len(frees)
    sets = [frozenset(f) for f in frees]
    try:
        known = _mask_keys.get(mask_mod) or {}
    except TypeError:  # not weakly referable: keyed at every call
        known = {}
    missing = list(dict.fromkeys(f for f in sets if f not in known))
    if missing:
        name = getattr(mask_mod, "__qualname__", "mask_mod")
        known = {
            **known,
            **{f: f"{name}#{k[:12]}" for f, k in zip(missing, functions.each_key(mask_mod, missing), strict=True)},
        }
        with contextlib.suppress(TypeError):
            _mask_keys[mask_mod] = known
    return [known[f] for f in sets]


# ------------------------------------------------------------------------------------------------ graphs of mods


@dataclass(frozen=True, slots=True)
class ModGraph:
    """What a mask_mod or score_mod computes, as the torch operations it makes on its index (and score) arguments:
    two functions with the same ``text`` compute the same thing for every input, whatever their names, files or code
    objects; the same meaning in another op order is another graph (as it is in inductor's keys)."""

    text: str
    reads_tensors: bool = False  # reads a tensor it closes over (or a global one): by shape, not by value

    @property
    def key(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:12]


_MOD_ARGS = {"mask": ("b", "h", "q_idx", "kv_idx"), "score": ("score", "b", "h", "q_idx", "kv_idx")}
# calls that turn a tensor into a Python value: what follows depends on the example value, not on the graph
_CONCRETIZING = frozenset(("__bool__", "item", "__int__", "__index__", "__float__", "tolist", "__len__", "__iter__"))
_mod_graphs: dict[tuple[Any, ...], ModGraph | None] = {}
_MOD_GRAPHS_MAX = 4096


def mod_graph(fn: Callable[..., Any], kind: Literal["mask", "score"]) -> ModGraph | None:
    """The graph of a mask_mod (``kind="mask"``) or score_mod, recorded by running it once on 0-dim example tensors
    under a TorchFunctionMode: not FX tracing, so it never sets torch.fx's process-global tracing flag, and it is
    thread-local. A tensor it closes over enters by shape and dtype, not by value. None when the function cannot be
    told by its graph (Python control flow on a tensor's value, or an error).

    Recorded once per (code object, closure constants, closure-tensor metadata): a job that builds a new closure
    every step pays a dict lookup, not a recording."""
    key = functions.recording_key(fn, kind)
    if key is not None and key in _mod_graphs:
        return _mod_graphs[key]
    graph = _record(fn, kind)
    if key is not None:
        if len(_mod_graphs) >= _MOD_GRAPHS_MAX:
            _mod_graphs.clear()
        _mod_graphs[key] = graph
    return graph


def _record(fn: Callable[..., Any], kind: Literal["mask", "score"]) -> ModGraph | None:
    import torch
    from torch.overrides import TorchFunctionMode

    names = _MOD_ARGS[kind]
    inputs = [torch.zeros((), dtype=torch.float32 if n == "score" else torch.int32) for n in names]
    refs: dict[int, str] = {id(t): n for t, n in zip(inputs, names, strict=True)}
    lines: list[str] = []
    keep: list[Any] = []  # results stay alive while recording, so that their ids stay theirs

    outside: list[bool] = []  # a tensor that is neither an argument nor made here was read

    def ref(a: Any) -> str:
        if isinstance(a, torch.Tensor):
            name = refs.get(id(a))
            if name is None:
                outside.append(True)
                return f"tensor{tuple(a.shape)}:{str(a.dtype).removeprefix('torch.')}"
            return name
        if isinstance(a, (list, tuple)):
            return "(" + ", ".join(map(ref, a)) + ")"
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype)):
            return repr(a)
        return type(a).__name__

    class Recorder(TorchFunctionMode):
        concrete = False

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            name = getattr(func, "__name__", str(func))
            if name in _CONCRETIZING:
                Recorder.concrete = True
            out = func(*args, **kwargs)
            keep.append(out)
            call = ", ".join([*map(ref, args), *(f"{k}={ref(v)}" for k, v in sorted(kwargs.items()))])
            if isinstance(out, torch.Tensor) and id(out) not in refs:
                refs[id(out)] = f"%{len(lines)}"
                lines.append(f"{refs[id(out)]} = {name}({call})")
            return out

    try:
        with Recorder():
            result = fn(*inputs)
    except Exception:
        return None
    if Recorder.concrete or not isinstance(result, torch.Tensor):
        return None
    text = "\n".join([*lines, f"return {ref(result)}"])
    return ModGraph(text, reads_tensors=bool(outside))
