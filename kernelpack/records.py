"""The JSON records kernelpack writes and reads outside the manifest, typed: each has one owner here that reads and
validates it (``from_dict``, raising ``ValueError``/``TypeError``/``KeyError`` naming the field) and one that writes it
(``to_dict``). The models are huggingface/kernels' ``KernelLock`` (``locking.py``) and the manifest's own
:class:`~kernelpack.manifest.Manifest`.

- :class:`Lock` (``kernelpack lock``'s file): per build key, the registry artifact it pins.
- :class:`WorkerResult`: what a build worker reports of one (config, device) (:mod:`kernelpack.build`).
- :class:`VerifyReport`: what ``kernelpack verify``'s fresh process reports (``verify --json`` prints
  :meth:`VerifyReport.to_dict`).
- :data:`RecordEvent` (:class:`RecordedCall`, :class:`RecordProblem`, :class:`RecordNote`): what ``kernelpack
  record``'s processes write of the calls they see, one JSON line each (:func:`record_event` reads one).

Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

LOCK_FORMAT = 1


def _object(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _str(data: Mapping[str, Any], key: str, *, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str):
        raise TypeError(f"{key} must be a string, got {value!r:.80}")
    return value


def _int(data: Mapping[str, Any], key: str, *, default: int | None = None) -> int:
    value = data.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{key} must be an integer, got {value!r:.80}")
    return value


def _float(data: Mapping[str, Any], key: str, *, default: float | None = None) -> float:
    value = data.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{key} must be a number, got {value!r:.80}")
    return float(value)


def _numbers(data: Mapping[str, Any], key: str, kind: type = float) -> dict[str, Any]:
    value = _object(data.get(key, {}), key)
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, (int, float)) or isinstance(v, bool):
            raise TypeError(f"{key}[{k!r}] must be a number, got {v!r:.80}")
    return {k: kind(v) for k, v in value.items()}


def _strings(data: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{key} must be a list of strings")
    return tuple(value)


def _str_map(data: Mapping[str, Any], key: str) -> dict[str, str]:
    value = _object(data.get(key, {}), key)
    if not all(isinstance(v, str) for v in value.values()):
        raise TypeError(f"{key} must be an object of strings")
    return dict(value)


# ------------------------------------------------------------------------------------------------ the lock file


@dataclass(frozen=True, slots=True)
class Pin:
    """One build key's pinned artifact."""

    key_id: str
    build_key: dict[str, str]
    path: str  # in the registry
    sha256: str
    size: int

    def to_dict(self) -> dict[str, Any]:
        return {"key_id": self.key_id, "build_key": self.build_key, "path": self.path, "sha256": self.sha256,
                "size": self.size}  # fmt: skip

    @classmethod
    def from_dict(cls, data: object) -> Pin:
        d = _object(data, "a pin")
        return cls(_str(d, "key_id"), _str_map(d, "build_key"), _str(d, "path", default=""), _str(d, "sha256"),
                   _int(d, "size", default=0))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Lock:
    """``kernelpack lock``'s file: the registry's artifacts of one recipe, one per build key, by sha256."""

    registry: str
    recipe: str
    pins: tuple[Pin, ...]  # sorted by key_id

    def pinned(self, key_id: str) -> Pin | None:
        return next((p for p in self.pins if p.key_id == key_id), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": LOCK_FORMAT,
            "registry": self.registry,
            "recipe": self.recipe,
            "artifacts": [p.to_dict() for p in sorted(self.pins, key=lambda p: p.key_id)],
        }

    @classmethod
    def from_dict(cls, data: object) -> Lock:
        d = _object(data, "a lock file")
        if d.get("format") != LOCK_FORMAT:
            raise ValueError(f"unsupported lock format {d.get('format')!r} (this kernelpack reads {LOCK_FORMAT})")
        artifacts = d.get("artifacts")
        if not isinstance(artifacts, list):
            raise TypeError("artifacts must be a list")
        pins = tuple(Pin.from_dict(p) for p in artifacts)
        if len({p.key_id for p in pins}) != len(pins):
            raise ValueError("a build key is pinned twice")
        return cls(_str(d, "registry", default=""), _str(d, "recipe"), pins)


# ------------------------------------------------------------------------------------------------ build workers


@dataclass(frozen=True, slots=True)
class BuiltFunction:
    """Tier 2: one graph's precompiled function, as the worker saved it under its cache dir."""

    path: str
    sha256: str
    seconds: float

    @classmethod
    def from_dict(cls, data: object) -> BuiltFunction:
        d = _object(data, "a precompiled function")
        return cls(_str(d, "path"), _str(d, "sha256"), _float(d, "seconds", default=0.0))


