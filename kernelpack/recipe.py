"""Recipes: what to precompile. A TOML file expands into a list of :class:`Config`, each with a stable id.

Example (``recipes/smoke-cpu.toml``)::

    name = "smoke-cpu"
    description = "tiny forward-only recipe for CI"
    device = "cpu"
    mask = "sliding_window"          # or "sliding_window_bidirectional", or "pkg.module:factory"
    windows = [64, 128]

    [matrix]
    batch = 1
    q_heads = 2
    kv_heads = 2                      # != q_heads -> GQA (enable_gqa=True)
    seq_len = [256]                   # or q_len = [...] and kv_len = [...]; or a range (below)
    head_dim = 64
    dtypes = ["float32"]
    graphs = ["fwd"]                  # and/or "fwd+bwd" (CUDA only)

    [compile]
    dynamic = false                   # one static graph per shape (see README)
    mode = "default"

    [call]                            # how the job calls flex_attention; every key optional
    layout = "bhsd"                   # or "bshd" (q/k/v as proj(x).view(B, S, H, D).transpose(1, 2)), or each
                                      # ("q=bshd k=bhsd v=bhsd": a KV cache's k, v), either order in wider
                                      # rows ("bshd(row=128)": a slice of a fused qkv projection, Phi-3's v;
                                      # "bshd(head=48,row=384)": GPT-NeoX's), or a list of these
    scale = 0.125                     # default: 1/sqrt(head_dim)
    return_lse = false
    enable_gqa = false                # default: q_heads != kv_heads
    block_size = 128                  # the BlockMask's block size, or [q_block, kv_block]
    score_mod = "identity"            # "none" (default), "identity" (any score_mod that returns the score), or
                                      # "pkg.module:factory": factory(config) returns the score_mod
    return_aux = "none"               # or "lse", "max_scores", "lse+max_scores": return_aux=AuxRequest(...)
    mask_dims = "broadcast"           # or "per-batch", "per-head", "per-batch+per-head": the BlockMask's B and H
    alias = "none"                    # or "k=v", "q=k=v", ...: one tensor object passed for several of q, k, v

    [kernel_options]                  # passed verbatim to flex_attention

Besides (or instead of) the product ``[matrix]``, a recipe may list calls one by one (what ``kernelpack record``
writes), each one config with every key of ``[matrix]`` (one value each), ``[call]`` and ``[compile]``::

    [[calls]]
    mask = { function = "my_model.masks:window_mask.<locals>.mask", closure = { window = 1024 } }
    q_heads = 32
    kv_heads = 8
    seq_len = 4096
    head_dim = 128
    dtype = "bfloat16"
    graphs = ["fwd", "fwd+bwd"]
    layout = "bshd"

A mask (or score_mod) given as ``{ function = "module:qualname", closure = {...} }`` is that very function, made
again by :mod:`kernelpack.closures` with those closure values; a string is a built-in mask or a factory as above.

Varying lengths: a length axis may be a range, in ``[matrix]`` and in ``[[calls]]``:

- ``seq_len = { min = 1024, max = 16384, multiple = 256 }``: **buckets**, one static config per multiple of 256 from
  the first at or above min to the first at or above max. The job pads each batch to its bucket
  (:func:`kernelpack.runtime.padded_length`). ``q_len = {...}`` with ``kv_len = { offset = [0, 512] }`` ties kv_len
  to q_len (kv_len = q_len + each offset) instead of a product.
- ``seq_len = { min = 1024, max = 16384 }`` with ``[compile] dynamic = true``: **dynamic**, one graph per config that
  serves every length in the range (``q_len`` and ``kv_len`` ranges likewise, independent). A range without
  ``multiple`` needs ``dynamic = true``; min must be above the block size (a one-block length is its own graph).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _fs, closures
from .config import (
    BUILTIN_MASKS,
    INT_RANGE,
    MAX_CONFIGS,
    REF_KEYS,
    Config,
    canonical_json,
    positive_int,
)
from .errors import ConfigError, RecipeError
from .signature import (
    DEFAULT_BLOCK_SIZE,
    GRAPHS,
    Graph,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


_TOP_KEYS = (
    "name",
    "description",
    "device",
    "mask",
    "windows",
    "matrix",
    "compile",
    "call",
    "kernel_options",
    "calls",
)
_MATRIX_KEYS = (
    "batch",
    "q_heads",
    "kv_heads",
    "seq_len",
    "q_len",
    "kv_len",
    "head_dim",
    "dtypes",
    "graphs",
)
_COMPILE_KEYS = ("mode", "dynamic")
_CALL_KEYS = (
    "layout",
    "scale",
    "return_lse",
    "enable_gqa",
    "block_size",
    "score_mod",
    "return_aux",
    "mask_dims",
    "alias",
    "padded",
)
# the keys of one [[calls]] table: one config, each value a scalar
_CALLS_KEYS = (
    "mask",
    "window",
    "batch",
    "q_heads",
    "kv_heads",
    "seq_len",
    "q_len",
    "kv_len",
    "head_dim",
    "dtype",
    "graphs",
    "kernel_options",
    *_COMPILE_KEYS,
    *_CALL_KEYS,
)
_RANGE_KEYS = ("min", "max", "multiple")
# where each Config field comes from in a recipe file, for errors that name the recipe key
_RECIPE_KEY = {
    "device": "device",
    "mask": "mask",
    "window": "windows",
    "batch": "matrix.batch",
    "q_heads": "matrix.q_heads",
    "kv_heads": "matrix.kv_heads",
    "q_len": "matrix.q_len",
    "kv_len": "matrix.kv_len",
    "head_dim": "matrix.head_dim",
    "dtype": "matrix.dtypes",
    "graphs": "matrix.graphs",
    "kernel_options": "kernel_options",
    "mode": "compile.mode",
    "dynamic": "compile.dynamic",
    "layout": "call.layout",
    "scale": "call.scale",
    "return_lse": "call.return_lse",
    "enable_gqa": "call.enable_gqa",
    "block_size": "call.block_size",
    "score_mod": "call.score_mod",
    "return_aux": "call.return_aux",
    "mask_dims": "call.mask_dims",
    "alias": "call.alias",
    "padded": "call.padded",
    "q_range": "matrix.q_len",
    "kv_range": "matrix.kv_len",
    "mask_closure": "mask",
    "score_closure": "call.score_mod",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    name: str
    device: str
    configs: tuple[Config, ...]
    normalized: dict[str, Any] = field(hash=False, compare=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(canonical_json(self.normalized).encode()).hexdigest()


def check_name(name: object) -> str | None:
    """Why ``name`` cannot name a recipe (it names artifacts and registry directories), or None when it can."""
    if not isinstance(name, str) or not name:
        return "must be a non-empty string"
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum() or name.startswith("."):
        return "must be letters, digits, '-', '_' or '.' and not start with '.' (it names the artifact)"
    return None


MAX_RECIPE_BYTES = 16 << 20  # a recorded recipe of thousands of calls is well under 1 MiB


def load_recipe(path: str | Path) -> Recipe:
    path = str(path)
    try:
        data = tomllib.loads(_fs.read_regular(path, MAX_RECIPE_BYTES).decode())
    except FileNotFoundError:
        raise RecipeError(
            path, "<file>", "recipe file not found", hint=f"check the path: no file {os.path.abspath(path)}"
        ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise RecipeError(path, "<toml>", f"not valid TOML: {e}") from None
    except RecursionError:  # tomllib recurses per nesting level: [[[[...]]]] thousands deep
        raise RecipeError(path, "<toml>", "nested too deeply", allowed="tables and arrays a few levels deep") from None
    except (OSError, ValueError) as e:  # ValueError: over MAX_RECIPE_BYTES
        raise RecipeError(path, "<file>", f"cannot read: {e}") from None
    return parse_recipe(data, path=path)


def parse_recipe(data: dict[str, Any], *, path: str = "<recipe>") -> Recipe:
    """Validate ``data`` (a parsed TOML document) and expand it. Raises :class:`RecipeError`, never anything else.

    This reads the file's structure (tables, keys, axes); the rules for the values are :class:`Config`'s, and its
    errors are re-raised naming the recipe key."""
    try:
        return _parse_recipe(data, path)
    except RecursionError:  # a closure table nested thousands deep
        raise RecipeError(path, "<toml>", "nested too deeply", allowed="tables a few levels deep") from None


def _parse_recipe(data: dict[str, Any], path: str) -> Recipe:
    _no_unknown(path, "", data, _TOP_KEYS)
    name = _str(path, "name", data.get("name"), required=True)
    problem = check_name(name)
    if problem:
        raise RecipeError(path, "name", problem, value=name)
    description = _str(path, "description", data.get("description", ""))
    device = _str(path, "device", data.get("device"), required=True)
    normalized: dict[str, Any] = {"name": name, "description": description, "device": device}
    configs: list[Config] = []
    if "matrix" in data or "calls" not in data:
        matrix_configs, matrix_normalized = _matrix(path, data, device)
        configs += matrix_configs
        normalized.update(matrix_normalized)
    else:
        for key in ("mask", "windows", "compile", "call", "kernel_options"):
            if key in data:
                raise RecipeError(
                    path, key, "applies to [matrix], which this recipe does not have: give it in each [[calls]] table"
                )
    if "calls" in data:
        calls, tables = _calls(path, data["calls"], device)
        seen = {c.id for c in configs}
        for i, c in zip(tables, calls, strict=True):
            if c.id in seen:
                raise RecipeError(path, f"calls[{i}]", f"repeats config {c.id} ({c.describe()})")
            seen.add(c.id)
        configs += calls
        # order-independent: the same calls listed in another order are the same recipe
        normalized["calls"] = [c.to_dict() for c in sorted(calls, key=lambda c: c.id)]
    _no_shared_traced_call(path, configs)
    return Recipe(name=name, device=device, configs=tuple(configs), normalized=normalized)


def _no_shared_traced_call(path: str, configs: list[Config]) -> None:
    """Two dynamic ranges of one call traced at the same lengths would be one graph in the artifact, serving only
    one of the ranges: refused (merge them into one range)."""
    seen: dict[Any, Config] = {}
    for c in configs:
        if c.q_range is None:
            continue
        key = c.signature(0, c.graphs[0])
        other = seen.setdefault(key, c)
        if other is not c:
            raise RecipeError(
                path,
                "calls",
                f"two dynamic ranges of one call are traced at the same lengths ({c.describe()} and "
                f"{other.describe()}): they would be one graph",
                allowed="one range per call: merge them",
            )


def _matrix(path: str, data: dict[str, Any], device: str) -> tuple[list[Config], dict[str, Any]]:
    """The product of a recipe's ``[matrix]`` axes with its mask, windows and ``[call]``/``[compile]`` options."""
    mask = _str(path, "mask", data.get("mask"), required=True)
    if "windows" in data:
        windows: list[int | None] = list(_int_axis(path, "windows", data["windows"]))
    elif mask in BUILTIN_MASKS:
        raise RecipeError(path, "windows", f"required for mask {mask!r}", allowed="a list of positive integers")
    else:
        windows = [None]

    matrix = _table(path, "matrix", data.get("matrix"), required=True)
    _no_unknown(path, "matrix.", matrix, _MATRIX_KEYS)
    batch = _int_axis(path, "matrix.batch", matrix.get("batch", 1))
    q_heads = _int_axis(path, "matrix.q_heads", _required(path, "matrix.q_heads", matrix.get("q_heads")))
    kv_heads = _int_axis(path, "matrix.kv_heads", matrix.get("kv_heads", q_heads))
    head_dim = _int_axis(path, "matrix.head_dim", _required(path, "matrix.head_dim", matrix.get("head_dim")))
    compile_opts = _table(path, "compile", data.get("compile", {}))
    _no_unknown(path, "compile.", compile_opts, _COMPILE_KEYS)
    mode = compile_opts.get("mode", "default")
    dynamic = compile_opts.get("dynamic", False)
    lens = _lengths(path, "matrix.", matrix, dynamic)
    dtypes = _list(path, "matrix.dtypes", _required(path, "matrix.dtypes", matrix.get("dtypes")))
    graphs = _graphs(path, matrix)
    kernel_options = _table(path, "kernel_options", data.get("kernel_options", {}))
    call = _table(path, "call", data.get("call", {}))
    _no_unknown(path, "call.", call, _CALL_KEYS)
    layouts = _list(path, "call.layout", call.get("layout", "bhsd"))
    call_params = _call_params(call)
    score_mod, score_closure = _function_or_name(path, "call.score_mod", call_params.pop("score_mod"))
    axes = (dtypes, lens, windows, batch, q_heads, kv_heads, head_dim, layouts)
    count = math.prod(map(len, axes))
    if count > MAX_CONFIGS:
        sizes = " x ".join(str(len(a)) for a in axes)
        raise RecipeError(
            path,
            "matrix",
            f"makes {count} configs ({sizes}: dtypes, lengths, windows, batch, q_heads, kv_heads, head_dim, "
            f"layouts), over the limit of {MAX_CONFIGS}",
            allowed="fewer values per axis, or [[calls]] for the calls the job makes",
        )
    try:
        configs = [
            Config(
                device=device,  # type: ignore[arg-type]
                mask=mask,
                window=w,
                batch=b,
                q_heads=qh,
                kv_heads=kh,
                q_len=ql,
                kv_len=kl,
                q_range=qr,
                kv_range=kr,
                head_dim=hd,
                dtype=dt,
                graphs=graphs,
                kernel_options=tuple(sorted(kernel_options.items())),
                mode=mode,
                dynamic=dynamic,
                layout=layout,
                score_mod=score_mod,
                score_closure=score_closure,
                **call_params,
            )
            for dt, (ql, kl, qr, kr), w, b, qh, kh, hd, layout in itertools.product(
                dtypes, lens, windows, batch, q_heads, kv_heads, head_dim, layouts
            )
        ]
    except ConfigError as e:
        head, _, rest = e.field.partition(".")
        key = _RECIPE_KEY.get(head, head) + (f".{rest}" if rest else "")
        if head in ("q_len", "kv_len", "q_range", "kv_range") and "seq_len" in matrix:
            key = "matrix.seq_len"
        raise RecipeError(path, key, e.reason, value=e.value, allowed=e.allowed) from None
    ids = [c.id for c in configs]
    if len(set(ids)) != len(ids):
        raise RecipeError(path, "matrix", "an axis lists the same value twice")
    call_params["score_mod"] = call.get("score_mod", "none")
    normalized = {
        "mask": mask,
        "windows": windows,
        "matrix": {
            "batch": batch,
            "q_heads": q_heads,
            "kv_heads": kv_heads,
            # [q, kv] per point; a dynamic range point adds its ranges: [q, kv, q_min, q_max, kv_min, kv_max]
            "lens": [[q, kv, *(qr or ()), *(kr or ())] for q, kv, qr, kr in lens],
            "head_dim": head_dim,
            "dtypes": dtypes,
            "graphs": list(graphs),
        },
        "compile": {"mode": mode, "dynamic": dynamic},
        "call": {
            "layout": layouts,
            **{k: list(v) if isinstance(v, tuple) else v for k, v in call_params.items()},
        },
        "kernel_options": dict(sorted(kernel_options.items())),
    }
    return configs, normalized


