"""The manifest: what an artifact holds and covers, typed. :class:`Manifest` is its one owner: parsed and validated
in one place (:meth:`Manifest.from_json`, :meth:`Manifest.from_dict`) whoever reads it, written in one place
(:meth:`Manifest.to_dict`, sealed by :func:`seal`); it answers which (config, device) pairs the artifact holds
(:meth:`Manifest.pairs`), whether it covers a call (:meth:`Manifest.covers`) and what length to pad a batch to
(:meth:`Manifest.padded_lengths`). The archive around it (pack, read, unpack, merge) is :mod:`kernelpack.artifact`.

Parsing a hostile manifest costs time and memory linear in its size: every list is bounded before any other work on
it (docs/RELIABILITY.md). Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
import posixpath
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import settings
from ._version import __version__
from .config import MAX_CONFIGS, Config
from .errors import ArtifactError, ConfigError, KernelpackError
from .keys import BuildKey, differences
from .parts import TIER1_ONLY as TIER1_ONLY  # re-exported: the manifest's readers ask it about parts
from .parts import Part as Part
from .parts import owner as owner
from .parts import parse_parts
from .recipe import check_name
from .signature import GRAPHS, CallSignature, Graph, mask_key

# 5: manifest_sha256 seals the manifest itself. Format 4's manifest was checked only where the installer reads it, so a
# flipped bit in the recipe text, a timing or an unused field installed silently (34 of 60 flips at cf50a64).
# 6: a config's id hashes every parameter (5's left out those at their defaults since ranges came), each config lists
# its devices (no top-level device_index), recipes say graphs (no backward = true).
# 7: the archive is one zstd frame per part (:class:`Part`): a process installs the parts of the signatures it calls,
# not the whole artifact.
FORMAT_VERSION = 7


SEAL = "manifest_sha256"


# Tier 2's functions (kernelpack.precompiled), in the cache tree beside tier 1's files: packed, hashed and installed
# with them
PRECOMPILED_DIR = "kernelpack-precompiled"


MANIFEST_NAME = "manifest.json"


# Bounds on what one manifest may list, checked before any other work on it, so that parsing a hostile manifest costs
# time and memory linear in its size (docs/RELIABILITY.md). Inductor's paths are 4-6 parts, under 300 characters.
MAX_FILES = 50_000


MAX_PATH_PARTS = 32


MAX_PATH_CHARS = 512


MAX_DEVICES = 64  # device indices per config


MAX_SIGNATURES = 200_000  # configs x devices x graphs: the manifest's coverage index


# Never shipped: inductor's lock files, kernelpack's own bookkeeping, half-written temporaries.
_SKIP_DIRS = {"locks", ".kernelpack"}


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str  # relative to the cache dir, POSIX separators
    size: int
    sha256: str


def is_shipped(rel: str) -> bool:
    parts = rel.split("/")
    name = parts[-1]
    return not (parts[0] in _SKIP_DIRS or name.endswith(".lock") or name.startswith("tmp") or ".tmp" in name)


def created_now() -> int:
    """A build's time stamp; SOURCE_DATE_EPOCH (reproducible-builds convention) fixes it, so rebuilds are identical."""
    fixed = settings.source_date_epoch()
    return int(time.time()) if fixed is None else fixed


@dataclass(frozen=True, kw_only=True, slots=True)
class Precompiled:
    """Tier 2: one graph's aot-compiled function on one device index, a file of the artifact."""

    device: int
    graph: Graph
    # relative to the cache dir, listed in the manifest's files; named by its content (precompiled.file_name), so a
    # rebuilt artifact's function never lands on an older build's path in a shared cache dir
    path: str
    sha256: str  # of the file's bytes: the runtime loads (unpickles) it only when they hash to this
    seconds: float = 0.0  # what aot_compile took in the builder


