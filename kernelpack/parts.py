"""The artifact's parts: which files a signature needs, so that a process installs those and nothing else.

A part is one zstd frame of the archive (:mod:`kernelpack.artifact`), listed in the manifest
(:mod:`kernelpack.manifest`): the files of one tier made for one set of (config, device) pairs. Planned here from
each file's owners (the builder's workers that wrote it), and checked here when a manifest is read.

Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# A part's files are only a Dynamo trace's (tier 1): inductor's FX-graph and AOTAutograd caches. A precompiled function
# (tier 2) carries its graphs, and loads with neither dir installed (checked: CPU, torch 2.13); its generated code and
# kernels are in the other dirs (code dirs, triton/), which it does need.
TIER1_ONLY = ("fxgraph/", "aotautograd/")


MAX_PARTS = 20_000


def owner(config_id: str, device: int) -> str:
    """What a part's files were made for: one config on one device index (the builder's worker that wrote them)."""
    return f"{config_id}@{device}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Part:
    """One zstd frame of the archive: the files of one set of owners (:func:`owner`) and one tier, so that a process
    installs what the signatures it calls need and nothing else. A file two workers both wrote (same path) has both
    as owners, and goes into a part of its own with them."""

    owners: tuple[str, ...]  # sorted; every one of them needs every file of the part
    tier1: bool  # only a Dynamo trace reads these files (TIER1_ONLY)
    files: tuple[str, ...]  # sorted paths of the manifest's files
    offset: int  # where its frame starts, in bytes after the end of manifest.json's frame
    size: int  # its frame's compressed bytes
    # the part whose tar bytes are this frame's zstd dictionary (raw content), or None: buckets of one call are the
    # same kernels at other sizes, and compressed alone each part was 13x larger than the one frame of format 6
    # (CPU, 16 buckets: 2.9 MiB against 238 KiB; against the first config's part of each tier, 338 KiB)
    dictionary: int | None = None

    def serves(self, owner_: str, *, tier1: bool) -> bool:
        """Whether a signature of ``owner_`` needs this part: its tier 2 (a precompiled function) needs only the
        tier-2 parts it owns; a trace (tier 1) its parts of both tiers."""
        return owner_ in self.owners and (tier1 or not self.tier1)


def plan_parts(files: Sequence[str], owners: Mapping[str, Collection[str]], everyone: Sequence[str]) -> list[Part]:
    """The archive's parts for ``files``: one per (tier, set of owners), in a stable order, offsets and sizes 0 (the
    packer fills them). A file no owner is known for (a hand-made tree) belongs to ``everyone``: installing more than
    a signature needs is always correct. Per tier, the part of ``everyone[0]`` (the first config's, on its first
    device: what a start's warm-up installs anyway) is the dictionary of the tier's other parts."""
    groups: dict[tuple[tuple[str, ...], bool], list[str]] = {}
    for rel in sorted(files):
        who = tuple(sorted(set(owners.get(rel, ())))) or tuple(sorted(set(everyone)))
        groups.setdefault((who, rel.startswith(TIER1_ONLY)), []).append(rel)
    order = sorted(groups.items(), key=lambda g: (len(g[0][0]) > 1, g[0][0], g[0][1]))
    first = everyone[0] if everyone else None
    references: dict[bool, int] = {}
    for i, ((who, tier1), _) in enumerate(order):  # its own part (one owner) if it has one, else the first it is in
        if first in who and (tier1 not in references or who == (first,)):
            references[tier1] = i
    return [
        Part(
            owners=who,
            tier1=tier1,
            files=tuple(rels),
            offset=0,
            size=0,
            dictionary=references[tier1] if references.get(tier1, i) != i else None,
        )
        for i, ((who, tier1), rels) in enumerate(order)
    ]


def parse_parts(
    raw: object, files: Collection[str], devices_of: Callable[[], Mapping[str, Collection[int]]]
) -> tuple[Part, ...]:
    """The archive's parts, checked: they partition the files, each frame follows the last without a gap, and every
    owner is a (config, device) pair of the manifest (``devices_of()``: each config id's devices, asked only when a
    part has an owner: a config's id is a hash). Absent: a manifest not packed yet (a hand-made one), with no
    parts."""
    if raw is None:
        return ()
    items = _list(raw)
    if len(items) > MAX_PARTS or len(items) > max(len(files), 1):
        raise ValueError(f"{len(items)} parts for {len(files)} files")
    parts: list[Part] = []
    known: Mapping[str, Collection[int]] | None = None
    seen: set[str] = set()
    offset = 0
    for item in items:
        if not isinstance(item, dict):
            raise TypeError("each part must be an object")
        owners, rels = _list(item.get("owners")), _list(item.get("files"))
        tier1, at, size = item.get("tier1"), item.get("offset"), item.get("size")
        if not isinstance(tier1, bool):
            raise TypeError("a part's tier1 must be true or false")
        for n in (at, size):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise TypeError(f"a part's offset and size must be integers >= 0, got {n!r}")
        if at != offset or not size:
            raise ValueError(f"a part's frame at {at} ({size} bytes) does not follow the last one's end ({offset})")
        offset += size
        # no owner: a manifest with no config (its files install whole, with the artifact)
        if owners and known is None:
            known = devices_of()
        if not all(_owned(o, known) for o in owners) or owners != sorted(set(owners)):
            raise ValueError(
                f"a part's owners must be sorted (config id)@(device) pairs of its configs: {owners[:4]!r}"
            )
        if (
            not rels
            or not all(isinstance(r, str) and r in files and r not in seen for r in rels)
            or rels != sorted(rels)
        ):
            raise ValueError("a part's files must be sorted files of the manifest, each in one part")
        if any(r.startswith(TIER1_ONLY) != tier1 for r in rels):
            raise ValueError(f"a part of tier1 {tier1} holds a file of the other tier")
        dictionary = item.get("dictionary")
        if dictionary is not None and (not isinstance(dictionary, int) or isinstance(dictionary, bool)):
            raise TypeError(f"a part's dictionary must be a part's index or null, got {dictionary!r}")
        seen.update(rels)
        parts.append(
            Part(owners=tuple(owners), tier1=tier1, files=tuple(rels), offset=at, size=size, dictionary=dictionary)
        )
    if len(seen) != len(files):
        missing = sorted(set(files) - seen)[0]
        raise ValueError(f"{len(files) - len(seen)} file(s) in no part, such as {missing!r}")
    for i, part in enumerate(parts):  # one level: a dictionary is read alone
        d = part.dictionary
        if d is not None and not (0 <= d < len(parts) and d != i and parts[d].dictionary is None):
            raise ValueError(f"part {i}'s dictionary {d} is not another part that has none of its own")
    return tuple(parts)


def _owned(name: object, known: Mapping[str, Collection[int]] | None) -> bool:
    if not isinstance(name, str) or known is None:
        return False
    config_id, _, device = name.rpartition("@")
    return device.isascii() and device.isdigit() and int(device) in known.get(config_id, ())


def _list(value: object) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return value