def _call_params(call: dict[str, Any]) -> dict[str, Any]:
    """The ``[call]`` keys (or a ``[[calls]]`` table's) as Config fields, with their defaults."""
    block_size = call.get("block_size", list(DEFAULT_BLOCK_SIZE))
    scale = call.get("scale")
    params = {
        "scale": float(scale) if isinstance(scale, int) and not isinstance(scale, bool) else scale,
        "return_lse": call.get("return_lse", False),
        "block_size": tuple(block_size) if isinstance(block_size, list) else (block_size, block_size),
        "score_mod": call.get("score_mod", "none"),
        "return_aux": call.get("return_aux", "none"),
        "mask_dims": call.get("mask_dims", "broadcast"),
        "alias": call.get("alias", "none"),
        "padded": call.get("padded", False),
    }
    if "enable_gqa" in call:
        params["enable_gqa"] = call["enable_gqa"]
    return params


def _function_or_name(path: str, key: str, value: object) -> tuple[Any, str | None]:
    """A mask or score_mod: a name (built-in, factory) as it is, or ``{ function = "module:qualname", closure =
    {...} }`` as (the function's name, its canonical closure JSON)."""
    if not isinstance(value, dict):
        return value, None
    unknown = sorted(set(value) - set(REF_KEYS))
    if unknown:
        raise RecipeError(path, f"{key}.{unknown[0]}", "unknown key", allowed=REF_KEYS, typo=unknown[0])
    function = _str(path, f"{key}.function", value.get("function"), required=True)
    for part in ("closure", "kwdefaults"):
        _table(path, f"{key}.{part}", value.get(part, {}))
    if "defaults" in value and not isinstance(value["defaults"], list):
        raise RecipeError(path, f"{key}.defaults", "must be a list", value=value["defaults"])
    try:
        return function, closures.closure_json(value)
    except (TypeError, ValueError) as e:  # a TOML date or time: not a value a function reference holds
        raise RecipeError(
            path, key, f"holds a value a function reference cannot: {e}", allowed="numbers, strings, booleans, tables"
        ) from None


