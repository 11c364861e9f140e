"""Registries: publish artifacts to any fsspec URL, select the one built for this torch, pull it once per node.

Layout (one registry serves many recipes and torch builds)::

    <registry>/index.json                                  every entry below, for ``ls`` and http(s) registries
    <registry>/<recipe>/<key-id>/<artifact>.kpack          the payload
    <registry>/<recipe>/<key-id>/<artifact>.kpack.json     its entry: sha256, size, build key, created, configs

``<key-id>`` is ``<torch commit12>-<gpu|cpu>-<hash8 of the whole build key>``: one directory per exact build.
A push uploads the payload first, then the entry, then rewrites the index from the entries present, so a reader
never sees an entry whose payload is missing or partial, and concurrent pushers converge. ``ls`` and ``pull`` read
the entries themselves (the source of truth) except on http(s), which can only read ``index.json``.

Credentials and endpoints come from fsspec's usual options and environment (``--storage-option
endpoint_url=...``, AWS_* variables, ...); kernelpack handles no secrets.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from . import _fs, _lock, settings
from . import artifact as art
from . import manifest as mf
from .errors import (
    KernelpackError,
    KernelpackWarning,
    LockMismatchError,
    NoMatchingArtifactError,
    RegistryError,
    printable,
)
from .keys import BuildKey, device_slug, differences, probe
from .recipe import check_name
from .records import Lock, Pin

INDEX = "index.json"
ENTRY_SUFFIX = ".json"


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    recipe: str
    name: str
    path: str  # of the payload, relative to the registry root
    sha256: str
    size: int
    created: int
    build_key: dict[str, str]
    configs: int
    devices: list[int]
    # the manifest's inputs_sha256: a rebuild of the same recipe on the same torch build has the same (entries
    # pushed before it existed have "")
    inputs: str = ""

    @property
    def key(self) -> BuildKey:
        return BuildKey.from_dict(self.build_key)

    @property
    def key_id(self) -> str:
        return key_id(self.key)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Entry:
        """A registry entry, validated: every field that becomes a path, a size or a hash is checked here, before
        anything uses it (an entry is data from whoever can write the registry). Raises ValueError naming the
        field."""
        if not isinstance(d, Mapping):
            raise ValueError("an entry must be a JSON object")
        missing = sorted(set(cls.__dataclass_fields__) - d.keys() - {"inputs"})
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        problem = check_name(d["recipe"])
        if problem:
            raise ValueError(f"recipe {d['recipe']!r} {problem}")
        name = d["name"]
        if not safe_component(name) or not str(name).endswith(mf.SUFFIX):
            raise ValueError(f"name {name!r} is not a safe {mf.SUFFIX} file name")
        if not isinstance(d["sha256"], str) or not _SHA256.fullmatch(d["sha256"]):
            raise ValueError(f"sha256 {d['sha256']!r} is not 64 lowercase hex digits")
        for field_name, top in (("size", _MAX_PAYLOAD), ("created", _MAX_CREATED), ("configs", 1 << 32)):
            value = d[field_name]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
                raise ValueError(f"{field_name} {value!r} is not an integer in [0, {top}]")
        devices = d["devices"]
        if not isinstance(devices, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in devices):
            raise ValueError(f"devices {devices!r} is not a list of integers")
        build_key = d["build_key"]
        if not isinstance(build_key, dict) or not all(isinstance(v, str) for v in build_key.values()):
            raise ValueError("build_key is not an object of strings")
        inputs = d.get("inputs", "")
        if inputs and (not isinstance(inputs, str) or not _SHA256.fullmatch(inputs)):
            raise ValueError(f"inputs {inputs!r} is not 64 lowercase hex digits")
        entry = cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        key = BuildKey.from_dict(build_key)  # validates the parts that name directories
        expected = f"{entry.recipe}/{key_id(key)}/{entry.name}"
        if entry.path not in (expected, superseded_path(entry.recipe, key_id(key), entry.sha256, entry.name)):
            raise ValueError(f"path {entry.path!r} is not where this entry's payload belongs ({expected!r})")
        return entry


def superseded_path(recipe: str, key: str, sha256: str, name: str) -> str:
    """Where an artifact replaced by ``push --force`` is kept: locks that pin it still pull it, while ``ls`` and
    ``lock`` see only the one current artifact of its build key."""
    return f"{recipe}/{key}/{SUPERSEDED}/{sha256}/{name}"


SUPERSEDED = "superseded"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_PAYLOAD = 1 << 40  # bytes of one artifact
_MAX_CREATED = 1 << 34  # seconds since the epoch (the year 2514)
_MAX_ENTRY_BYTES = 1 << 20  # one entry's JSON
_MAX_INDEX_BYTES = 64 << 20


class PushResult(NamedTuple):
    entry: Entry
    status: str  # "pushed" | "unchanged" | "rebuild" (same inputs, other bytes: kept the published) | "replaced" |
    # "repaired"
    created_registry: bool  # this push made a new registry (there was no index): a mistyped path shows here


def safe_component(value: object) -> bool:
    """Whether ``value`` can be one path component of a registry or cache path: no separator, no '..', no control
    character (which would also reach a terminal raw)."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= 255
        and value not in (".", "..")
        and not value.startswith(".")
        and not any(c in value for c in "/\\")
        and value.isprintable()
    )


