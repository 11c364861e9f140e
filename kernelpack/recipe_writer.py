"""What ``kernelpack record`` writes: the recorded calls (:mod:`kernelpack.record`'s events) merged into one recipe,
its lengths widened into buckets or a range where asked, checked by expanding it again (every recorded call must be
served by a config of the recipe written), and the TOML text.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from . import _toml as _toml_writer
from . import closures
from ._fs import write_bytes
from .config import Config
from .errors import RecipeError, RecordError
from .recipe import Recipe, check_name, parse_recipe
from .records import RecordedCall, RecordEvent, RecordNote, RecordProblem
from .signature import DEFAULT_BLOCK_SIZE, GRAPHS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def recipe_text(
    events: Sequence[RecordEvent],
    *,
    name: str,
    description: str = "",
    source: str = "path",
    check: bool = True,
    lengths: Lengths | None = None,
) -> str:
    """The recipe (TOML) of recorded events: one ``[[calls]]`` table per graph-selecting variant of a call (its
    graphs merged), each with a comment saying where it was made.

    Calls that differ only in their lengths and in the ints and tensor sizes their mask closes over are one variant
    (:func:`_merge_closures`): DFlash's mask at every context length S. Such a variant seen at two or more lengths is
    one dynamic range, widened beyond the lengths seen (:func:`_range_table`; ``lengths`` sets it, or asks for static
    buckets). A None where another call has an int (a full layer's window) is another variant: another graph.

    Raises :class:`RecordError` for problem events (each with what to do) or no call; with ``check``, the text is
    parsed back and every recorded call replayed against it with the keys the runtime uses (:func:`_replay`)."""
    problems = [e for e in events if isinstance(e, RecordProblem)]
    if problems:
        lines = [f"{len(problems)} call(s) cannot be written as a recipe:"]
        by_reason: dict[str, list[RecordProblem]] = {}
        for p in problems:  # one line per reason (a job's many lengths fail for one), with the first call
            by_reason.setdefault(p.reason, []).append(p)
        for reason, same in by_reason.items():
            p = same[0]
            others = f" and {len(same) - 1} more call(s)" if len(same) > 1 else ""
            lines.append(f"- {p.call_signature}{others} ({p.path} at {p.site or 'an unknown site'}): {reason}")
        hints = list(dict.fromkeys(p.hint for p in problems if p.hint))
        raise RecordError("\n".join(lines), hint="\n\n".join(hints))
    entries: dict[str, _Entry] = {}
    recorded_calls = [e for e in events if isinstance(e, RecordedCall)]
    for call in _merge_closures(recorded_calls):
        params = dict(call.config)
        graphs = params.pop("graphs")
        entry = entries.setdefault(json.dumps(params, sort_keys=True), _Entry(params))
        entry.graphs.update(graphs)
        if call.device_index is not None:
            entry.devices.add(call.device_index)
        entry.seen.add(call.seen)
    if not entries:
        raise RecordError(
            "no flex_attention call was recorded",
            hint='kernelpack sees calls through kernelpack.flex_attention, attn_implementation="kernelpack" and '
            "torch.compile(flex_attention); inside your own torch.compile(model) flex is part of your graph, which "
            "record cannot see",
        )
    devices = {entry.config["device"] for entry in entries.values()}
    if len(devices) > 1:
        raise RecordError(
            f"calls on {sorted(devices)}: a recipe is for one device type",
            hint="record the CPU and the CUDA job separately",
        )
    problem = check_name(name)
    if problem:
        raise RecordError(f"recipe name {name!r} {problem}", hint="pass --name")
    indices = sorted({i for entry in entries.values() for i in entry.devices})
    notes = [e.text for e in events if isinstance(e, RecordNote)]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [_comment(f"# Recorded by kernelpack record from {source} on {now}.")]
    out += [_comment(f"# note: {n}") for n in notes]
    if indices and indices != [0]:
        out.append(f"# CUDA device indices seen: {indices}: build with --devices {','.join(map(str, indices))}")
    out += [f"name = {_toml_text(name)}"]
    if description:
        out.append(f"description = {_toml_text(description)}")
    out += [f"device = {_toml_text(devices.pop())}", ""]
    for group in _length_groups(entries.values()):
        graphs = sorted({g for entry in group for g in entry.graphs}, key=GRAPHS.index)
        recorded = [Config.from_dict({**entry.config, "graphs": graphs}) for entry in group]
        sites = sorted({s for entry in group for s in entry.seen})
        indices_seen = sorted({d for entry in group for d in entry.devices})
        for i, (table, comments) in enumerate(_tables(recorded, lengths)):
            out += [_comment(f"# {c}") for c in comments]
            if i == 0:
                out += [_comment(f"# seen: {s}") for s in sites]
                if indices_seen and indices_seen != [0]:
                    out.append(f"# device indices: {indices_seen}")
            out += ["[[calls]]", *(f"{k} = {_toml_text(v)}" for k, v in table.items()), ""]
    text = "\n".join(out)
    if check:
        _replay(parse_recipe(tomllib.loads(text), path="<recorded recipe>"), recorded_calls, lengths)
    return text


# the number of distinct lengths of one otherwise equal call from which record writes a range, not a table each
RANGE_FROM = 2


# record's default range for a length that varied: from half the smallest to twice the largest length seen (torch's
# one dynamic graph serves any length; the range is what strict mode serves), within one block + 1 .. LENGTH_CAP
WIDEN = 2


LENGTH_CAP = 131072


@dataclasses.dataclass(frozen=True, slots=True)
class Lengths:
    """``--lengths MIN:MAX[:MULTIPLE]``: the range record writes for the lengths that varied (a dynamic range; with
    MULTIPLE, static buckets of that multiple instead)."""

    min: int
    max: int
    multiple: int | None = None

    @classmethod
    def parse(cls, text: str) -> Lengths:
        parts = text.split(":")
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            numbers = []
        if len(parts) not in (2, 3) or len(numbers) != len(parts) or any(n <= 0 for n in numbers):
            raise RecordError(
                f"--lengths {text!r} is not MIN:MAX or MIN:MAX:MULTIPLE (positive integers)",
                hint="e.g. --lengths 1024:16384 (one dynamic graph) or --lengths 1024:4096:256 (static buckets)",
            )
        if numbers[0] > numbers[1]:
            raise RecordError(f"--lengths {text!r}: MIN {numbers[0]} is above MAX {numbers[1]}", hint="MIN:MAX")
        return cls(numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else None)


@dataclasses.dataclass
class _Entry:
    """The recorded calls of one recipe point (every parameter but the graphs): the graphs they made, the CUDA
    device indices they ran on, and where they were made."""

    config: dict[str, Any]  # Config.to_dict() less "graphs"
    graphs: set[str] = dataclasses.field(default_factory=set)
    devices: set[int] = dataclasses.field(default_factory=set)
    seen: set[str] = dataclasses.field(default_factory=set)


def _merge_closures(calls: list[RecordedCall]) -> list[RecordedCall]:
    """The recorded calls with each mask's closure written once per variant: calls whose masks differ only in the
    ints and tensor sizes they close over are one variant, and each such value is written as the constant it was,
    as the expression of the call's dimensions it followed in every call (``{"dim": "kv_len - q_len"}``, a tensor
    of shape ``["batch", "q_len // 16"]``), or as an example of the values seen (``{"example": 1500, "seen":
    [1024, 4096]}``). The builder makes each value again at every recipe point (:func:`kernelpack.closures.rebuild`)
    and a dynamic graph keeps the varying ones symbolic (their key is their type). A None where another call has an
    int is another variant: it selects other code."""
    groups: dict[str, list[RecordedCall]] = {}
    for call in calls:
        config = call.config
        closure = config.get("mask_closure")
        rest = {k: v for k, v in config.items() if k not in ("q_len", "kv_len", "graphs")}
        if closure is not None:
            rest["mask_closure"] = _blank(json.loads(closure))
        groups.setdefault(json.dumps(rest, sort_keys=True), []).append(call)
    out = []
    for group in groups.values():
        closures_ = [c.config.get("mask_closure") for c in group]
        if closures_[0] is None:
            out += group
            continue
        dims = [_dims_of(c) for c in group]
        merged = _merge([json.loads(str(c)) for c in closures_], dims, tensor=False)
        text = json.dumps(merged, sort_keys=True, separators=(",", ":"))
        out += [dataclasses.replace(c, config={**c.config, "mask_closure": text}) for c in group]
    return out


def _dims_of(call: RecordedCall) -> dict[str, int]:
    return {d: int(call.config[d]) for d in closures.DIMS}


def _blank(v: Any) -> Any:
    """A closure with its ints and tensor sizes blanked: what the calls of one variant share."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return "<int>"
    if isinstance(v, list):
        return [_blank(x) for x in v]
    if isinstance(v, dict):
        if "tensor" in v and len(v) == 1 and isinstance(v["tensor"], dict):
            return {"tensor": {**v["tensor"], "shape": ["<int>"] * len(v["tensor"].get("shape", ()))}}
        return {k: _blank(x) for k, x in v.items()}
    return v