def _calls(path: str, items: object, device: str) -> tuple[list[Config], list[int]]:
    """``[[calls]]``: one config per table (per bucket for a bucket range), each value a scalar (``graphs`` and
    ``block_size`` lists, length ranges); and the index of the table each config comes from."""
    if not isinstance(items, list) or not items or not all(isinstance(t, dict) for t in items):
        raise RecipeError(path, "calls", "must be a non-empty array of tables ([[calls]])", value=items)
    configs: list[Config] = []
    tables: list[int] = []
    for i, t in enumerate(items):
        where = f"calls[{i}]"
        _no_unknown(path, f"{where}.", t, _CALLS_KEYS)
        mask, mask_closure = _function_or_name(path, f"{where}.mask", _required(path, f"{where}.mask", t.get("mask")))
        params = _call_params(t)
        score_mod, score_closure = _function_or_name(path, f"{where}.score_mod", params.pop("score_mod"))
        lens = _lengths(path, f"{where}.", t, t.get("dynamic", False))
        if len(configs) + len(lens) > MAX_CONFIGS:
            raise RecipeError(
                path,
                where,
                f"brings the recipe to {len(configs) + len(lens)} configs, over the limit of {MAX_CONFIGS}",
                allowed="fewer buckets or calls",
            )
        q_heads = _required(path, f"{where}.q_heads", t.get("q_heads"))
        graphs = t.get("graphs", ["fwd"])
        options = _table(path, f"{where}.kernel_options", t.get("kernel_options", {}))
        try:
            if not isinstance(graphs, list):
                raise ConfigError("graphs", "must be a list", value=graphs, allowed=GRAPHS)
            configs += [
                Config(
                    device=device,  # type: ignore[arg-type]
                    mask=mask,
                    mask_closure=mask_closure,
                    window=t.get("window"),
                    batch=t.get("batch", 1),
                    q_heads=q_heads,  # type: ignore[arg-type]
                    kv_heads=t.get("kv_heads", q_heads),
                    q_len=q_len,
                    kv_len=kv_len,
                    q_range=q_range,
                    kv_range=kv_range,
                    head_dim=_required(path, f"{where}.head_dim", t.get("head_dim")),  # type: ignore[arg-type]
                    dtype=_required(path, f"{where}.dtype", t.get("dtype")),  # type: ignore[arg-type]
                    graphs=tuple(graphs),
                    kernel_options=tuple(sorted(options.items())),
                    mode=t.get("mode", "default"),
                    dynamic=t.get("dynamic", False),
                    layout=t.get("layout", "bhsd"),
                    score_mod=score_mod,
                    score_closure=score_closure,
                    **params,
                )
                for q_len, kv_len, q_range, kv_range in lens
            ]
        except ConfigError as e:
            head, _, rest = e.field.partition(".")
            key = {"mask_closure": "mask", "score_closure": "score_mod", "q_range": "q_len", "kv_range": "kv_len"}.get(
                head, head
            )
            if key in ("q_len", "kv_len") and "seq_len" in t:
                key = "seq_len"
            raise RecipeError(
                path, f"{where}.{key}" + (f".{rest}" if rest else ""), e.reason, value=e.value, allowed=e.allowed
            ) from None
        tables += [i] * (len(configs) - len(tables))
    return configs, tables


