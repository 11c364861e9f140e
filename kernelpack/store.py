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
import os
import posixpath
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import _fs, _lock, settings
from . import artifact as art
from .errors import KernelpackError, LockMismatchError, NoMatchingArtifactError, RegistryError
from .keys import BuildKey, device_slug, differences, probe

INDEX = "index.json"
ENTRY_SUFFIX = ".json"
LOCK_FORMAT = 1


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

    @property
    def key(self) -> BuildKey:
        return BuildKey.from_dict(self.build_key)

    @property
    def key_id(self) -> str:
        return key_id(self.key)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Entry:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})  # type: ignore[arg-type]


def key_id(key: BuildKey) -> str:
    return f"{key.torch_git[:12]}-{device_slug(key)}-{hashlib.sha256(str(key).encode()).hexdigest()[:8]}"


def _is_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


class Registry:
    """An fsspec-backed registry. ``storage_options`` go to fsspec verbatim."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        import fsspec

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

    def entries(self, recipe: str | None = None) -> list[Entry]:
        if self.read_only:
            with self._errors(f"reading {INDEX}"):
                data = json.loads(self.fs.cat(self._p(INDEX)))
            raw = data.get("entries", []) if isinstance(data, dict) else []
        else:
            with self._errors("listing entries"):
                if not self.fs.exists(self.root or "/"):
                    raise RegistryError(self.url, "registry does not exist (no such directory or bucket)")
                paths = sorted(self.fs.glob(self._p(f"*/*/*{art.SUFFIX}{ENTRY_SUFFIX}")))
                raw = [json.loads(self.fs.cat(p)) for p in paths]
        entries = []
        for d in raw:
            try:
                entries.append(Entry.from_dict(d))
            except (KeyError, TypeError, ValueError):
                continue  # not ours, or from a future format: skip rather than fail every listing
        return sorted(
            (e for e in entries if recipe is None or e.recipe == recipe), key=lambda e: (e.recipe, -e.created, e.path)
        )

    def fetch(self, entry: Entry, dest: Path) -> None:
        """Download the payload to ``dest`` (a temp path the caller renames); raises if it is not all there."""
        with self._errors(f"downloading {entry.path}"):
            self.fs.get_file(self._p(entry.path), str(dest))
        if dest.stat().st_size != entry.size:
            raise RegistryError(self.url, f"{entry.path}: downloaded {dest.stat().st_size} of {entry.size} bytes")

    # ------------------------------------------------------------------------------------------------ writing

    def push(self, artifact: str | os.PathLike[str], *, force: bool = False) -> tuple[Entry, str]:
        """Publish ``artifact``. Returns (entry, "pushed" | "unchanged" | "replaced")."""
        if self.read_only:
            raise RegistryError(
                self.url,
                "http(s) registries are read-only",
                hint="push to the bucket or directory behind it (s3://, gs://, a path) and serve that over http",
            )
        path = str(artifact)
        manifest = art.read_manifest(path)  # a bad artifact is refused before the registry is touched
        self._ensure_root()
        name = os.path.basename(path)
        entry = Entry(
            recipe=manifest.recipe_name,
            name=name,
            path=f"{manifest.recipe_name}/{key_id(manifest.build_key)}/{name}",
            sha256=_fs.sha256_file(path),
            size=os.path.getsize(path),
            created=manifest.created or int(time.time()),
            build_key=manifest.build_key.to_dict(),
            configs=len(manifest.configs),
            devices=list(manifest.devices),
        )
        entry_path = self._p(entry.path + ENTRY_SUFFIX)
        status = "pushed"
        with self._errors(f"pushing {entry.path}"):
            if self.fs.exists(entry_path):
                old = Entry.from_dict(json.loads(self.fs.cat(entry_path)))
                if old.sha256 == entry.sha256:
                    return old, "unchanged"
                if not force:
                    raise RegistryError(
                        self.url,
                        f"{entry.path} already holds another artifact for this build (sha256 {old.sha256[:16]}… "
                        f"!= {entry.sha256[:16]}…)",
                        hint="pass --force to replace it",
                    )
                status = "replaced"
            # Payload first, entry last: an entry is only ever written once its payload is complete.
            self.fs.makedirs(posixpath.dirname(self._p(entry.path)), exist_ok=True)
            self.fs.put_file(path, self._p(entry.path))
            self.fs.pipe_file(entry_path, json.dumps(asdict(entry), indent=1, sort_keys=True).encode())
            self._write_index()
        return entry, status

    def _ensure_root(self) -> None:
        """A local or in-memory registry is created on first push; a missing bucket is an error, never created."""
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        with self._errors("checking the registry"):
            if protocol in ("file", "local", "memory"):
                self.fs.makedirs(self.root, exist_ok=True)
                return
            bucket = self.root.split("/", 1)[0]
            if not self.fs.exists(bucket):
                raise RegistryError(
                    self.url,
                    f"bucket {bucket!r} does not exist",
                    hint="create the bucket first (kernelpack never creates buckets) or fix the URL",
                )

    def _write_index(self) -> None:
        data = {"format": 1, "updated": int(time.time()), "entries": [asdict(e) for e in self.entries()]}
        self.fs.pipe_file(self._p(INDEX), json.dumps(data, indent=1, sort_keys=True).encode())


# ------------------------------------------------------------------------------------------------ selection


def select(entries: list[Entry], here: dict[str, BuildKey], registry: str, recipe: str) -> Entry:
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
    raise NoMatchingArtifactError(registry, recipe, reasons)


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


def download(registry: Registry, entry: Entry) -> tuple[Path, bool]:
    """The entry's payload in the node-local download cache (``KERNELPACK_DOWNLOAD_DIR``), downloaded once per node:
    (path, downloaded_now).

    A file lock makes N workers that start together download once (the rest wait and reuse); the payload is written
    to a temp name, checked (size, sha256) and renamed, so a killed download never leaves a file that looks complete.
    """
    cache = settings.download_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelpackError(
            f"cannot create the download cache {cache}: {type(e).__name__}: {e}",
            hint="set KERNELPACK_DOWNLOAD_DIR to a writable directory",
        ) from None
    final = cache / f"{entry.sha256}{art.SUFFIX}"
    with _lock.file_lock(cache / f"{entry.sha256}.lock", what="download"):
        if final.is_file() and final.stat().st_size == entry.size:
            return final, False
        _fs.reap_dead(cache, f".{final.name}.")  # temp files of downloads killed on this node
        with _fs.atomic_path(final) as tmp:
            registry.fetch(entry, tmp)
            got = _fs.sha256_file(tmp)
            if got != entry.sha256:
                raise RegistryError(
                    registry.url,
                    f"{entry.path}: sha256 {got} != published {entry.sha256}",
                    hint="the object changed or was corrupted in transit; push it again",
                )
    return final, True


# ------------------------------------------------------------------------------------------------ lock files


def write_lock(registry: Registry, recipe: str, out: str | os.PathLike[str]) -> dict[str, Any]:
    """Pin every build of ``recipe`` in the registry: per build key, the artifact path and its sha256."""
    entries = registry.entries(recipe)
    if not entries:
        raise NoMatchingArtifactError(registry.url, recipe, [])
    pins: dict[str, dict[str, Any]] = {}
    for e in entries:  # newest first: the newest build of each key is the pin
        pins.setdefault(
            e.key_id, {"key_id": e.key_id, "build_key": e.build_key, "path": e.path, "sha256": e.sha256, "size": e.size}
        )
    data = {
        "format": LOCK_FORMAT,
        "registry": registry.url,
        "recipe": recipe,
        "artifacts": sorted(pins.values(), key=lambda p: p["key_id"]),
    }
    out = Path(out)
    try:
        _fs.write_bytes(out, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())
    except OSError as e:
        raise KernelpackError(f"cannot write the lock file {out}: {e}", hint="choose a writable path with -o") from e
    return data


def read_lock(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
        if data.get("format") != LOCK_FORMAT or not isinstance(data.get("artifacts"), list):
            raise ValueError(f"unsupported lock format {data.get('format')!r}")
        for pin in data["artifacts"]:
            str(pin["key_id"]), str(pin["sha256"])
    except FileNotFoundError:
        raise KernelpackError(f"lock file not found: {path}", hint="create it with kernelpack lock") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise KernelpackError(
            f"{path}: not a kernelpack lock file: {e}", hint="regenerate it with kernelpack lock"
        ) from None
    return data


def check_pin(lock: dict[str, Any], lock_path: str, entry: Entry) -> None:
    if lock.get("recipe") != entry.recipe:
        raise LockMismatchError(
            f"{lock_path} pins recipe {lock.get('recipe')!r}, not {entry.recipe!r}", hint="use the recipe's lock file"
        )
    pin = next((p for p in lock["artifacts"] if p["key_id"] == entry.key_id), None)
    if pin is None:
        pinned = ", ".join(p["key_id"] for p in lock["artifacts"]) or "nothing"
        raise LockMismatchError(
            f"{lock_path} has no pin for this build ({entry.key_id}); it pins {pinned}",
            hint="regenerate the lock file (kernelpack lock) after pushing an artifact for this build",
        )
    if pin["sha256"] != entry.sha256:
        raise LockMismatchError(
            f"{entry.path}: sha256 {entry.sha256} does not match the pin {pin['sha256']} in {lock_path}",
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
    entry = select(entries, _here_keys(entries, device_index), registry.url, recipe)
    if lock is not None:
        check_pin(read_lock(lock), str(lock), entry)
    path, downloaded = download(registry, entry)
    return PullResult(entry, path, downloaded)