@dataclass(frozen=True, slots=True)
class BuiltConfig:
    """A config the artifact holds, on the device indices it was built and checked on."""

    config: Config
    devices: tuple[int, ...]
    mask_key: str  # what the builder's mask_mod computes (signature.mask_key): the runtime matches calls by it
    # the mask's values (kernelpack.functions paths) its dynamic graph keeps symbolic, as Dynamo's guards say: they
    # enter mask_key by type, so one entry covers a call whatever their values (DFlash's S); () for a static config
    mask_free: tuple[str, ...] = ()
    # what its dynamic graph was traced with symbolic (kernelpack.canonical.marks: "key.shape[2]",
    # "block_mask.mask_mod.context"); the runtime traces a first call with the same marks, so that it makes the
    # graph the builder cached; () for a static config
    marks: tuple[str, ...] = ()
    score_key: str = ""  # what its score_mod computes (signature.score_mod_key); "": the declared none/identity
    compile_seconds: float = 0.0  # the slowest device's first call in the builder
    compile_seconds_by_device: tuple[tuple[int, float], ...] = ()
    max_rel_error: float = 0.0  # against the float64 reference
    precompiled: tuple[Precompiled, ...] = ()  # tier 2's functions; the inductor cache serves every other graph
    not_precompiled: str = ""  # why a graph has no tier-2 function ("" when every graph has one)

    @property
    def id(self) -> str:
        return self.config.id

    def mask_key_of(self, mask_mod: Any) -> str:
        """A mask_mod's key as this entry keys masks (its free values by type)."""
        return mask_key(mask_mod, self.mask_free)

    def precompiled_for(self, device: int, graph: Graph) -> Precompiled | None:
        return next((p for p in self.precompiled if p.device == device and p.graph == graph), None)

    def signatures(self, device_index: int) -> tuple[CallSignature, ...]:
        """The calls this entry serves on one device: one per graph built."""
        return self.config.signatures(device_index, self.mask_key, self.score_key or None)


def _differences(covered: CallSignature, built: BuiltConfig, call: CallSignature) -> tuple[tuple[str, Any, Any], ...]:
    """What differs between a covered signature and a call; for a dynamic range config, the lengths against its
    ranges ("1024..16384"), and its dynamic graph is not a difference (kernelpack picks it)."""
    c = built.config
    if c.q_range is None or c.kv_range is None:
        return tuple(covered.differences(call))
    diffs = []
    for name, a, b in covered.differences(call):
        if name == "dynamic":
            continue
        if name in ("q_len", "kv_len"):
            lo, hi = c.q_range if name == "q_len" else c.kv_range
            if lo <= b <= hi:
                continue
            a = f"{lo}..{hi}"
        diffs.append((name, a, b))
    return tuple(diffs)


@dataclass(frozen=True, kw_only=True, slots=True)
class FailedConfig:
    config: Config
    device: int
    error: str


@dataclass(frozen=True, slots=True)
class Nearest:
    """A covered signature near a call that missed, and what differs: (field, covered value, call's value)."""

    signature: CallSignature
    config_id: str
    differences: tuple[tuple[str, Any, Any], ...]

    def describe(self) -> str:
        diffs = ", ".join(f"{name} {a!r} vs {b!r}" for name, a, b in self.differences)
        return f"{self.signature.describe()} (differs in: {diffs})"


@dataclass(frozen=True, slots=True)
class Coverage:
    """The answer to "does this artifact serve this call?": the serving entry, or the nearest covered signatures."""

    signature: CallSignature
    entry: BuiltConfig | None
    nearest: tuple[Nearest, ...] = ()

    @property
    def covered(self) -> bool:
        return self.entry is not None

    @property
    def only(self) -> tuple[str, Any, Any] | None:
        """(field, covered value, call's value) when the nearest covered signature differs in that one field: the
        fix is often not the shape (device index: pinning or --devices; graph: the recipe's graphs)."""
        if self.nearest and len(self.nearest[0].differences) == 1:
            return self.nearest[0].differences[0]
        return None


# the fields of a call signature that a dynamic range config's coverage compares exactly (every one but the lengths
# and whether the graph is dynamic: the config's traced call has its own)
_LENGTHLESS = operator.attrgetter(
    *(f.name for f in dataclasses.fields(CallSignature) if f.name not in ("q_len", "kv_len", "dynamic"))
)