def _merge(values: list[Any], dims: list[dict[str, int]], *, tensor: bool) -> Any:
    """One value for the same position of every call's closure (see :func:`_merge_closures`); a tensor's sizes
    prefer an expression even when constant (the builder's tensor then follows the recipe point)."""
    first = values[0]
    if isinstance(first, int) and not isinstance(first, bool):
        exprs = [
            e
            for e in closures.dim_expressions(first, dims[0])
            if all(closures.evaluate(e, d) == v for v, d in zip(values, dims, strict=True))
        ]
        constant = len(set(values)) == 1
        if exprs and (tensor or not constant):
            return {"dim": exprs[0]} if not tensor else exprs[0]
        if constant:
            return first
        return {"example": first, "seen": [min(values), max(values)]}
    if isinstance(first, list):
        return [_merge([v[i] for v in values], dims, tensor=tensor) for i in range(len(first))]
    if isinstance(first, dict):
        if "tensor" in first and len(first) == 1:
            shapes = [v["tensor"]["shape"] for v in values]
            merged = [_merge([s[i] for s in shapes], dims, tensor=True) for i in range(len(shapes[0]))]
            return {"tensor": {**first["tensor"], "shape": merged}}
        return {k: _merge([v[k] for v in values], dims, tensor=tensor) for k in first}
    return first