def key_id(key: BuildKey) -> str:
    return f"{key.torch_git[:12]}-{device_slug(key)}-{hashlib.sha256(str(key).encode()).hexdigest()[:8]}"


def _is_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


class Registry:
    """An fsspec-backed registry. ``storage_options`` go to fsspec verbatim."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        import fsspec

        if not str(url).strip():
            raise RegistryError(repr(url), "an empty registry URL", hint="pass a directory path or a URL")
        self.url = url.rstrip("/") or url
        self.read_only = _is_http(url)
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        except ImportError as e:
            extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}.get(url.split("://", 1)[0], "")
            raise RegistryError(
                url,
                f"no filesystem for this URL: {e}",
                hint=f"pip install 'kernelpack[{extra}]'" if extra else "install the fsspec backend for this URL",
            ) from None
        except (ValueError, TypeError) as e:
            raise RegistryError(url, f"bad registry URL or storage options: {e}") from None
        self.root = root.rstrip("/") if root not in ("/", "") else root

    def _p(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if self.root else rel

    @contextlib.contextmanager
    def _errors(self, what: str):  # type: ignore[no-untyped-def]
        """Storage backends raise their own types (botocore, aiohttp, OSError): one error that names the operation."""
        try:
            yield
        except KernelpackError:
            raise
        except FileNotFoundError as e:
            raise RegistryError(self.url, f"{what}: not found ({e})") from e
        except Exception as e:  # the backend's own errors (network, auth): reported with their type
            raise RegistryError(self.url, f"{what} failed: {type(e).__name__}: {e}") from e

    # ------------------------------------------------------------------------------------------------ reading

    def entries(self, recipe: str | None = None, *, superseded: bool = False) -> list[Entry]:
        """Every valid entry (of ``recipe``), newest first: the one current artifact per build key, or
        (``superseded``) those ``push --force`` replaced, which only a lock that pins one pulls. A malformed or
        unreadable entry is skipped with one warning naming it: it must not stop every pull of every other
        recipe."""
        raw: list[tuple[str, Any]] = []
        skipped: list[str] = []
        if self.read_only:
            with self._errors(f"reading {INDEX}"):
                blob = self._read(self._p(INDEX), _MAX_INDEX_BYTES)
            if len(blob) > _MAX_INDEX_BYTES:
                raise RegistryError(self.url, f"{INDEX} is over {_MAX_INDEX_BYTES} bytes")
            try:
                data = json.loads(blob)
            except (ValueError, RecursionError) as e:
                raise RegistryError(
                    self.url, f"{INDEX} is not valid JSON: {e}", hint="push again to rewrite it"
                ) from None
            items = data.get(SUPERSEDED if superseded else "entries", []) if isinstance(data, dict) else []
            raw = [(f"{INDEX} entry {i}", d) for i, d in enumerate(items if isinstance(items, list) else [])]
        else:
            with self._errors("listing entries"):
                if not self.fs.exists(self.root or "/"):
                    raise RegistryError(self.url, "registry does not exist (no such directory or bucket)")
                if self._local() and not self.fs.isdir(self.root or "/"):
                    raise RegistryError(
                        self.url, "is a file, not a registry directory", hint="pass the registry's directory"
                    )
                pattern = f"*/*/{SUPERSEDED}/*/*" if superseded else "*/*/*"
                paths = sorted(self.fs.glob(self._p(f"{pattern}{mf.SUFFIX}{ENTRY_SUFFIX}")))
            for p in paths:
                try:
                    with self._errors(f"reading {p}"):
                        blob = self._read(p, _MAX_ENTRY_BYTES)
                    if len(blob) > _MAX_ENTRY_BYTES:
                        raise ValueError(f"over {_MAX_ENTRY_BYTES} bytes")
                    raw.append((p, json.loads(blob)))
                except (ValueError, RecursionError, RegistryError) as e:
                    skipped.append(f"{p}: {e}")
        entries = []
        for where, d in raw:
            try:
                entry = Entry.from_dict(d)
                if (f"/{SUPERSEDED}/" in entry.path) != superseded:
                    raise ValueError(f"path {entry.path!r} is not where this list's entries are")
                entries.append(entry)
            except (KeyError, TypeError, ValueError) as e:
                skipped.append(f"{where}: {e}")
        if skipped:
            shown = "; ".join(printable(x) for x in skipped[:3]) + (
                f"; and {len(skipped) - 3} more" if len(skipped) > 3 else ""
            )
            noun = "entry" if len(skipped) == 1 else "entries"
            warnings.warn(
                f"kernelpack: skipped {len(skipped)} malformed {noun} in {self.url}: {shown}",
                KernelpackWarning,
                stacklevel=2,
            )
        return sorted(
            (e for e in entries if recipe is None or e.recipe == recipe), key=lambda e: (e.recipe, -e.created, e.path)
        )

    def recipes(self) -> list[str]:
        """The names of the recipes the registry has artifacts of (for a did-you-mean)."""
        with warnings.catch_warnings():  # whoever listed the entries already warned of a malformed one
            warnings.simplefilter("ignore", KernelpackWarning)
            return sorted({e.recipe for e in self.entries()})

    def _read(self, path: str, limit: int) -> bytes:
        """At most ``limit + 1`` bytes of ``path``, streamed (an http body that never ends is not read to its end:
        fsspec's ``cat`` would)."""
        with self.fs.open(path, "rb", block_size=0) if _is_http(self.url) else self.fs.open(path, "rb") as f:
            chunks, n = [], 0
            while n <= limit and (chunk := f.read(min(_fs.CHUNK, limit + 1 - n))):
                chunks.append(chunk)
                n += len(chunk)
        return b"".join(chunks)

    def fetch(self, entry: Entry, dest: Path) -> str:
        """Download the payload to ``dest`` (a new temp path the caller renames), reading at most the published size
        (a payload that never ends is cut off there); returns its sha256. Raises if it is not all there."""
        h = hashlib.sha256()
        n = 0
        with self._errors(f"downloading {entry.path}"):
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _fs.FILE_MODE)
            with self.fs.open(self._p(entry.path), "rb") as src, os.fdopen(fd, "wb") as out:
                while chunk := src.read(min(_fs.CHUNK, entry.size + 1 - n)):
                    n += len(chunk)
                    if n > entry.size:
                        raise RegistryError(
                            self.url, f"{entry.path}: longer than the {entry.size} bytes published; stopped reading"
                        )
                    h.update(chunk)
                    out.write(chunk)
        if n != entry.size:
            raise RegistryError(self.url, f"{entry.path}: downloaded {n} of {entry.size} bytes")
        return h.hexdigest()

    # ------------------------------------------------------------------------------------------------ writing

    def push(self, artifact: str | os.PathLike[str], *, force: bool = False) -> PushResult:
        """Publish ``artifact``, checked whole first. Returns (entry, "pushed" | "unchanged" | "rebuild" |
        "replaced" | "repaired", whether the registry was created by this push): "rebuild" is another artifact with
        the published one's inputs (the published one is kept and returned), "replaced" needs ``force``."""
        if self.read_only:
            raise RegistryError(
                self.url,
                "http(s) registries are read-only",
                hint="push to the bucket or directory behind it (s3://, gs://, a path) and serve that over http",
            )
        path = str(artifact)
        sha256 = _fs.sha256_file(path) if os.path.isfile(path) else ""
        # Every member and the frame's end, before the registry is touched: a truncated or corrupt artifact would
        # be published, pinned by `lock`, and fail every job's install
        manifest = art.check_members(path).manifest
        if _fs.sha256_file(path) != sha256:
            raise KernelpackError(f"{path} changed while it was checked", hint="push it again once it is written")
        created = self._ensure_root()
        name = os.path.basename(path)
        entry = Entry(
            recipe=manifest.recipe_name,
            name=name,
            path=f"{manifest.recipe_name}/{key_id(manifest.build_key)}/{name}",
            sha256=sha256,
            size=os.path.getsize(path),
            created=manifest.created or int(time.time()),
            build_key=manifest.build_key.to_dict(),
            configs=len(manifest.configs),
            devices=list(manifest.devices),
            inputs=manifest.inputs_sha256(),
        )
        Entry.from_dict(asdict(entry))  # the names this push writes under are safe path components
        key_dir = posixpath.dirname(self._p(entry.path))
        with self._errors(f"pushing {entry.path}"):
            self._check_inside(key_dir)
            self.fs.makedirs(key_dir, exist_ok=True)
            with self._key_lock(key_dir):
                # One artifact per (recipe, build key), whatever its file name: `lock` pins by build key, so two
                # entries for one key would be pinned one at random, and renaming a file must not bypass --force
                present = self._entries_in(key_dir)
                same = sorted((e for e in present if e.sha256 == entry.sha256), key=lambda e: e.name != name)
                damaged = [e for e in present if not e.sha256 and e.name == name]  # this push rewrites it
                others = [e for e in present if e.sha256 != entry.sha256 and e not in damaged]
                if others and not force and not same and all(e.inputs == entry.inputs for e in others):
                    # a rebuild (CI re-run): its bytes differ, its inputs do not. The published one stays, so
                    # locks that pin it stay valid and re-running CI's publish step succeeds
                    return PushResult(others[0], "rebuild", created)
                if others and not force:
                    shown = ", ".join(f"{e.name} (sha256 {e.sha256[:16]}…)" for e in others[:3])
                    raise RegistryError(
                        self.url,
                        f"{manifest.recipe_name}/{key_id(manifest.build_key)} already holds another artifact for "
                        f"this build key: {shown}; this one has sha256 {entry.sha256[:16]}…",
                        hint="pass --force to replace it (the registry keeps one artifact per recipe and build key)",
                    )
                status = "pushed"
                if same:
                    entry = replace(entry, name=same[0].name, path=same[0].path)
                    if self._payload_intact(entry) and not force and not others:
                        return PushResult(same[0], "unchanged", created)
                    status = "repaired"  # the payload is missing or cut short (or --force: maybe corrupt)
                if damaged:
                    status = "repaired"
                if others:
                    status = "replaced"
                for old in others:  # kept for the locks that pin them, before anything of theirs is replaced
                    self._supersede(old)
                # Payload first, entry last: an entry is only ever written once its payload is complete.
                entry_path = self._p(entry.path + ENTRY_SUFFIX)
                self._put(path, self._p(entry.path))
                self._pipe(entry_path, json.dumps(asdict(entry), indent=1, sort_keys=True).encode())
                for old in (*others, *same[1:]):  # --force: the replaced ones go, entry before payload
                    if old.path != entry.path:
                        self._remove(old)
            self._write_index()
        return PushResult(entry, status, created)

    def _entries_in(self, key_dir: str) -> list[Entry]:
        """The entries of one (recipe, build key) directory; a damaged entry counts as one of another artifact
        (sha256 "") so that only --force writes over it."""
        found = []
        for p in sorted(self.fs.glob(posixpath.join(key_dir, f"*{mf.SUFFIX}{ENTRY_SUFFIX}"))):
            try:
                blob = self._read(p, _MAX_ENTRY_BYTES)
                entry = Entry.from_dict(json.loads(blob))
            except (ValueError, KeyError, TypeError, RecursionError, OSError):
                name = posixpath.basename(p)[: -len(ENTRY_SUFFIX)]
                rel = posixpath.relpath(p, self.root)[: -len(ENTRY_SUFFIX)] if self.root else p[: -len(ENTRY_SUFFIX)]
                entry = Entry(recipe="", name=name, path=rel, sha256="", size=0, created=0, build_key={}, configs=0,
                              devices=[])  # fmt: skip
            found.append(entry)
        return found

    def _supersede(self, old: Entry) -> None:
        """Copy a replaced artifact (payload, then entry) to its superseded place. A damaged entry has nothing to
        keep."""
        if not old.sha256 or not self._payload_intact(old):
            return
        kept = replace(old, path=superseded_path(old.recipe, old.key_id, old.sha256, old.name))
        self.fs.makedirs(posixpath.dirname(self._p(kept.path)), exist_ok=True)
        if self._local():
            with _fs.atomic_path(Path(self._p(kept.path))) as tmp:
                shutil.copyfile(self._p(old.path), tmp)
        else:
            self.fs.copy(self._p(old.path), self._p(kept.path))
        self._pipe(self._p(kept.path + ENTRY_SUFFIX), json.dumps(asdict(kept), indent=1, sort_keys=True).encode())

    def _remove(self, entry: Entry) -> None:
        for p in (self._p(entry.path + ENTRY_SUFFIX), self._p(entry.path)):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(p)

    @contextlib.contextmanager
    def _key_lock(self, key_dir: str) -> Iterator[None]:
        """On a local directory, the artifacts of one build key are written by one pusher at a time, so its payload
        and entry always agree and it never holds two (an object store has no lock: the sha256 check on download
        catches a mix, and the next push with --force leaves one)."""
        if not self._local():
            yield
            return
        with _lock.file_lock(Path(key_dir) / ".entries.lock", what="registry entry"):
            yield

    def _check_inside(self, directory: str) -> None:
        """On a local directory: ``directory`` (or what of it exists) must resolve inside the registry, checked
        before anything is made below it: a symlink in the registry must not lead a push elsewhere."""
        if not self._local():
            return
        existing = Path(directory)
        while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
            existing = existing.parent
        if not existing.resolve().is_relative_to(Path(self.root or "/").resolve()):
            raise RegistryError(self.url, f"{existing} leads outside the registry (a symlink); refusing to write")

    def _payload_intact(self, entry: Entry) -> bool:
        try:
            return bool(self.fs.size(self._p(entry.path)) == entry.size)
        except (FileNotFoundError, OSError):
            return False

    def _local(self) -> bool:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return protocol in ("file", "local")

    def _put(self, src: str, dest: str) -> None:
        """Upload a file. On a local directory through a temp name and a rename, so that a reader (or a pusher
        replacing it) never sees it half-written; an object store's put is atomic per object."""
        if self._local():
            _fs.reap_dead(Path(dest).parent, f".{Path(dest).name}.")  # temp payloads of pushes killed on this host
            with _fs.atomic_path(Path(dest)) as tmp:
                shutil.copyfile(src, tmp)
            return
        self.fs.put_file(src, dest)

    def _pipe(self, dest: str, data: bytes) -> None:
        if self._local():
            _fs.write_bytes(Path(dest), data)
            return
        self.fs.pipe_file(dest, data)

    def _ensure_root(self) -> bool:
        """A local or in-memory registry is created on first push; a missing bucket is an error, never created, and
        so is a local directory whose parent is missing (a mistyped path must not become a registry no one pulls
        from). Returns whether there is no registry here yet (no index)."""
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        with self._errors("checking the registry"):
            if protocol in ("file", "local", "memory"):
                new = not self.fs.exists(self._p(INDEX))
                parent = Path(self.root).parent
                if protocol != "memory" and not parent.is_dir():
                    raise RegistryError(
                        self.url,
                        f"the parent directory {parent} does not exist; refusing to create a registry there",
                        hint=f"create {parent} first if the path is right, or check the path for a typo",
                    )
                self.fs.makedirs(self.root, exist_ok=True)
                return new
            bucket = self.root.split("/", 1)[0]
            if not self.fs.exists(bucket):
                raise RegistryError(
                    self.url,
                    f"bucket {bucket!r} does not exist",
                    hint="create the bucket first (kernelpack never creates buckets) or fix the URL",
                )
            return not self.fs.exists(self._p(INDEX))

    def _write_index(self) -> None:
        """Rewrite the index from the entries present. On a local directory under a file lock and atomically: a
        reader never sees it half-written and concurrent pushers lose no entry (each rewrites from all entries
        present, in turn). On an object store, where no conditional write exists, the last writer wins: ``ls`` and
        ``pull`` read the entries themselves, so an index that missed a concurrent push hides nothing from them
        (only http(s) registries read the index, and the next push rewrites it whole)."""
        if not self._local():
            self._pipe(self._p(INDEX), self._index_bytes())
            return
        with _lock.file_lock(Path(self._p(".index.lock")), what="registry index"):
            self._pipe(self._p(INDEX), self._index_bytes())

    def _index_bytes(self) -> bytes:
        with warnings.catch_warnings():  # a malformed entry was warned of by whoever listed it
            warnings.simplefilter("ignore", KernelpackWarning)
            entries = [asdict(e) for e in self.entries()]
            superseded = [asdict(e) for e in self.entries(superseded=True)]
        return json.dumps(
            {"format": 1, "updated": int(time.time()), "entries": entries, SUPERSEDED: superseded},
            indent=1,
            sort_keys=True,
        ).encode()