def _lengthless(signature: CallSignature) -> tuple[Any, ...]:
    return _LENGTHLESS(signature)  # type: ignore[no-any-return]


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    name: str  # the artifact's file name
    recipe: Mapping[str, Any] = field(hash=False)  # the normalized recipe and its sha256
    build_key: BuildKey
    configs: tuple[BuiltConfig, ...]
    files: Mapping[str, FileEntry] = field(hash=False)  # path -> entry, sorted by path
    failed: tuple[FailedConfig, ...] = ()
    created: int = 0
    kernelpack_version: str = __version__
    shard: str | None = None  # "i/n" for one shard of a recipe (build --shard)
    merged_from: tuple[str, ...] = ()
    # the archive's frames after manifest.json's, which partition ``files`` (the packer writes them; () before packing)
    parts: tuple[Part, ...] = field(default=(), hash=False)
    # the builder's settings that enter inductor's cache keys (compiled.key_settings); empty in older artifacts
    key_settings: Mapping[str, str] = field(default_factory=dict, hash=False)
    # the coverage index, signature -> config, made on first use: reading a manifest (inspect, push, ls) needs none,
    # and for the largest manifest the bounds allow it is 200,000 signatures (seconds, hundreds of MiB)
    _lazy_index: dict[CallSignature, BuiltConfig] | None = field(
        init=False, default=None, repr=False, compare=False, hash=False
    )
    # the dynamic range configs' signatures at their traced lengths, by the rest of the signature
    # (:func:`_lengthless`): a call is covered by one when its lengths are in the config's ranges
    _lazy_ranged: dict[tuple[Any, ...], list[tuple[CallSignature, BuiltConfig]]] | None = field(
        init=False, default=None, repr=False, compare=False, hash=False
    )
    _free_sets: tuple[tuple[str, ...], ...] = field(init=False, repr=False, compare=False, hash=False)
    _by_value: bool = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_free_sets", tuple(dict.fromkeys(c.mask_free for c in self.configs if c.mask_free)))
        object.__setattr__(self, "_by_value", any(not c.mask_free for c in self.configs))

    @property
    def _index(self) -> dict[CallSignature, BuiltConfig]:
        if self._lazy_index is None:
            index = {s: c for c in self.configs for d in c.devices for s in c.signatures(d)}
            ranged: dict[tuple[Any, ...], list[tuple[CallSignature, BuiltConfig]]] = {}
            for s, built in index.items():
                if built.config.q_range is not None and self.traced(s, built) == s:
                    ranged.setdefault(_lengthless(s), []).append((s, built))
            object.__setattr__(self, "_lazy_ranged", ranged)  # before the index: a reader that sees it sees both
            object.__setattr__(self, "_lazy_index", index)
            return index
        return self._lazy_index

    @property
    def free_sets(self) -> tuple[tuple[str, ...], ...]:
        """The distinct non-empty :attr:`BuiltConfig.mask_free` of the configs: the ways a call's mask is keyed
        besides by every value."""
        return self._free_sets

    @property
    def keys_by_value(self) -> bool:
        """Whether some config keys a call's mask by every value (a static config, or one whose graph keeps no
        closure value free): otherwise a call's mask is keyed by :attr:`free_sets` alone."""
        return self._by_value

    def entry_for(self, signature: CallSignature) -> BuiltConfig | None:
        """The entry that serves a call with this signature, or None (:meth:`covers` without the nearest)."""
        found = self.resolve(signature)
        return found[0] if found is not None else None

    def resolve(self, signature: CallSignature) -> tuple[BuiltConfig, CallSignature] | None:
        """The entry that serves a call with this signature and the signature it was built at: the call's own, or
        for a dynamic range config the call at the config's traced lengths (:meth:`traced`: what its warm-up and
        precompiled function are keyed by); None when nothing serves it. One dict lookup for each, not a
        signature made per range config: a served call asks this."""
        index = self._index
        entry = index.get(signature)
        if entry is not None:
            return entry, signature
        assert self._lazy_ranged is not None
        for built_at, built in self._lazy_ranged.get(_lengthless(signature), ()):
            if built.config.covers_lengths(signature.q_len, signature.kv_len):
                return built, built_at
        return None

    @property
    def recipe_name(self) -> str:
        return str(self.recipe["name"])

    @property
    def total_size(self) -> int:
        return sum(e.size for e in self.files.values())

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device index some config is built on."""
        return tuple(sorted({d for c in self.configs for d in c.devices}))

    @property
    def signatures(self) -> tuple[CallSignature, ...]:
        """Every call the artifact serves, one per (config, device index, graph)."""
        return tuple(self._index)

    def parts_for(self, owner_: str, *, tier1: bool = False) -> tuple[int, ...]:
        """The indices of the parts a signature of ``owner_`` (:func:`owner`) needs: with ``tier1``, for a trace."""
        return tuple(i for i, p in enumerate(self.parts) if p.serves(owner_, tier1=tier1))

    def owners(self) -> dict[str, set[str]]:
        """Each file's owners, as its part says (a repack or a merge keeps them)."""
        return {rel: set(p.owners) for p in self.parts for rel in p.files}

    def pairs(self) -> list[tuple[BuiltConfig, int]]:
        """Every (config, device index) the artifact holds: what verify runs and the runtime covers."""
        return [(c, d) for c in self.configs for d in c.devices]

    def covers(self, signature: CallSignature, *, nearest: int = 3) -> Coverage:
        """Whether a call with this signature is served, and by which entry; on a miss, the ``nearest`` covered
        signatures (fewest differing fields first) with their differences."""
        entry = self.entry_for(signature)
        if entry is not None:
            return Coverage(signature, entry)
        ranked = sorted(
            ((s, c, _differences(s, c, signature)) for s, c in self._index.items()),
            key=lambda x: (len(x[2]), x[0].describe()),
        )
        return Coverage(signature, None, tuple(Nearest(s, c.id, d) for s, c, d in ranked[:nearest]))

    def padded_lengths(
        self, q_len: int, kv_len: int, *, tied: bool = False, where: Callable[[Config], bool] | None = None
    ) -> Any:
        """(q_len, kv_len) padded to what this artifact serves: themselves when a dynamic range covers them, else
        the smallest covered (bucket q_len, bucket kv_len) at or above them (the least padded work). ``tied``: only
        q_len == kv_len points, and return the one length. ``where``: only the configs it accepts. Raises
        :class:`KernelpackError` when nothing covers them."""
        for n in (q_len, kv_len):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise KernelpackError(
                    f"padded_length({n!r}): a length is a positive int", hint="pass the batch's length"
                )
        fits: list[tuple[int, int]] = []  # the static buckets that hold the lengths
        longest = 0
        for built in self.configs:
            c = built.config
            if where is not None and not where(c):
                continue
            if c.q_range is not None and c.kv_range is not None:
                if c.covers_lengths(q_len, kv_len):
                    return q_len if tied else (q_len, kv_len)
                longest = max(longest, c.q_range[1])
                continue
            if tied and c.q_len != c.kv_len:
                continue
            longest = max(longest, c.q_len)
            if c.q_len >= q_len and c.kv_len >= kv_len:
                fits.append((c.q_len, c.kv_len))
        if not fits:
            asked = f"{q_len} tokens (q_len == kv_len)" if tied else f"q_len {q_len}, kv_len {kv_len}"
            longest_text = f"the longest covered q_len is {longest}" if longest else "it covers no such length"
            raise KernelpackError(
                f"{self.name} has no bucket or range that holds {asked} ({longest_text})",
                hint="truncate or drop longer sequences, or raise the recipe's max and rebuild; for q_len != kv_len "
                "(kv_len = { offset = ... }) ask padded_lengths(q_len, kv_len)",
            )
        best = min(fits, key=lambda qk: (qk[0] * qk[1], qk[0]))  # the least padded work
        return best[0] if tied else best

    @staticmethod
    def traced(signature: CallSignature, built: BuiltConfig) -> CallSignature:
        """The call as a dynamic range config's builder made it: its traced lengths, and the dynamic graph
        (``kernelpack.flex_attention`` picks it; the caller does not say dynamic=True)."""
        c = built.config
        return dataclasses.replace(signature, q_len=c.q_len, kv_len=c.kv_len, dynamic=True)

    # ------------------------------------------------------------------------------------------------ JSON

    def inputs_sha256(self) -> str:
        """A hash of what the build was asked to make, not of what it made: the recipe, the build key and the
        settings in inductor's keys, kernelpack's version, and per config its parameters, devices and keys, and
        which failed. Two builds of one recipe on one torch build share it, though their bytes differ: torch's
        cache entries hold compile timings and the C++ kernels' .so files differ between links, and
        the manifest holds timings and the build time. ``push`` recognises a rebuild by it. Not an input: how the
        build was split (``merged_from`` names the shards, in the order merge was given them), so a plain build
        and a merge of shards of one recipe, in any order and any count, share it."""
        d = self.to_dict()
        top = ("format", "kernelpack_version", "recipe", "build_key", "key_settings", "devices", "shard")
        inputs = {
            **{k: d.get(k) for k in top},
            "configs": [
                {k: c.get(k) for k in ("id", "params", "devices", "mask_key", "mask_free", "marks", "score_key")}
                for c in d["configs"]
            ],
            "failed": sorted((f["id"], f["device"]) for f in d["failed"]),
        }
        return hashlib.sha256(json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        devices = list(self.devices)
        d: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "kernelpack_version": self.kernelpack_version,
            "name": self.name,
            "created": self.created,
            "recipe": dict(self.recipe),
            "configs": [
                {
                    "id": c.id,
                    "params": c.config.to_dict(),
                    "devices": list(c.devices),
                    "mask_key": c.mask_key,
                    **({"mask_free": list(c.mask_free)} if c.mask_free else {}),
                    **({"marks": list(c.marks)} if c.marks else {}),
                    **({"score_key": c.score_key} if c.score_key else {}),
                    "compile_seconds": c.compile_seconds,
                    "compile_seconds_by_device": {str(dev): s for dev, s in c.compile_seconds_by_device},
                    "max_rel_error": c.max_rel_error,
                    **({"precompiled": [dataclasses.asdict(p) for p in c.precompiled]} if c.precompiled else {}),
                    **({"not_precompiled": c.not_precompiled} if c.not_precompiled else {}),
                }
                for c in self.configs
            ],
            "failed": [
                {"id": f.config.id, "device": f.device, "params": f.config.to_dict(), "error": f.error}
                for f in self.failed
            ],
            "build_key": self.build_key.to_dict(),
            "devices": devices,  # every index of some config
            "files": [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in self.files.values()],
            "total_size": self.total_size,
        }
        if self.shard is not None:
            d["shard"] = self.shard
        if self.merged_from:
            d["merged_from"] = list(self.merged_from)
        if self.parts:
            d["parts"] = [
                {
                    "owners": list(p.owners),
                    "tier1": p.tier1,
                    "files": list(p.files),
                    "offset": p.offset,
                    "size": p.size,
                    **({"dictionary": p.dictionary} if p.dictionary is not None else {}),
                }
                for p in self.parts
            ]
        if self.key_settings:
            d["key_settings"] = dict(self.key_settings)
        return d

    def to_json(self) -> bytes:
        return seal(self.to_dict())

    @classmethod
    def from_json(cls, blob: bytes, *, source: str) -> Manifest:
        """Parse a manifest as written to an artifact: its seal must match before anything in it is believed."""
        try:
            data = json.loads(blob)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ArtifactError(source, f"manifest.json is not valid JSON: {type(e).__name__}: {e}") from None
        if isinstance(data, dict) and data.get("format") == FORMAT_VERSION:
            data = dict(data)
            sealed = data.pop(SEAL, None)
            if sealed is None:
                raise ArtifactError(source, f"manifest.json has no {SEAL}: it was not written by kernelpack's packer")
            if sealed != _seal_of(data, source):
                raise ArtifactError(
                    source,
                    f"manifest.json does not match its {SEAL} ({str(sealed)[:12]}...): it changed after it was "
                    "written (a flipped bit in storage or transfer, or a hand edit); fetch or build the artifact again",
                )
        return cls.from_dict(data, source=source)

    @classmethod
    def from_dict(cls, data: object, *, source: str) -> Manifest:
        """Validate and type a manifest; ``source`` names it in errors (:class:`ArtifactError`)."""
        if not isinstance(data, dict):
            raise ArtifactError(source, "manifest.json is not a JSON object")
        fmt = data.get("format")
        if fmt != FORMAT_VERSION:
            raise ArtifactError(source, f"unsupported artifact format {fmt!r} (this kernelpack reads {FORMAT_VERSION})")
        where = "manifest.json"
        try:
            files = _files(source, data["files"])
            where = "recipe"
            recipe = data["recipe"]
            if not isinstance(recipe, dict):
                raise TypeError("must be an object")
            problem = check_name(recipe.get("name"))
            if problem:
                raise ValueError(f"name {recipe.get('name')!r} {problem}")
            where = "build_key"
            key_data = data["build_key"]
            if not isinstance(key_data, dict) or not all(isinstance(v, str) for v in key_data.values()):
                raise TypeError("must be an object of strings")
            build_key = BuildKey.from_dict(key_data)
            where = "configs"
            if len(_list(data["configs"])) > MAX_CONFIGS:
                raise ValueError(f"{len(data['configs'])} configs, over the limit of {MAX_CONFIGS}")
            configs = tuple(_built_config(c) for c in _list(data["configs"]))
            signatures = sum(len(c.devices) * len(c.config.graphs) for c in configs)
            if signatures > MAX_SIGNATURES:
                raise ValueError(f"{signatures} covered calls, over the limit of {MAX_SIGNATURES}")
            for c in configs:
                for p in c.precompiled:
                    if p.path not in files:
                        raise ValueError(f"config {c.id}: precompiled {p.path!r} is not among the files")
                    if files[p.path].sha256 != p.sha256:
                        raise ValueError(f"config {c.id}: precompiled {p.path!r} has another sha256 in the files")
            where = "failed"
            failed = tuple(
                FailedConfig(config=_config(f), device=_index(f.get("device", 0)), error=str(f.get("error", "")))
                for f in _list(data.get("failed", []))
            )
            where = "manifest.json"
            for name in ("name", "kernelpack_version"):
                if not isinstance(data.get(name, ""), str):
                    raise TypeError(f"{name} must be a string")
            created = data.get("created", 0)
            if not isinstance(created, int) or isinstance(created, bool):
                raise TypeError("created must be an integer")
            shard = data.get("shard")
            merged_from = _list(data.get("merged_from", []))
            where = "parts"
            parts = parse_parts(data.get("parts"), files, lambda: {c.id: c.devices for c in configs})
            where = "key_settings"
            key_settings = data.get("key_settings", {})
            if not isinstance(key_settings, dict) or not all(isinstance(v, str) for v in key_settings.values()):
                raise TypeError("must be an object of strings")
            where = "manifest.json"
            return cls(
                name=data["name"],
                recipe=recipe,
                build_key=build_key,
                configs=configs,
                files=files,
                failed=failed,
                created=created,
                kernelpack_version=data.get("kernelpack_version", "?"),
                shard=None if shard is None else str(shard),
                merged_from=tuple(str(m) for m in merged_from),
                parts=parts,
                key_settings=key_settings,
            )
        except ConfigError as e:
            raise ArtifactError(source, f"manifest.json is malformed: {where}: {e}") from None
        except KernelpackError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ArtifactError(source, f"manifest.json is malformed: {where}: {type(e).__name__}: {e}") from None