def _length_groups(entries: Iterable[_Entry]) -> list[list[_Entry]]:
    """The recorded calls grouped by everything but their lengths (and graphs, merged): a group of RANGE_FROM or
    more becomes one range. A length that varies starts above one block in a range (torch makes a length of one
    block another graph); one that stays fixed may be anything. Calls through the user's own
    ``torch.compile(flex_attention)`` stay one table per length: kernelpack cannot make that compile dynamic."""
    groups: dict[str, list[_Entry]] = {}
    for entry in entries:
        rest = {k: v for k, v in entry.config.items() if k not in ("q_len", "kv_len")}
        groups.setdefault(json.dumps(rest, sort_keys=True), []).append(entry)
    out = []
    for key in sorted(groups):
        group = sorted(groups[key], key=lambda e: (e.config["q_len"], e.config["kv_len"]))
        block_q, block_kv = group[0].config.get("block_size") or (128, 128)
        qs, kvs = {e.config["q_len"] for e in group}, {e.config["kv_len"] for e in group}
        own = any(s.startswith("torch.compile(flex_attention)") for e in group for s in e.seen)
        long = [
            e
            for e in group
            if (len(qs) == 1 or e.config["q_len"] > block_q) and (len(kvs) == 1 or e.config["kv_len"] > block_kv)
        ]
        if len(long) >= RANGE_FROM and not own:
            out.append(long)
            out += [[e] for e in group if e not in long]
        else:
            out += [[e] for e in group]
    return out