# ------------------------------------------------------------------------------------------------ selection


def select(
    entries: list[Entry], here: dict[str, BuildKey], registry: str, recipe: str, known: Sequence[str] = ()
) -> Entry:
    """The newest entry whose build key matches this environment; else an error with every candidate's reason.

    ``here`` maps a device type ("cuda", "cpu") to this process's key for it (probing CUDA only when needed).
    """
    reasons = []
    for e in entries:
        key = e.key
        mine = here.get(key.device_type)
        if mine is None:
            reasons.append(f"{e.path}: built for {key.device_type}, which this process does not have")
            continue
        diffs = differences(key, mine)
        if not diffs:
            return e
        reasons.append(f"{e.path}: " + "; ".join(f"{f} {a!r} != here {b!r}" for f, a, b in diffs))
    raise NoMatchingArtifactError(registry, recipe, reasons, known)


def _here_keys(entries: list[Entry], device_index: int) -> dict[str, BuildKey]:
    keys = {}
    for device_type in sorted({e.key.device_type for e in entries}):
        if device_type == "cuda":
            import torch

            if not torch.cuda.is_available():
                continue
        keys[device_type] = probe(device_type, device_index)
    return keys


# ------------------------------------------------------------------------------------------------ download cache


log = logging.getLogger(__name__)