def _seal_of(data: Mapping[str, Any], source: str) -> str:
    """The sha256 of ``data``'s canonical JSON: sorted keys, no spaces, ASCII; what :func:`seal` writes."""
    try:
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    except (TypeError, ValueError, RecursionError) as e:
        raise ArtifactError(source, f"manifest.json cannot be sealed: {type(e).__name__}: {e}") from None
    return hashlib.sha256(canonical.encode()).hexdigest()


def seal(data: Mapping[str, Any]) -> bytes:
    """``data`` as manifest.json bytes, with :data:`SEAL` over everything else in it.

    The seal is computed over the JSON round trip of ``data`` (what a reader will parse), so a tuple, a float's
    repr or a key order cannot make the reader's digest differ from the writer's."""
    plain = json.loads(json.dumps({k: v for k, v in data.items() if k != SEAL}))
    return (json.dumps({**plain, SEAL: _seal_of(plain, MANIFEST_NAME)}, sort_keys=True, indent=1) + "\n").encode()


def _list(value: object) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return value


def _index(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"bad device index {value!r}")
    return value


def _number(value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _config(entry: object) -> Config:
    if not isinstance(entry, dict) or not isinstance(entry.get("params"), dict):
        raise TypeError("each config must be an object with params")
    return Config.from_dict(entry["params"])


def _devices(value: object) -> tuple[int, ...]:
    items = _list(value)
    if len(items) > MAX_DEVICES:
        raise ValueError(f"{len(items)} devices, over the limit of {MAX_DEVICES}")
    return tuple(sorted({_index(d) for d in items}))


def _built_config(entry: object) -> BuiltConfig:
    config = _config(entry)
    assert isinstance(entry, dict)
    by_device = entry.get("compile_seconds_by_device", {})
    if not isinstance(by_device, dict):
        raise TypeError("compile_seconds_by_device must be an object")
    key = entry.get("mask_key")
    if not isinstance(key, str):
        raise TypeError("mask_key must be a string")
    free = _list(entry.get("mask_free", []))
    if not all(isinstance(p, str) for p in free):
        raise TypeError("mask_free must be a list of strings")
    marks = _list(entry.get("marks", []))
    if not all(isinstance(p, str) for p in marks):
        raise TypeError("marks must be a list of strings")
    score_key = entry.get("score_key", "")
    if not isinstance(score_key, str):
        raise TypeError("score_key must be a string")
    not_precompiled = entry.get("not_precompiled", "")
    if not isinstance(not_precompiled, str):
        raise TypeError("not_precompiled must be a string")
    devices = _devices(entry["devices"])
    functions = tuple(_precompiled(p) for p in _list(entry.get("precompiled", [])))
    pairs = [(p.device, p.graph) for p in functions]
    for device, graph in pairs:
        if pairs.count((device, graph)) > 1 or device not in devices or graph not in config.graphs:
            raise ValueError(f"precompiled ({device}, {graph!r}) is listed twice, or not a built device and graph")
    return BuiltConfig(
        config=config,
        devices=devices,
        mask_key=key,
        mask_free=tuple(free),
        marks=tuple(marks),
        score_key=score_key,
        compile_seconds=_number(entry.get("compile_seconds", 0.0)),
        compile_seconds_by_device=tuple(sorted((_index(int(k)), _number(v)) for k, v in by_device.items())),
        max_rel_error=_number(entry.get("max_rel_error", 0.0)),
        precompiled=functions,
        not_precompiled=not_precompiled,
    )


def _precompiled(entry: object) -> Precompiled:
    if not isinstance(entry, dict):
        raise TypeError("each precompiled entry must be an object")
    graph, path = entry.get("graph"), entry.get("path")
    if graph not in GRAPHS:
        raise ValueError(f"precompiled graph must be one of {list(GRAPHS)}, got {graph!r}")
    if not isinstance(path, str) or not path.startswith(PRECOMPILED_DIR + "/") or ".." in path.split("/"):
        raise ValueError(f"precompiled path must be a file under {PRECOMPILED_DIR}/, got {path!r}")
    sha = entry.get("sha256")
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha) or sha[:32] not in path:
        raise ValueError(f"precompiled sha256 must be the 64 hex digits its path is named by, got {sha!r} for {path!r}")
    return Precompiled(
        device=_index(entry.get("device")),
        graph=graph,  # type: ignore[arg-type]  # checked against GRAPHS above
        path=path,
        sha256=sha,
        seconds=_number(entry.get("seconds", 0.0)),
    )