def _tables(recorded: list[Config], lengths: Lengths | None = None) -> list[tuple[dict[str, Any], list[str]]]:
    """The ``[[calls]]`` tables of one call recorded at these lengths, each with its comment lines: the call itself
    for one length (unless ``lengths`` asks for a range); for several, one dynamic range over them, widened
    (:func:`_range_table`), or static buckets when ``lengths`` has a multiple."""
    exact = [(_call_table(c), [c.describe()]) for c in recorded]
    if len(recorded) == 1 and lengths is None:
        return exact
    table, comments = _range_table(recorded, lengths)
    try:  # the proposal must parse; an invalid one (a range at one block) leaves the lengths one by one
        head = f'name = "r"\ndevice = {_toml_text(recorded[0].device)}\n[[calls]]\n'
        parse_recipe(tomllib.loads(head + "\n".join(f"{k} = {_toml_text(v)}" for k, v in table.items())))
    except RecipeError as e:
        if lengths is not None:
            raise RecordError(f"--lengths: {e}", hint="a range starts above one block (128)") from None
        return exact
    return [(table, comments)]


def _range_table(recorded: list[Config], lengths: Lengths | None) -> tuple[dict[str, Any], list[str]]:
    first = recorded[0]
    rest = _call_table(first)
    for key in ("seq_len", "q_len", "kv_len", "dynamic"):
        rest.pop(key, None)
    table: dict[str, Any] = {k: rest.pop(k) for k in ("mask", "window", "batch", "q_heads", "kv_heads") if k in rest}
    lens = [(c.q_len, c.kv_len) for c in recorded]
    tied = all(q == kv for q, kv in lens)
    qs, kvs = sorted({q for q, _ in lens}), sorted({kv for _, kv in lens})
    where = f"{len(lens)} lengths were recorded, q_len {qs[0]}..{qs[-1]}, kv_len {kvs[0]}..{kvs[-1]}"
    if len(lens) == 1:
        where = f"one length was recorded, q_len {qs[0]}, kv_len {kvs[0]}"
    # calls made through guarded(dynamic=True) are served by dynamic graphs only
    if lengths is not None and lengths.multiple is not None and first.dynamic:
        raise RecordError(
            "--lengths MIN:MAX:MULTIPLE asks for static buckets, but the job calls a dynamic graph "
            "(guarded(dynamic=True))",
            hint="drop MULTIPLE: --lengths MIN:MAX",
        )

    def span(seen: list[int], block: int) -> dict[str, int]:
        if lengths is not None:
            out = {"min": lengths.min, "max": lengths.max}
            if lengths.multiple is not None:
                out["multiple"] = lengths.multiple
            return out
        lo = max(block + 1, seen[0] // WIDEN)
        return {"min": min(lo, seen[0]), "max": max(seen[-1], min(LENGTH_CAP, seen[-1] * WIDEN))}

    if lengths is None:
        # a job that already pads (every length a multiple of one m >= 64): its buckets serve it as it calls, with
        # static graphs' faster kernels (docs/BENCHMARKS.md: 7.0 ms against 10.6 ms for one DFlash-shaped call)
        m = math.gcd(*qs, *kvs)
        if m >= 64 and not first.dynamic and (tied or len(qs) == 1 or len(kvs) == 1):
            lengths = Lengths(qs[0] if len(qs) > 1 or tied else kvs[0], qs[-1] if len(qs) > 1 or tied else kvs[-1], m)
            where += f", all multiples of {m} (the job pads)"
    buckets = lengths is not None and lengths.multiple is not None
    if tied:
        table["seq_len"] = span(qs, max(first.block_size))
        what = "seq_len"
    else:
        # a length that did not vary stays fixed (DFlash's q_len: its anchors times its block); for one dynamic
        # graph it is the range [q, q]
        for name, seen, block in (("q_len", qs, first.block_size[0]), ("kv_len", kvs, first.block_size[1])):
            if len(seen) > 1 or (lengths is not None and name == "kv_len"):
                table[name] = span(seen, block)
            else:
                table[name] = seen[0] if buckets else {"min": seen[0], "max": seen[0]}
        varied = [
            n
            for n in ("q_len", "kv_len")
            if isinstance(table[n], dict) and ("multiple" in table[n] or table[n]["min"] != table[n]["max"])
        ]
        what = " and ".join(varied) or "kv_len"
    table.update(rest)
    if lengths is not None and lengths.multiple is not None:
        return table, [
            f"{where}: static buckets of {lengths.multiple} for {what}; a length between buckets is padded to one "
            "(kernelpack.runtime.padded_lengths)",
            "for one dynamic graph that serves any length without padding, record with --lengths MIN:MAX",
        ]
    table["dynamic"] = True
    source = "--lengths"
    if lengths is None:
        source = f"record's default: 1/{WIDEN} of the smallest to {WIDEN}x the largest seen, at most {LENGTH_CAP}"
    return table, [
        f"{where}: one dynamic graph serves {what} over the range ({source}), as the job calls it, with no padding",
        "to serve other lengths, record again with --lengths MIN:MAX (MIN:MAX:MULTIPLE for static buckets, which "
        "run faster kernels but need the job to pad)",
    ]


def _replay(recipe: Recipe, calls: list[RecordedCall], lengths: Lengths | None = None) -> None:
    """Every recorded call replayed against the written recipe with the keys the runtime uses: the same call
    parameters, its lengths in a config's, and its mask's key (the job's values, made again from the recording)
    equal to the key of the config's mask made at the call's lengths, with the values a dynamic graph keeps
    symbolic keyed by type. Raises :class:`RecordError` naming the first call no config serves."""
    for call in calls:
        recorded = Config.from_dict(call.config)
        if any(_serves(c, recorded) for c in recipe.configs):
            continue
        # static buckets serve a call the job pads to one: the same call at the bucket's lengths
        buckets = [c for c in recipe.configs if c.q_range is None]
        padded = [
            c
            for c in buckets
            if c.q_len >= recorded.q_len and c.kv_len >= recorded.kv_len and _serves(c, recorded.at(c.q_len, c.kv_len))
        ]
        if padded:
            continue
        # the values record wrote as following the lengths (from every call of this variant)
        refs = [c.reference("mask") or {} for c in buckets if c.mask == recorded.mask]
        follows = [p for ref in refs[:1] for p in closures.varying(ref) if ".shape[" not in p]
        if buckets and lengths is not None and lengths.multiple is not None:
            raise RecordError(
                f"static buckets (--lengths {lengths.min}:{lengths.max}:{lengths.multiple}) cannot serve the call "
                f"{recorded.describe()}"
                + (
                    f": its mask closes over {', '.join(follows)}, which follow(s) the call's lengths, so a call "
                    "padded to a bucket keeps its own value and misses the bucket's graph"
                    if follows
                    else ": its lengths are above the largest bucket"
                ),
                hint="drop MULTIPLE (--lengths MIN:MAX: one dynamic graph serves every length as the job calls it)",
            )
        raise RecordError(
            f"the recorded recipe does not serve the call {recorded.describe()} (at {call.site})",
            hint="report it as a kernelpack bug; until then, write the recipe by hand (README, 'Recipe format')",
        )


def _serves(built: Config, call: Config) -> bool:
    """Whether a recipe's config serves a recorded call: the same call parameters, its lengths (exactly, or in the
    config's dynamic range) and, for a mask made again from its closure, the same mask key at the call's lengths
    (see :func:`_replay`)."""
    if not built.covers_lengths(call.q_len, call.kv_len) or (call.dynamic and not built.dynamic):
        return False
    same = dataclasses.replace(
        call,
        q_len=built.q_len,
        kv_len=built.kv_len,
        q_range=built.q_range,
        kv_range=built.kv_range,
        dynamic=built.dynamic,
        mask_closure=built.mask_closure if call.mask_closure is not None else None,
        graphs=built.graphs if set(call.graphs) <= set(built.graphs) else call.graphs,
    )
    if same.id != built.id:
        return False
    if call.mask_closure is None:
        return True
    from .masks import mask_for
    from .signature import mask_key

    ref = built.reference("mask")
    assert ref is not None
    free = tuple(closures.varying(ref)) if built.dynamic else ()
    # made again as the builder's workers make it (their sys.path ends with the working directory); a mask that
    # cannot be made here cannot be built either: the error says so, before anything is written
    sys.path.append(os.getcwd())
    try:
        job = mask_for(call, call.device)
        made = mask_for(built.at(call.q_len, call.kv_len), call.device)
    finally:
        sys.path.remove(os.getcwd())
    return mask_key(job, free) == mask_key(made, free)


def write_recipe(
    path: str | os.PathLike[str],
    events: Sequence[RecordEvent],
    *,
    name: str | None = None,
    source: str = "a job",
    lengths: Lengths | None = None,
) -> Path:
    """:func:`recipe_text` written atomically to ``path`` (name: the file's stem by default)."""
    target = Path(path)
    text = recipe_text(events, name=name or stem_name(target), source=source, lengths=lengths)
    try:
        write_bytes(target, text.encode())
    except OSError as e:
        raise RecordError(f"cannot write {target}: {e}", hint="pass -o a path in a writable directory") from e
    return target


def stem_name(target: Path) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", target.stem).lstrip(".") or "recorded"


def _call_table(config: Config) -> dict[str, Any]:
    """A config as a ``[[calls]]`` table: every key that is not its default."""
    t: dict[str, Any] = {}
    ref = config.reference("mask")
    t["mask"] = ref if ref is not None else config.mask
    if config.window is not None:
        t["window"] = config.window
    t["batch"] = config.batch
    t["q_heads"], t["kv_heads"] = config.q_heads, config.kv_heads
    if config.q_len == config.kv_len:
        t["seq_len"] = config.q_len
    else:
        t["q_len"], t["kv_len"] = config.q_len, config.kv_len
    t["head_dim"], t["dtype"], t["graphs"] = config.head_dim, config.dtype, list(config.graphs)
    if config.layout != "bhsd":
        t["layout"] = config.layout
    if config.scale is not None:
        t["scale"] = config.scale
    if config.enable_gqa != (config.q_heads != config.kv_heads):
        t["enable_gqa"] = config.enable_gqa
    if config.return_lse:
        t["return_lse"] = True
    if tuple(config.block_size) != DEFAULT_BLOCK_SIZE:
        t["block_size"] = list(config.block_size)
    score = config.reference("score")
    if score is not None or config.score_mod != "none":
        t["score_mod"] = score if score is not None else config.score_mod
    for key, default in (("return_aux", "none"), ("mask_dims", "broadcast"), ("alias", "none"), ("mode", "default")):
        if getattr(config, key) != default:
            t[key] = getattr(config, key)
    if config.dynamic:
        t["dynamic"] = True
    if config.padded:
        t["padded"] = True
    if config.kernel_options:
        t["kernel_options"] = dict(config.kernel_options)
    return t


def _comment(text: str) -> str:
    return _toml_writer.comment(text)


def _toml_text(value: Any) -> str:
    """A TOML value, through the one writer (:mod:`kernelpack._toml`)."""
    try:
        return _toml_writer.value(value)
    except _toml_writer.NotWritable as e:
        raise RecordError(
            f"a recorded value {e}", hint="rename the file or module to UTF-8, or record other calls"
        ) from None