# one point of a recipe's lengths: (q_len, kv_len, q_range, kv_range); ranges only for a dynamic range
Lengths = list[tuple[int, int, "tuple[int, int] | None", "tuple[int, int] | None"]]
MAX_BUCKETS = 4096


def _lengths(path: str, prefix: str, table: dict[str, Any], dynamic: object) -> Lengths:
    """A table's length keys as points: ``seq_len`` (q_len == kv_len), or ``q_len`` with ``kv_len`` (a product of
    lists, or kv_len tied to q_len by ``{ offset = ... }``); each an integer, a list, buckets ``{ min, max, multiple
    }`` or, with ``dynamic = true``, a range ``{ min, max }``."""
    if "seq_len" in table:
        if "q_len" in table or "kv_len" in table:
            raise RecipeError(path, f"{prefix}seq_len", "give either seq_len or q_len and kv_len, not both")
        axis = _length_axis(path, f"{prefix}seq_len", table["seq_len"], dynamic)
        if isinstance(axis, tuple):
            n = _traced_length(axis)
            return [(n, n, axis, axis)]
        return [(n, n, None, None) for n in axis]
    if "q_len" not in table or "kv_len" not in table:
        missing = (
            "seq_len" if "q_len" not in table and "kv_len" not in table else "kv_len" if "q_len" in table else "q_len"
        )
        raise RecipeError(path, f"{prefix}{missing}", "missing", allowed="seq_len, or both q_len and kv_len")
    q_axis = _length_axis(path, f"{prefix}q_len", table["q_len"], dynamic)
    kv_value = table["kv_len"]
    if isinstance(kv_value, dict) and "offset" in kv_value:
        _no_unknown(path, f"{prefix}kv_len.", kv_value, ("offset",))
        if isinstance(q_axis, tuple):
            raise RecipeError(
                path,
                f"{prefix}kv_len.offset",
                "a dynamic q_len range takes a kv_len range, not an offset",
                allowed="kv_len = { min = ..., max = ... }",
            )
        offsets = _list(path, f"{prefix}kv_len.offset", kv_value["offset"])
        _no_more_than(path, f"{prefix}kv_len", len(q_axis) * len(offsets))
        for o in offsets:
            if isinstance(o, bool) or not isinstance(o, int):
                raise RecipeError(path, f"{prefix}kv_len.offset", "must be an integer or a list of them", value=o)
        points: Lengths = [(q, q + o, None, None) for q in q_axis for o in offsets]
        for q, kv, _, _ in points:
            if kv <= 0:
                raise RecipeError(path, f"{prefix}kv_len.offset", f"gives kv_len {kv} for q_len {q}", value=kv - q)
        return points
    kv_axis = _length_axis(path, f"{prefix}kv_len", kv_value, dynamic)
    if isinstance(q_axis, tuple) or isinstance(kv_axis, tuple):
        if not (isinstance(q_axis, tuple) and isinstance(kv_axis, tuple)):
            raise RecipeError(
                path,
                f"{prefix}{'kv_len' if isinstance(q_axis, tuple) else 'q_len'}",
                "with a dynamic range, q_len and kv_len are both ranges { min, max }",
            )
        q, kv = _traced_length(q_axis), _traced_length(kv_axis)
        if q == kv and kv < kv_axis[1]:
            kv += 1  # independent ranges are traced apart: equal traced lengths mean a seq_len range (Config.tied)
        return [(q, kv, q_axis, kv_axis)]
    if isinstance(table["q_len"], dict) and isinstance(kv_value, dict):
        raise RecipeError(
            path,
            f"{prefix}kv_len",
            "two bucket ranges would make every (q_len, kv_len) pair; tie kv_len to q_len instead",
            allowed="kv_len = { offset = N } or { offset = [N, ...] } (kv_len = q_len + offset), or a list",
        )
    _no_more_than(path, f"{prefix}kv_len", len(q_axis) * len(kv_axis))
    return [(q, kv, None, None) for q, kv in itertools.product(q_axis, kv_axis)]