def download(registry: Registry, entry: Entry) -> tuple[Path, bool]:
    """The entry's payload in the node-local download cache (``KERNELPACK_DOWNLOAD_DIR``), downloaded once per node:
    (path, downloaded_now).

    A file lock makes N workers that start together download once (the rest wait and reuse); the payload is written
    to a temp name, checked (size, sha256) and renamed, so a killed download never leaves a file that looks complete.
    """
    cache = settings.download_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        _check_private(cache)
    except OSError as e:
        raise KernelpackError(
            f"cannot use the download cache {cache}: {type(e).__name__}: {e}",
            hint="set KERNELPACK_DOWNLOAD_DIR to a writable directory",
        ) from None
    final = cache / f"{entry.sha256}{mf.SUFFIX}"  # entry.sha256 is 64 hex digits (Entry.from_dict)
    with _lock.file_lock(cache / f"{entry.sha256}.lock", what="download"):
        if final.is_file() and not final.is_symlink():
            # reused only when it is the pinned artifact itself: its size is no proof
            if final.stat().st_size == entry.size and _fs.sha256_file(final) == entry.sha256:
                return final, False
            log.warning("%s is not the artifact %s names; downloading it again", final, entry.path)
            final.unlink()
        elif final.is_symlink():
            final.unlink()  # never followed
        _fs.reap_dead(cache, f".{final.name}.")  # temp files of downloads killed on this node
        if final.exists() or final.is_symlink():
            raise KernelpackError(
                f"{final} is in the way (not a regular file)", hint="remove it: kernelpack downloads to that name"
            )
        with _fs.atomic_path(final) as tmp:
            got = registry.fetch(entry, tmp)
            if got != entry.sha256:
                raise RegistryError(
                    registry.url,
                    f"{entry.path}: sha256 {got} != published {entry.sha256}",
                    hint="the object changed or was corrupted in transit; push it again",
                )
    return final, True