def _files(source: str, raw: object) -> dict[str, FileEntry]:
    files: dict[str, FileEntry] = {}
    if len(_list(raw)) > MAX_FILES:
        raise ArtifactError(source, f"manifest.json lists {len(_list(raw))} files, over the limit of {MAX_FILES}")
    for f in _list(raw):
        size = f["size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"bad size {size!r} for {f.get('path')!r}")
        entry = FileEntry(str(f["path"]), size, str(f["sha256"]))
        check_member_name(source, entry.path)
        if len(entry.sha256) != 64:
            raise ValueError(f"bad sha256 for {entry.path!r}")
        if entry.path in files:
            raise ValueError(f"file listed twice: {entry.path!r}")
        files[entry.path] = entry
    # A path that is also another path's directory could only fail half-way through an install.
    dirs = {rel.rsplit("/", 1)[0] for rel in files if "/" in rel}
    parents = {"/".join(d.split("/")[: i + 1]) for d in dirs for i in range(d.count("/") + 1)}
    clash = sorted(parents & files.keys())
    if clash:
        raise ArtifactError(source, "manifest.json lists a path both as a file and as a directory", member=clash[0])
    total = sum(e.size for e in files.values())
    if total > settings.max_expanded_bytes():
        raise ArtifactError(
            source,
            f"manifest declares {total} bytes expanded, over the cap of {settings.max_expanded_bytes()} "
            "(set KERNELPACK_MAX_EXPANDED_BYTES to raise it)",
        )
    return dict(sorted(files.items()))


def merge_manifests(manifests: Sequence[Manifest], names: Sequence[str]) -> Manifest:
    """The manifest of the union of ``manifests`` (see :func:`merge`); ``names`` name them in errors."""
    first = manifests[0]
    for name, m in zip(names[1:], manifests[1:], strict=True):
        diffs = differences(first.build_key, m.build_key, every_field=True)
        if diffs:
            field_name, a, b = diffs[0]
            raise KernelpackError(
                f"cannot merge {name}: built for another environment ({field_name}: {b!r} != {a!r} in {names[0]})",
                hint="merge only shards built with the same torch build on the same GPU model",
            )
        if dict(m.key_settings) != dict(first.key_settings):
            differ = sorted(
                n
                for n in m.key_settings.keys() | first.key_settings.keys()
                if m.key_settings.get(n) != first.key_settings.get(n)
            )
            raise KernelpackError(
                f"cannot merge {name}: built under other settings that enter inductor's cache keys than {names[0]} "
                f"({', '.join(differ[:8])})",
                hint="build every shard with the same inductor config and environment",
            )
        if m.recipe.get("sha256") != first.recipe.get("sha256"):
            raise KernelpackError(
                f"cannot merge {name}: recipe {m.recipe_name!r} (sha256 {str(m.recipe.get('sha256'))[:12]}) differs "
                f"from {first.recipe_name!r} in {names[0]}",
                hint="merge only shards of the same recipe file",
            )
    configs: dict[str, BuiltConfig] = {}
    files: dict[str, FileEntry] = {}
    for m in manifests:
        for rel, entry in m.files.items():
            files.setdefault(rel, entry)
        for c in m.configs:
            seen = configs.get(c.id)
            if seen is not None:
                c = dataclasses.replace(
                    seen,
                    devices=tuple(sorted(set(seen.devices) | set(c.devices))),
                    compile_seconds=max(seen.compile_seconds, c.compile_seconds),
                    compile_seconds_by_device=tuple(
                        sorted(dict(c.compile_seconds_by_device + seen.compile_seconds_by_device).items())
                    ),
                    max_rel_error=max(seen.max_rel_error, c.max_rel_error),
                    # one function per (device, graph): the first shard's, as for files
                    precompiled=tuple(
                        sorted(
                            {(p.device, p.graph): p for p in (*c.precompiled, *seen.precompiled)}.values(),
                            key=lambda p: (p.device, p.graph),
                        )
                    ),
                    not_precompiled="; ".join(dict.fromkeys(r for r in (seen.not_precompiled, c.not_precompiled) if r)),
                )
            configs[c.id] = c
    if not configs:
        raise KernelpackError(
            f"none of {', '.join(names)} holds a built config", hint="merge the shards that `kernelpack build` wrote"
        )
    return dataclasses.replace(
        first,
        name=artifact_name(first.recipe_name, first.build_key.tag),
        created=created_now(),
        configs=tuple(sorted(configs.values(), key=lambda c: c.id)),
        failed=tuple(f for m in manifests for f in m.failed if f.config.id not in configs),
        files=dict(sorted(files.items())),
        shard=None,
        merged_from=tuple(m.name for m in manifests),
        parts=(),  # the packer makes the merged archive's parts from each file's owners
    )


def check_member_name(path: str, rel: str) -> None:
    """A cache path must be a normalized relative POSIX path: no absolute paths, '..', '.', empty parts, NUL; at most
    MAX_PATH_CHARS characters in MAX_PATH_PARTS parts."""
    if (
        not rel
        or len(rel) > MAX_PATH_CHARS
        or rel.count("/") >= MAX_PATH_PARTS
        or rel.startswith("/")
        or "\\" in rel
        or not rel.isprintable()  # no NUL, no terminal escape: member names reach logs and terminals
        or posixpath.normpath(rel) != rel
        or any(part in ("", ".", "..") or len(part) > 255 for part in rel.split("/"))
        or not is_shipped(rel)
    ):
        shown = rel if len(rel) <= 200 else rel[:200] + f"... ({len(rel)} characters)"
        raise ArtifactError(path, "unsafe, non-normalized, too long or too deep path", member=shown)


SUFFIX = ".kpack"


def artifact_name(recipe: str, tag: str) -> str:
    return f"{recipe}-{tag}{SUFFIX}"