def _no_more_than(path: str, key: str, count: int) -> None:
    if count > MAX_CONFIGS:
        raise RecipeError(path, key, f"makes {count} (q_len, kv_len) points, over the limit of {MAX_CONFIGS} configs")


def _length_axis(path: str, key: str, value: object, dynamic: object) -> list[int] | tuple[int, int]:
    """An integer or a list of them; buckets ``{ min, max, multiple }`` (every multiple from the first at or above
    min to the first at or above max); or, with dynamic = true, a range ``{ min, max }`` (returned as a tuple)."""
    if not isinstance(value, dict):
        return _int_axis(path, key, value)
    _no_unknown(path, f"{key}.", value, _RANGE_KEYS)
    lo, hi = (_required(path, f"{key}.{k}", value.get(k)) for k in ("min", "max"))
    for k, v in (("min", lo), ("max", hi)):
        if not positive_int(v):
            raise RecipeError(path, f"{key}.{k}", "must be a positive integer", value=v, allowed=INT_RANGE)
    assert isinstance(lo, int) and isinstance(hi, int)
    if lo > hi:
        raise RecipeError(path, f"{key}.max", f"is below min ({lo})", value=hi)
    multiple = value.get("multiple")
    if not isinstance(dynamic, bool):
        raise RecipeError(path, "compile.dynamic", "must be a boolean", value=dynamic, allowed=(True, False))
    if multiple is None:
        if dynamic is not True:
            raise RecipeError(
                path,
                key,
                "a range without `multiple` is one dynamic graph: it needs [compile] dynamic = true",
                value=value,
                allowed="add `multiple = N` (static buckets: the job pads each batch to one), or set "
                "[compile] dynamic = true",
            )
        return (lo, hi)
    if not positive_int(multiple):
        raise RecipeError(path, f"{key}.multiple", "must be a positive integer", value=multiple, allowed=INT_RANGE)
    if dynamic is True:
        raise RecipeError(
            path,
            f"{key}.multiple",
            "makes static buckets, but [compile] dynamic = true asks for one dynamic graph",
            allowed="drop `multiple` (one dynamic graph for the range) or set dynamic = false (buckets)",
        )
    first, last = -(-lo // multiple) * multiple, -(-hi // multiple) * multiple
    count = (last - first) // multiple + 1
    if count > MAX_BUCKETS:
        raise RecipeError(path, f"{key}.multiple", f"makes {count} buckets (at most {MAX_BUCKETS})", value=multiple)
    return list(range(first, last + 1, multiple))


def _traced_length(rng: tuple[int, int]) -> int:
    """The length a dynamic range is traced at: the middle. Any length of the range gives the same graph (kernelpack
    traces without duck sizing, see :func:`kernelpack.compiled.trace_settings`); the builder checks its ends."""
    return (rng[0] + rng[1]) // 2


def _graphs(path: str, matrix: dict[str, Any]) -> tuple[Graph, ...]:
    """``graphs = ["fwd", "fwd+bwd"]``, listed in any order, normalized to GRAPHS order."""
    items = _list(path, "matrix.graphs", matrix.get("graphs", ["fwd"]))
    for g in items:
        if g not in GRAPHS:
            raise RecipeError(path, "matrix.graphs", "unknown graph", value=g, allowed=GRAPHS)
    if len(set(items)) != len(items):
        raise RecipeError(path, "matrix.graphs", "lists a graph twice", value=items)
    return tuple(sorted(items, key=GRAPHS.index))  # type: ignore[arg-type]


def _no_unknown(path: str, prefix: str, table: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for key in table:
        if key not in allowed:
            raise RecipeError(path, prefix + key, "unknown key", allowed=allowed, typo=key)


def _required(path: str, key: str, value: object) -> object:
    if value is None:
        raise RecipeError(path, key, "missing")
    return value


def _str(path: str, key: str, value: object, *, required: bool = False) -> str:
    if value is None and required:
        raise RecipeError(path, key, "missing")
    if not isinstance(value, str):
        raise RecipeError(path, key, "must be a string", value=value)
    if required and not value:
        raise RecipeError(path, key, "must not be empty", value=value)
    return value


def _table(path: str, key: str, value: object, *, required: bool = False) -> dict[str, Any]:
    if value is None and required:
        raise RecipeError(path, f"[{key}]", "missing table")
    if not isinstance(value, dict):
        raise RecipeError(path, key, "must be a table", value=value)
    return value


def _list(path: str, key: str, value: object) -> list[Any]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise RecipeError(path, key, "must not be empty", value=value)
    return items


def _int_axis(path: str, key: str, value: object) -> list[int]:
    """An axis is one positive integer or a non-empty list of them."""
    items = _list(path, key, value)
    for v in items:
        if not positive_int(v):
            raise RecipeError(path, key, "must be a positive integer or a list of them", value=v, allowed=INT_RANGE)
    return items
