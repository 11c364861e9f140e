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
    seq_len = [256]                   # or q_len = [...] and kv_len = [...]
    head_dim = 64
    dtypes = ["float32"]
    backward = false

    [compile]
    dynamic = false                   # one static graph per shape (see README)
    mode = "default"

    [kernel_options]                  # passed verbatim to flex_attention
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import RecipeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

DEVICES = ("cuda", "cpu")
BUILTIN_MASKS = ("sliding_window", "sliding_window_bidirectional")
DTYPES = ("bfloat16", "float16", "float32")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

_TOP_KEYS = ("name", "description", "device", "mask", "windows", "matrix", "compile", "kernel_options")
_MATRIX_KEYS = ("batch", "q_heads", "kv_heads", "seq_len", "q_len", "kv_len", "head_dim", "dtypes", "backward")
_COMPILE_KEYS = ("mode", "dynamic")


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """One compiled call: a point of the recipe's matrix. Everything that changes a cache key is here."""

    device: str
    mask: str
    window: int | None
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str
    backward: bool
    kernel_options: tuple[tuple[str, Any], ...] = ()
    mode: str = "default"
    dynamic: bool = False

    @property
    def enable_gqa(self) -> bool:
        return self.q_heads != self.kv_heads

    def to_dict(self) -> dict[str, Any]:
        d = {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]
        d["kernel_options"] = dict(self.kernel_options)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        d = dict(d)
        d.pop("id", None)
        d["kernel_options"] = tuple(sorted(d.get("kernel_options", {}).items()))
        return cls(**d)

    @property
    def id(self) -> str:
        """Stable across processes, machines and Python versions: a hash of the normalized parameters."""
        return hashlib.sha256(_canonical_json(self.to_dict()).encode()).hexdigest()[:12]

    def describe(self) -> str:
        window = f" window={self.window}" if self.window is not None else ""
        lens = f"seq={self.q_len}" if self.q_len == self.kv_len else f"q_len={self.q_len} kv_len={self.kv_len}"
        return (
            f"{self.id} [{self.device} {self.mask}{window} B={self.batch} Hq={self.q_heads} Hkv={self.kv_heads} "
            f"{lens} D={self.head_dim} {self.dtype}{' fwd+bwd' if self.backward else ' fwd'}]"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    name: str
    description: str
    device: str
    mask: str
    configs: tuple[Config, ...]
    normalized: dict[str, Any] = field(hash=False, compare=False)
    path: str = ""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(_canonical_json(self.normalized).encode()).hexdigest()


def _canonical_json(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def load_recipe(path: str | Path) -> Recipe:
    path = str(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise RecipeError(path, "<file>", "recipe file not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise RecipeError(path, "<toml>", f"not valid TOML: {e}") from None
    except OSError as e:
        raise RecipeError(path, "<file>", f"cannot read: {type(e).__name__}: {e}") from None
    return parse_recipe(data, path=path)


def parse_recipe(data: dict[str, Any], *, path: str = "<recipe>") -> Recipe:
    """Validate ``data`` (a parsed TOML document) and expand it. Raises :class:`RecipeError`, never anything else."""
    _no_unknown(path, "", data, _TOP_KEYS)
    name = _str(path, "name", data.get("name"), required=True)
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise RecipeError(path, "name", "must be letters, digits, '-', '_' or '.' (it names the artifact)", value=name)
    description = _str(path, "description", data.get("description", ""))
    device = _choice(path, "device", data.get("device"), DEVICES, required=True)

    mask = _str(path, "mask", data.get("mask"), required=True)
    if mask not in BUILTIN_MASKS and not _is_import_path(mask):
        raise RecipeError(path, "mask", "unknown mask", value=mask, allowed=(*BUILTIN_MASKS, "'pkg.module:factory'"))
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
    if "seq_len" in matrix:
        if "q_len" in matrix or "kv_len" in matrix:
            raise RecipeError(path, "matrix.seq_len", "give either seq_len or q_len and kv_len, not both")
        lens = [(n, n) for n in _int_axis(path, "matrix.seq_len", matrix["seq_len"])]
    elif "q_len" in matrix and "kv_len" in matrix:
        lens = list(
            itertools.product(
                _int_axis(path, "matrix.q_len", matrix["q_len"]), _int_axis(path, "matrix.kv_len", matrix["kv_len"])
            )
        )
    else:
        raise RecipeError(path, "matrix.seq_len", "missing", allowed="seq_len, or both q_len and kv_len")
    dtypes_raw = _required(path, "matrix.dtypes", matrix.get("dtypes"))
    dtypes = _list(path, "matrix.dtypes", dtypes_raw)
    for d in dtypes:
        _choice(path, "matrix.dtypes", d, DTYPES)
    backward = matrix.get("backward", False)
    if not isinstance(backward, bool):
        raise RecipeError(path, "matrix.backward", "must be a boolean", value=backward, allowed=(True, False))
    if backward and device == "cpu":
        raise RecipeError(
            path,
            "matrix.backward",
            "compiled flex_attention has no backward on CPU",
            value=True,
            allowed="false when device = 'cpu'",
        )

    compile_opts = _table(path, "compile", data.get("compile", {}))
    _no_unknown(path, "compile.", compile_opts, _COMPILE_KEYS)
    mode = _choice(path, "compile.mode", compile_opts.get("mode", "default"), COMPILE_MODES)
    dynamic = compile_opts.get("dynamic", False)
    if not isinstance(dynamic, bool):
        raise RecipeError(path, "compile.dynamic", "must be a boolean", value=dynamic, allowed=(True, False))

    kernel_options = _table(path, "kernel_options", data.get("kernel_options", {}))
    for k, v in kernel_options.items():
        if not isinstance(v, (bool, int, float, str)):
            raise RecipeError(path, f"kernel_options.{k}", "must be a scalar", value=v, allowed="bool, int, float, str")

    for qh, kh in itertools.product(q_heads, kv_heads):
        if qh % kh:
            raise RecipeError(
                path,
                "matrix.kv_heads",
                f"q_heads={qh} is not a multiple of kv_heads={kh} (GQA needs q_heads % kv_heads == 0)",
                value=kh,
            )

    configs = tuple(
        Config(
            device=device,
            mask=mask,
            window=w,
            batch=b,
            q_heads=qh,
            kv_heads=kh,
            q_len=ql,
            kv_len=kl,
            head_dim=hd,
            dtype=dt,
            backward=backward,
            kernel_options=tuple(sorted(kernel_options.items())),
            mode=mode,
            dynamic=dynamic,
        )
        for dt, (ql, kl), w, b, qh, kh, hd in itertools.product(
            dtypes, lens, windows, batch, q_heads, kv_heads, head_dim
        )
    )
    ids = [c.id for c in configs]
    if len(set(ids)) != len(ids):
        raise RecipeError(path, "matrix", "an axis lists the same value twice")
    normalized = {
        "name": name,
        "description": description,
        "device": device,
        "mask": mask,
        "windows": windows,
        "matrix": {
            "batch": batch,
            "q_heads": q_heads,
            "kv_heads": kv_heads,
            "lens": [list(x) for x in lens],
            "head_dim": head_dim,
            "dtypes": dtypes,
            "backward": backward,
        },
        "compile": {"mode": mode, "dynamic": dynamic},
        "kernel_options": dict(sorted(kernel_options.items())),
    }
    return Recipe(
        name=name, description=description, device=device, mask=mask, configs=configs, normalized=normalized, path=path
    )


def _is_import_path(s: str) -> bool:
    module, sep, attr = s.partition(":")
    return bool(sep and module and attr) and all(p.isidentifier() for p in (*module.split("."), *attr.split(".")))


def _no_unknown(path: str, prefix: str, table: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for key in table:
        if key not in allowed:
            raise RecipeError(path, prefix + key, "unknown key", allowed=allowed)


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


def _choice(path: str, key: str, value: object, allowed: tuple[str, ...], *, required: bool = False) -> str:
    if value is None and required:
        raise RecipeError(path, key, "missing", allowed=allowed)
    if value not in allowed:
        raise RecipeError(path, key, "unknown value", value=value, allowed=allowed)
    return value  # type: ignore[return-value]


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
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise RecipeError(path, key, "must be a positive integer or a list of them", value=v)
    return items