def _check_private(cache: Path) -> None:
    """The download cache holds code every worker will execute: refuse one that another user can write (a shared
    /tmp path, say), where a file could be swapped after it was checked."""
    if cache.is_symlink():
        raise KernelpackError(
            f"the download cache {cache} is a symlink", hint="set KERNELPACK_DOWNLOAD_DIR to the real directory"
        )
    problem = _fs.private_dir_problem(cache)
    if problem:
        raise KernelpackError(
            f"the download cache {cache} {problem}: another user could replace an artifact after it was verified",
            hint="set KERNELPACK_DOWNLOAD_DIR to a directory only you can write (the default "
            "~/.cache/kernelpack/downloads is), or chmod go-w it",
        )


# ------------------------------------------------------------------------------------------------ lock files


def write_lock(registry: Registry, recipe: str, out: str | os.PathLike[str]) -> Lock:
    """Pin every build of ``recipe`` in the registry: per build key, the artifact path and its sha256."""
    if not str(out).strip():
        raise KernelpackError(
            "lock -o: an empty file name", hint="kernelpack lock REGISTRY --recipe R -o kernelpack.lock"
        )
    try:
        _fs.check_replaceable(Path(out))
    except OSError as err:
        raise KernelpackError(
            f"lock -o {out}: {err.strerror}", hint="pass -o a new file name or a regular file"
        ) from None
    entries = registry.entries(recipe)
    if not entries:
        raise NoMatchingArtifactError(registry.url, recipe, [], registry.recipes())
    pins: dict[str, Pin] = {}
    for e in entries:  # newest first: the newest build of each key is the pin
        pins.setdefault(e.key_id, Pin(e.key_id, dict(e.build_key), e.path, e.sha256, e.size))
    lock = Lock(registry.url, recipe, tuple(sorted(pins.values(), key=lambda p: p.key_id)))
    out = Path(out)
    try:
        _fs.write_bytes(out, (json.dumps(lock.to_dict(), indent=1, sort_keys=True) + "\n").encode())
    except OSError as e:
        raise KernelpackError(f"cannot write the lock file {out}: {e}", hint="choose a writable path with -o") from e
    return lock