@dataclass(frozen=True, slots=True)
class WorkerResult:
    """What a build worker reports of its (config, device): its first canonical call, the reference check's
    ``problem`` ("" when it passed), the keys the manifest records, and tier 2's functions."""

    seconds: float = 0.0
    errors: dict[str, float] = field(default_factory=dict)  # graph -> max. relative error against float64
    counters: dict[str, int] = field(default_factory=dict)
    build_key: dict[str, str] = field(default_factory=dict)
    mask_key: str = ""
    mask_free: tuple[str, ...] = ()
    marks: tuple[str, ...] = ()
    score_key: str = ""
    key_settings: dict[str, str] = field(default_factory=dict)
    problem: str = ""
    functions: dict[str, BuiltFunction] = field(default_factory=dict)  # graph -> its precompiled function
    missing: str = ""  # why some graph has no precompiled function

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "errors": dict(self.errors),
            "counters": dict(self.counters),
            "build_key": dict(self.build_key),
            "mask_key": self.mask_key,
            "mask_free": list(self.mask_free),
            "marks": list(self.marks),
            "score_key": self.score_key,
            "key_settings": dict(self.key_settings),
            "problem": self.problem,
            "precompiled": {
                "graphs": {
                    g: {"path": f.path, "sha256": f.sha256, "seconds": f.seconds} for g, f in self.functions.items()
                },
                "missing": self.missing,
            },
        }

    @classmethod
    def from_dict(cls, data: object) -> WorkerResult:
        d = _object(data, "a build worker's result")
        tier2 = _object(d.get("precompiled", {}), "precompiled")
        graphs = _object(tier2.get("graphs", {}), "precompiled.graphs")
        return cls(
            seconds=_float(d, "seconds", default=0.0),
            errors=_numbers(d, "errors"),
            counters=_numbers(d, "counters", int),
            build_key=_str_map(d, "build_key"),
            mask_key=_str(d, "mask_key", default=""),
            mask_free=_strings(d, "mask_free"),
            marks=_strings(d, "marks"),
            score_key=_str(d, "score_key", default=""),
            key_settings=_str_map(d, "key_settings"),
            problem=_str(d, "problem", default="") if d.get("problem") is not None else "",
            functions={str(g): BuiltFunction.from_dict(f) for g, f in graphs.items()},
            missing=_str(tier2, "missing", default=""),
        )


# ------------------------------------------------------------------------------------------------ verify


@dataclass(frozen=True, slots=True)
class GraphTier:
    """What served one graph of a verified config: ``precompiled`` (tier 2, its load and call timed and compared
    with tier 1's outputs) or ``inductor-cache`` (tier 1), and why not tier 2."""

    tier: str
    why: str = ""
    seconds: float | None = None
    equal: bool | None = None
    rel_error: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"tier": self.tier}
        if self.seconds is not None:
            d |= {"seconds": self.seconds, "equal": self.equal, "rel_error": self.rel_error}
        if self.why:
            d["why"] = self.why
        return d

    @classmethod
    def from_dict(cls, data: object) -> GraphTier:
        d = _object(data, "a graph's tier")
        tier = _str(d, "tier")
        if tier not in ("precompiled", "inductor-cache"):
            raise ValueError(f"tier must be 'precompiled' or 'inductor-cache', got {tier!r:.80}")
        equal = d.get("equal")
        if equal is not None and not isinstance(equal, bool):
            raise TypeError(f"equal must be a boolean, got {equal!r:.80}")
        timed = "seconds" in d
        return cls(
            tier,
            _str(d, "why", default="") if d.get("why") is not None else "",
            _float(d, "seconds") if timed else None,
            equal,
            _float(d, "rel_error") if timed and d.get("rel_error") is not None else None,
        )


