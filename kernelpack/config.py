"""A config: one point of a recipe, the call parameters (:class:`~kernelpack.signature.CallParams`) plus the mask as
the recipe declares it, with a stable id. Validated here, in one place, whether it comes from a recipe file
(:mod:`kernelpack.recipe`, the file format) or a manifest (:mod:`kernelpack.manifest`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from . import closures
from .errors import ConfigError
from .signature import (
    ALIASES,
    COMPILE_MODES,
    DEFAULT_BLOCK_SIZE,
    DEVICES,
    DTYPES,
    GRAPHS,
    LAYOUTS,
    MASK_DIMS,
    RETURN_AUX,
    CallParams,
    CallSignature,
    Graph,
    normal_kernel_options,
    normal_scale,
    parse_layout,
    split_layout,
)

BUILTIN_MASKS = ("sliding_window", "sliding_window_bidirectional")


REF_KEYS = ("function", "closure", "defaults", "kwdefaults", "qualname", "line")


SCORE_MODS = ("none", "identity")


_POSITIVE = ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim")


@dataclass(frozen=True, kw_only=True, slots=True)
class Config(CallParams):
    """One point of a recipe: the call parameters (:class:`~kernelpack.signature.CallParams`) plus the mask as the
    recipe declares it. Validated here, in one place, whether it comes from a recipe file or a manifest."""

    mask: str  # a built-in mask name or "pkg.module:factory"
    window: int | None
    # The graphs built for this point, in GRAPHS order. Reentrant gradient checkpointing needs both: its forward runs
    # under no_grad (the "fwd" graph) and its recompute in backward with grad (the "fwd+bwd" graph).
    graphs: tuple[Graph, ...] = ("fwd",)
    # Set: ``mask`` (``score_mod``) names a function by "module:qualname", made again with these closure values
    # (kernelpack.closures, canonical JSON); None: ``mask`` is a built-in or a factory.
    mask_closure: str | None = None
    score_closure: str | None = None
    # The BlockMask's mask_mod is kernelpack.masks.padded(mask, n): keys at n and beyond masked out, n a 0-d tensor
    # (a graph input, so one graph serves every n). For buckets of a mask that is not causal.
    padded: bool = False
    # A dynamic config (``dynamic`` true) covers every (q_len, kv_len) with q_len in q_range and kv_len in kv_range
    # (inclusive); q_len and kv_len are then the lengths the builder traces at. None: exactly q_len and kv_len.
    q_range: tuple[int, int] | None = None
    kv_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        CallParams.__post_init__(self)  # not super(): zero-argument super() breaks in slots dataclasses
        for name in ("mask_closure", "score_closure"):  # one spelling per value: the id hashes it
            value = getattr(self, name)
            if isinstance(value, str):
                with contextlib.suppress(ValueError, TypeError):
                    object.__setattr__(self, name, canonical_json(json.loads(value)))
        _validate(self)

    @property
    def backward(self) -> bool:
        """Whether the training graph is built (the inputs of the canonical call then require grad)."""
        return "fwd+bwd" in self.graphs

    @property
    def mask_label(self) -> str:
        """The declared mask with its window: for the built-in masks exactly what :func:`signature.mask_key` names
        their mask_mod (``sliding_window(1024)``)."""
        if self.mask in BUILTIN_MASKS:
            label = f"{self.mask}({self.window})"
        elif self.mask_closure is not None:
            label = closures.label({"function": self.mask, **json.loads(self.mask_closure)})
        else:
            label = self.mask if self.window is None else f"{self.mask}(window={self.window})"
        return f"padded({label})" if self.padded else label

    @property
    def tied(self) -> bool:
        """A ``seq_len`` range: q_len == kv_len, traced so. Independent q_len and kv_len ranges are traced at
        different lengths where they can be (:func:`_lengths`), so the two read apart."""
        return self.q_range is not None and self.q_range == self.kv_range and self.q_len == self.kv_len

    def at(self, q_len: int, kv_len: int) -> Config:
        """This config's call at other lengths (a length of a range config's range: its canonical call there)."""
        return dataclasses.replace(self, q_len=q_len, kv_len=kv_len)

    def covers_lengths(self, q_len: int, kv_len: int) -> bool:
        """Whether this config's lengths include (q_len, kv_len): its ranges for a dynamic range config (q_len ==
        kv_len for a ``seq_len`` range), else exactly its own."""
        if self.q_range is None or self.kv_range is None:
            return (q_len, kv_len) == (self.q_len, self.kv_len)
        if self.tied and q_len != kv_len:
            return False
        return self.q_range[0] <= q_len <= self.q_range[1] and self.kv_range[0] <= kv_len <= self.kv_range[1]

    def reference(self, kind: Literal["mask", "score"]) -> dict[str, Any] | None:
        """The function reference (:mod:`kernelpack.closures`) of the mask or score_mod, or None when it is a
        built-in or a factory."""
        name, closure = (self.mask, self.mask_closure) if kind == "mask" else (self.score_mod, self.score_closure)
        return None if closure is None else {"function": name, **json.loads(closure)}

    def signature(
        self, device_index: int | None, graph: Graph, mask_key: str | None = None, score_key: str | None = None
    ) -> CallSignature:
        """A call this recipe point stands for: the same call parameters and ``graph``; the mask named by what its
        mask_mod computes (``mask_key``, which the builder records in the manifest; by default :attr:`mask_label`);
        the score_mod likewise (``score_key``; by default the declared ``"none"`` or ``"identity"``); and the device
        index on CUDA (None on CPU, where inductor's keys carry none)."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(CallParams)}
        # keyed as a call is (signature.normalized): an option at torch's default, flex's default scale written
        # out, enable_gqa with as many q as kv heads are no difference
        shared["kernel_options"] = normal_kernel_options(dict(self.kernel_options))
        shared["scale"] = normal_scale(self.scale, self.head_dim)
        shared["enable_gqa"] = self.q_heads != self.kv_heads
        if score_key:
            shared["score_mod"] = score_key
        return CallSignature(
            **shared,
            mask=mask_key if mask_key is not None else self.mask_label,
            device_index=device_index if self.device == "cuda" else None,
            graph=graph,
        )

    def signatures(
        self, device_index: int | None, mask_key: str | None = None, score_key: str | None = None
    ) -> tuple[CallSignature, ...]:
        """Every call this recipe point stands for on one device: one per graph."""
        return tuple(self.signature(device_index, g, mask_key, score_key) for g in self.graphs)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["kernel_options"] = dict(self.kernel_options)
        d["graphs"] = list(self.graphs)
        d["block_size"] = list(self.block_size)
        for name in ("q_range", "kv_range"):
            value = getattr(self, name)
            d[name] = None if value is None else list(value)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """A Config from :meth:`to_dict`'s form (an ``id`` key is ignored). Raises :class:`ConfigError`."""
        if not isinstance(d, dict):
            raise ConfigError("params", "must be an object", value=d)
        d = {k: v for k, v in d.items() if k != "id"}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(d.keys() - names)
        if unknown:
            raise ConfigError(unknown[0], "unknown field", allowed=sorted(names))
        missing = sorted(
            f.name for f in dataclasses.fields(cls) if f.name not in d and f.default is dataclasses.MISSING
        )
        if missing:
            raise ConfigError(missing[0], "missing")
        options = d.get("kernel_options", {})
        if not isinstance(options, dict):
            raise ConfigError("kernel_options", "must be a table", value=options)
        listed: dict[str, Any] = {}
        for name, default in (("graphs", ["fwd"]), ("block_size", list(DEFAULT_BLOCK_SIZE))):
            value = d.get(name, default)
            if not isinstance(value, (list, tuple)):
                raise ConfigError(name, "must be a list", value=value)
            listed[name] = tuple(value)
        for name in ("q_range", "kv_range"):
            value = d.get(name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ConfigError(name, "must be a list [min, max]", value=value)
            listed[name] = None if value is None else tuple(value)
        return cls(**{**d, "kernel_options": tuple(sorted(options.items())), **listed})

    @property
    def id(self) -> str:
        """Stable across processes, machines and Python versions: a hash of every normalized parameter."""
        return hashlib.sha256(canonical_json(self.to_dict()).encode()).hexdigest()[:12]

    def describe(self) -> str:
        text = self._describe(self.mask_label, self.device, " & ".join(self.graphs))
        if self.q_range is not None and self.kv_range is not None:
            (q0, q1), (k0, k1) = self.q_range, self.kv_range
            text = text[:-1] + f" q_len {q0}..{q1} kv_len {k0}..{k1}]"
        return f"{self.id} {text}"


def _validate(c: Config) -> None:
    """Every rule a buildable config obeys. Raises :class:`ConfigError` naming the field."""
    if c.device not in DEVICES:
        raise ConfigError("device", "unknown value", value=c.device, allowed=DEVICES)
    if c.mask_closure is not None:
        _check_reference(c, "mask", c.mask, c.mask_closure)
    elif not isinstance(c.mask, str) or not (c.mask in BUILTIN_MASKS or is_import_path(c.mask)):
        raise ConfigError("mask", "unknown mask", value=c.mask, allowed=(*BUILTIN_MASKS, "'pkg.module:factory'"))
    if c.window is None:
        if c.mask in BUILTIN_MASKS:
            raise ConfigError("window", f"required for mask {c.mask!r}", allowed="a positive integer")
    elif not positive_int(c.window):
        raise ConfigError("window", "must be a positive integer", value=c.window, allowed=INT_RANGE)
    for name in _POSITIVE:
        if not positive_int(getattr(c, name)):
            raise ConfigError(name, "must be a positive integer", value=getattr(c, name), allowed=INT_RANGE)
    if c.q_heads % c.kv_heads:
        raise ConfigError(
            "kv_heads",
            f"q_heads={c.q_heads} is not a multiple of kv_heads={c.kv_heads} (GQA needs q_heads % kv_heads == 0)",
            value=c.kv_heads,
        )
    if c.dtype not in DTYPES:
        raise ConfigError("dtype", "unknown value", value=c.dtype, allowed=DTYPES)
    if not isinstance(c.dynamic, bool):
        raise ConfigError("dynamic", "must be a boolean", value=c.dynamic, allowed=(True, False))
    if not isinstance(c.graphs, tuple) or not c.graphs:
        raise ConfigError("graphs", "must be a non-empty list", value=c.graphs, allowed=GRAPHS)
    for g in c.graphs:
        if g not in GRAPHS:
            raise ConfigError("graphs", "unknown graph", value=g, allowed=GRAPHS)
    if list(c.graphs) != sorted(set(c.graphs), key=GRAPHS.index):
        raise ConfigError("graphs", "must list each graph once, in the order " + ", ".join(GRAPHS), value=c.graphs)
    if c.backward and c.device == "cpu":
        raise ConfigError(
            "graphs",
            "compiled flex_attention has no backward on CPU",
            value="fwd+bwd",
            allowed="['fwd'] when device = 'cpu'",
        )
    layouts = split_layout(c.layout) if isinstance(c.layout, str) else None
    if layouts is None:
        raise ConfigError(
            "layout",
            "unknown layout",
            value=c.layout,
            allowed=(*LAYOUTS, "'bshd(row=R)'", "'bshd(head=P,row=R)'", "'bhsd(row=R)'", "'q=bshd k=bhsd v=bhsd'"),
        )
    for name, layout, heads in zip("qkv", layouts, (c.q_heads, c.kv_heads, c.kv_heads), strict=True):
        strides = parse_layout(layout)
        problem = (
            strides and isinstance(heads, int) and isinstance(c.head_dim, int) and strides.problem(heads, c.head_dim)
        )
        if problem:
            raise ConfigError("layout", f"{name}'s layout {layout!r}: {problem}", value=c.layout)
    if c.scale is not None and (
        isinstance(c.scale, bool) or not isinstance(c.scale, (int, float)) or not 0 < c.scale < math.inf
    ):  # not 0 < nan either: TOML has nan and inf
        raise ConfigError("scale", "must be a positive number (or left out: 1/sqrt(head_dim))", value=c.scale)
    for name in ("return_lse", "enable_gqa"):
        if not isinstance(getattr(c, name), bool):
            raise ConfigError(name, "must be a boolean", value=getattr(c, name), allowed=(True, False))
    if c.return_lse and c.device == "cpu":  # inductor's CPU flex template: "return_lse is not supported yet"
        raise ConfigError("return_lse", "compiled flex_attention on CPU cannot return the lse", value=True)
    if c.q_heads != c.kv_heads and not c.enable_gqa:
        raise ConfigError("enable_gqa", f"must be true when q_heads={c.q_heads} != kv_heads={c.kv_heads}", value=False)
    if not (isinstance(c.block_size, tuple) and len(c.block_size) == 2 and all(map(positive_int, c.block_size))):
        raise ConfigError(
            "block_size", "must be a positive integer or two of them", value=c.block_size, allowed=INT_RANGE
        )
    if c.return_aux not in RETURN_AUX:
        raise ConfigError("return_aux", "unknown value", value=c.return_aux, allowed=RETURN_AUX)
    if c.return_aux != "none" and c.return_lse:
        raise ConfigError("return_aux", "torch refuses return_lse together with return_aux", value=c.return_aux)
    if c.return_aux != "none" and c.device == "cpu":
        raise ConfigError(
            "return_aux", "compiled flex_attention on CPU returns no auxiliary outputs", value=c.return_aux
        )
    if c.mask_dims not in MASK_DIMS:
        raise ConfigError("mask_dims", "unknown value", value=c.mask_dims, allowed=MASK_DIMS)
    if c.alias not in ALIASES:
        raise ConfigError("alias", "unknown value", value=c.alias, allowed=ALIASES)
    named = dict(zip("qkv", layouts, strict=True))
    if c.alias in ALIASES and len({named[n] for n in c.alias.replace("=", "") if n in named}) > 1:
        raise ConfigError("alias", f"one tensor has one layout, but layout is {c.layout!r}", value=c.alias)
    if "q=" in c.alias and (c.q_heads, c.q_len) != (c.kv_heads, c.kv_len):
        raise ConfigError("alias", "q can be k or v only when q_heads == kv_heads and q_len == kv_len", value=c.alias)
    if c.score_closure is not None:
        _check_reference(c, "score_mod", c.score_mod, c.score_closure)
    elif not isinstance(c.score_mod, str) or not (c.score_mod in SCORE_MODS or is_import_path(c.score_mod)):
        raise ConfigError(
            "score_mod", "unknown score_mod", value=c.score_mod, allowed=(*SCORE_MODS, "'pkg.module:factory'")
        )
    if c.mode not in COMPILE_MODES:
        raise ConfigError("mode", "unknown value", value=c.mode, allowed=COMPILE_MODES)
    if not isinstance(c.padded, bool):
        raise ConfigError("padded", "must be a boolean", value=c.padded, allowed=(True, False))
    _check_ranges(c)
    for k, v in c.kernel_options:
        if not isinstance(v, (bool, int, float, str)):
            raise ConfigError(f"kernel_options.{k}", "must be a scalar", value=v, allowed="bool, int, float, str")
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"kernel_options.{k}", "must be a finite number", value=v)
        if k == "BACKEND" and isinstance(v, str) and v.upper() == "FLASH":
            # flex's FLASH backend (torch >= 2.13 with flash-attn's CuTe DSL) compiles CuTe kernels, which are not
            # inductor's Triton kernels and not in its cache: an artifact would not hold them, and the job's
            # first call would compile them (or kernelpack would refuse it) whatever was built
            raise ConfigError(
                "kernel_options.BACKEND",
                "the FLASH backend builds flash-attn's CuTe DSL kernels outside inductor's cache, which an artifact "
                "cannot carry: every job would compile them at its first call",
                value=v,
                allowed="'TRITON', or no BACKEND (flex's Triton kernels, which kernelpack ships)",
            )


def _check_ranges(c: Config) -> None:
    if (c.q_range is None) != (c.kv_range is None):
        raise ConfigError("q_range" if c.q_range is None else "kv_range", "a dynamic range config has both ranges")
    if c.q_range is None or c.kv_range is None:
        return
    if not c.dynamic:
        raise ConfigError(
            "q_range",
            "a length range without `multiple` is one dynamic graph: it needs [compile] dynamic = true",
            value=list(c.q_range),
            allowed="add `multiple = N` for static buckets, or set [compile] dynamic = true",
        )
    for name, rng, length, block in (
        ("q_range", c.q_range, c.q_len, c.block_size[0]),
        ("kv_range", c.kv_range, c.kv_len, c.block_size[1]),
    ):
        if not (isinstance(rng, tuple) and len(rng) == 2 and all(map(positive_int, rng)) and rng[0] <= rng[1]):
            raise ConfigError(name, "must be [min, max] with 0 < min <= max", value=rng)
        if rng[0] <= block and rng[0] != rng[1]:
            # torch specializes a size of 1 (here: one block) into its own graph, so such lengths are another graph;
            # a fixed length (min == max: DFlash's q_len) is one graph whatever it is
            raise ConfigError(
                name,
                f"a dynamic range must start above the block size ({block}): a length of one block is another graph",
                value=rng[0],
                allowed=f"min >= {block + 1}",
            )
        if not rng[0] <= length <= rng[1]:
            raise ConfigError(name, f"the traced length {length} is outside the range", value=list(rng))


def _check_reference(c: Config, field_name: str, name: object, closure: object) -> None:
    """A function reference's parts: "module:qualname" (nested functions as qualname's ``<locals>``) and a JSON
    object of closure values."""
    if not isinstance(name, str) or not is_import_path(name, nested=True):
        raise ConfigError(field_name, "a function reference names 'pkg.module:qualname'", value=name)
    try:
        parsed = json.loads(closure) if isinstance(closure, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict) or set(parsed) - set(REF_KEYS[1:]):
        raise ConfigError(field_name, "closure values must be a JSON object", value=closure)
    if field_name == "mask" and c.window is not None:
        raise ConfigError("window", "a mask given as a function reference carries its values in its closure")


# Every count and size of a config: flex_attention indexes its tensors and block masks with int32, and a bound here
# turns a value that would fail late (an allocation in a build worker, after the other configs compiled) or never
# (a loop over a length) into an error naming the key.
MAX_INT = 2**31 - 1


INT_RANGE = f"an integer from 1 to {MAX_INT}"


# Configs one recipe may expand to (the manifest's bound too): counted from the axes before any is made, so that a
# tiny recipe whose axes multiply to billions is refused at once instead of hanging the parser
MAX_CONFIGS = 10_000


def positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_INT


def canonical_json(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def is_import_path(s: str, *, nested: bool = False) -> bool:
    """ "pkg.module:attr" (``nested``: a qualname, with ``<locals>`` and ``<lambda>`` parts)."""
    module, sep, attr = s.partition(":")
    names = [p for p in attr.split(".") if not (nested and p in ("<locals>", "<lambda>"))]
    return bool(sep and module and attr) and all(p.isidentifier() for p in (*module.split("."), *names))