_MAX_LOCK_BYTES = 16 << 20  # one pin per build key: a few hundred bytes each


def read_lock(path: str | os.PathLike[str]) -> Lock:
    try:
        lock = Lock.from_dict(json.loads(_fs.read_regular(path, _MAX_LOCK_BYTES)))
    except FileNotFoundError:
        raise KernelpackError(f"lock file not found: {path}", hint="create it with kernelpack lock") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise KernelpackError(
            f"{path}: not a kernelpack lock file: {type(e).__name__}: {e}", hint="regenerate it with kernelpack lock"
        ) from None
    return lock


def check_pin(lock: Lock, lock_path: str, entry: Entry) -> None:
    if lock.recipe != entry.recipe:
        raise LockMismatchError(
            f"{lock_path} pins recipe {lock.recipe!r}, not {entry.recipe!r}", hint="use the recipe's lock file"
        )
    pin = lock.pinned(entry.key_id)
    if pin is None:
        pinned = ", ".join(p.key_id for p in lock.pins) or "nothing"
        raise LockMismatchError(
            f"{lock_path} has no pin for this build ({entry.key_id}); it pins {pinned}",
            hint="regenerate the lock file (kernelpack lock) after pushing an artifact for this build",
        )
    if pin.sha256 != entry.sha256:
        raise LockMismatchError(
            f"{entry.path}: sha256 {entry.sha256} does not match the pin {pin.sha256} in {lock_path}",
            hint="the registry's artifact changed since the lock was written: review it, then regenerate the lock",
        )