@dataclass(frozen=True, slots=True)
class VerifiedConfig:
    """One (config, device)'s first call in verify's fresh process; it passed when ``reasons`` is empty."""

    id: str
    device: str
    describe: str
    seconds: float
    errors: dict[str, float]  # graph -> max. relative error against float64 (verify --check)
    counters: dict[str, int]  # torch's counters over the first call
    lengths: tuple[tuple[int, int], ...]  # the (q_len, kv_len) a dynamic range config was also called at
    tiers: dict[str, GraphTier]
    reasons: tuple[str, ...]  # what compiled or differed

    @property
    def ok(self) -> bool:
        return not self.reasons

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "device": self.device,
            "describe": self.describe,
            "seconds": self.seconds,
            "errors": dict(self.errors),
            "counters": dict(self.counters),
            "lengths": [list(x) for x in self.lengths],
            "tiers": {g: t.to_dict() for g, t in self.tiers.items()},
            "reasons": list(self.reasons),
        }

    @classmethod
    def from_dict(cls, data: object) -> VerifiedConfig:
        d = _object(data, "a verified config")
        lengths = d.get("lengths", [])
        if not isinstance(lengths, list) or not all(
            isinstance(x, list) and len(x) == 2 and all(isinstance(n, int) for n in x) for x in lengths
        ):
            raise TypeError("lengths must be a list of [q_len, kv_len]")
        return cls(
            id=_str(d, "id"),
            device=_str(d, "device"),
            describe=_str(d, "describe"),
            seconds=_float(d, "seconds"),
            errors=_numbers(d, "errors"),
            counters=_numbers(d, "counters", int),
            lengths=tuple((x[0], x[1]) for x in lengths),
            tiers={str(g): GraphTier.from_dict(t) for g, t in _object(d.get("tiers", {}), "tiers").items()},
            reasons=_strings(d, "reasons"),
        )


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """``kernelpack verify``'s fresh process: what it installed, and every (config, device)'s first call, in the
    shuffled order it made them."""

    artifact: str
    seed: int
    configs: tuple[VerifiedConfig, ...]
    torch_version: str
    torch_git: str
    triton_detection: str
    install_seconds: float
    installed_files: int

    @property
    def failures(self) -> list[VerifiedConfig]:
        return [c for c in self.configs if not c.ok]

    @property
    def totals(self) -> dict[str, int]:
        """torch's counters summed over every config's first call."""
        keys = sorted({k for c in self.configs for k in c.counters})
        return {k: sum(c.counters.get(k, 0) for c in self.configs) for k in keys}

    @property
    def precompiled(self) -> int:
        """Graphs served by precompiled functions (tier 2)."""
        return sum(t.tier == "precompiled" for c in self.configs for t in c.tiers.values())

    @property
    def first_step_seconds(self) -> float:
        return sum(c.seconds for c in self.configs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "artifact": self.artifact,
            "seed": self.seed,
            "configs": [c.to_dict() for c in self.configs],
            "torch": {"version": self.torch_version, "git": self.torch_git},
            "triton_detection": self.triton_detection,
            "install_seconds": self.install_seconds,
            "installed_files": self.installed_files,
            "totals": self.totals,
            "precompiled": self.precompiled,
            "first_step_seconds": self.first_step_seconds,
        }

    @classmethod
    def from_dict(cls, data: object) -> VerifyReport:
        d = _object(data, "verify's report")
        torch = _object(d.get("torch", {}), "torch")
        configs = d.get("configs", [])
        if not isinstance(configs, list):
            raise TypeError("configs must be a list")
        return cls(
            artifact=_str(d, "artifact"),
            seed=_int(d, "seed"),
            configs=tuple(VerifiedConfig.from_dict(c) for c in configs),
            torch_version=_str(torch, "version"),
            torch_git=_str(torch, "git", default="") if torch.get("git") is not None else "",
            triton_detection=_str(d, "triton_detection", default=""),
            install_seconds=_float(d, "install_seconds", default=0.0),
            installed_files=_int(d, "installed_files", default=0),
        )


# ------------------------------------------------------------------------------------------------ record's events


@dataclass(frozen=True, slots=True)
class RecordedCall:
    """A distinct call ``kernelpack record`` saw, as the recipe point that declares it (``config``: what
    :meth:`kernelpack.config.Config.to_dict` writes and ``Config.from_dict`` reads; the recipe writer merges the
    closures of several such points, so it stays that mapping here) and where it was made."""

    call_signature: str  # the call's signature, described
    path: str  # the entry it came through: "kernelpack.flex_attention", "torch.compile(flex_attention)", ...
    site: str | None  # the user's line that made it, when known
    config: dict[str, Any]
    device_index: int | None = None  # the CUDA device index it ran on (None on CPU)

    @property
    def seen(self) -> str:
        """Where it was made, as a recipe's comment says it."""
        return f"{self.path} at {self.site or 'an unknown site'}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "call": {
                "call_signature": self.call_signature,
                "path": self.path,
                "site": self.site,
                "config": dict(self.config),
                "device_index": self.device_index,
            }
        }


@dataclass(frozen=True, slots=True)
class RecordProblem:
    """A call whose recipe entry cannot be written, why, and what to do instead."""

    call_signature: str
    path: str
    site: str | None
    reason: str
    hint: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "problem": {
                "call_signature": self.call_signature,
                "path": self.path,
                "site": self.site,
                "reason": self.reason,
                "hint": self.hint,
            }
        }


@dataclass(frozen=True, slots=True)
class RecordNote:
    """Something record saw that the recipe's reader should know (written as a comment): an eager call, a call it
    could not read, the user's own torch.compile meeting several shapes."""

    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"note": self.text}


RecordEvent = RecordedCall | RecordProblem | RecordNote


def record_event(data: object) -> RecordEvent:
    """One event as a recording process wrote it (one JSON line of its ``calls-<pid>.jsonl``): ``{"call": ...}``,
    ``{"problem": ...}`` or ``{"note": ...}``."""
    d = _object(data, "a recorded event")
    if "note" in d:
        return RecordNote(_str(d, "note"))
    kind = "call" if "call" in d else "problem" if "problem" in d else None
    if kind is None:
        raise KeyError(f"a recorded event holds one of call, problem, note; got {sorted(d)}")
    e = _object(d[kind], kind)
    described, path = _str(e, "call_signature", default=""), _str(e, "path")
    site = _str(e, "site") if e.get("site") is not None else None
    if kind == "problem":
        hint = _str(e, "hint", default="") if e.get("hint") is not None else ""
        return RecordProblem(described, path, site, reason=_str(e, "reason"), hint=hint)
    index = e.get("device_index")
    if index is not None and (not isinstance(index, int) or isinstance(index, bool)):
        raise TypeError(f"device_index must be an integer or null, got {index!r:.80}")
    return RecordedCall(described, path, site, config=_object(e.get("config"), "config"), device_index=index)