# ------------------------------------------------------------------------------------------------ pull


@dataclass(frozen=True, slots=True)
class PullResult:
    entry: Entry
    path: Path  # in the download cache
    downloaded: bool


def pull(
    registry_url: str,
    recipe: str,
    *,
    lock: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    device_index: int = 0,
) -> PullResult:
    """Select the artifact built for this environment, check it against the ``lock`` pin, and download it (once per
    node, verified). Installing it is :mod:`kernelpack.installer`'s job."""
    registry = Registry(registry_url, storage_options)
    entries = registry.entries(recipe)
    known = () if entries else registry.recipes()
    entry = select(entries, _here_keys(entries, device_index), registry.url, recipe, known)
    if lock is not None:
        pins = read_lock(lock)
        pinned = {p.sha256 for p in pins.pins if p.key_id == entry.key_id}
        # the pinned build, not the current one: a newer push for this build (push --force keeps the one it
        # replaced, superseded) must not break or replace a pinned pull
        current = entry
        entry = next((e for e in entries if e.key_id == entry.key_id and e.sha256 in pinned), entry)
        if entry.sha256 not in pinned:
            kept = registry.entries(recipe, superseded=True)
            entry = next((e for e in kept if e.key_id == current.key_id and e.sha256 in pinned), current)
        check_pin(pins, str(lock), entry)
    path, downloaded = download(registry, entry)
    return PullResult(entry, path, downloaded)
