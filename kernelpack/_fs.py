"""Filesystem mechanics shared by every stage that writes: atomic writes, no-clobber links, tracked directory
creation, and reaping what killed processes left behind.

Invariants:
- A file kernelpack writes appears complete or not at all: it is written to a unique temp name in the SAME
  directory, then ``os.replace``d; every exit path removes the temp file.
- Files are created 0644 and directories 0755 *under the umask*: never group/world-writable, even with umask 0
  (caches and artifacts hold code that workers execute), and never 0600 (mkstemp's), which would hide a shared
  artifact from the node's other users.
- Temp files and staging directories carry their owner (host and pid) in their name, so that a later process can
  tell a killed writer's leftovers from a live one's: SIGKILL skips every cleanup. A pid means nothing in another
  PID namespace (two pods sharing a hostPath cache and a hostname), so a staging directory also holds an flock on
  its ``.owner`` file for as long as its writer lives: the kernel drops it when the writer dies, whatever killed it,
  and a reaper that can take it knows the directory is dead (:func:`make_stage_dir`, :func:`reap_dead`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

CHUNK = 1 << 20
FILE_MODE = 0o644
DIR_MODE = 0o755


def sha256_file(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _host() -> str:
    # only [A-Za-z0-9_] so that "<host>-<pid>-" parses back unambiguously
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname()) or "host"


def owner_tag() -> str:
    """``<host>-<pid>-``: the start of every temp name this process makes (see :func:`reap_dead`)."""
    return f"{_host()}-{os.getpid()}-"


def temp_path(final: Path) -> Path:
    """A unique name beside ``final`` for a file that becomes ``final`` once complete."""
    return final.with_name(f".{final.name}.{owner_tag()}{secrets.token_hex(6)}.tmp")


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """The body writes the yielded temp path (by any means: a download, a copy); when it returns, the file becomes
    ``final``; when it raises, the temp file is removed and ``final`` is untouched."""
    tmp = temp_path(final)
    try:
        yield tmp
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_write(final: Path, *, fsync: bool = False) -> Iterator[IO[bytes]]:
    """Write ``final`` atomically through the yielded file (see :func:`atomic_path`).

    ``fsync`` makes the content durable before it becomes visible (an artifact; not needed for a marker)."""
    with atomic_path(final) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())


def write_bytes(final: Path, data: bytes) -> None:
    with atomic_write(final) as f:
        f.write(data)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def reap_dead(directory: Path, prefix: str) -> None:
    """Remove ``directory``'s entries named ``<prefix><host>-<pid>-...`` whose writer is gone: for a staging directory
    with an ``.owner`` file, when nobody holds its flock (valid across PID namespaces); otherwise when the pid, a
    process on this host, is not alive. Entries of other hosts (a shared filesystem) and live ones are left alone."""
    mine = f"{prefix}{_host()}-"
    try:
        names = [n for n in os.listdir(directory) if n.startswith(mine)]
    except OSError:
        return
    for name in names:
        path = directory / name
        owned = _owner_alive(path)
        if owned is None:  # no owner file: the pid tells
            pid = name[len(mine) :].split("-", 1)[0]
            owned = not pid.isdigit() or pid_alive(int(pid))
        if owned:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()


OWNER_FILE = ".owner"
_INIT_PREFIX = ".kernelpack-init-"
_owned: dict[Path, int] = {}  # staging directory -> the fd holding the flock on its owner file


def _owner_alive(path: Path) -> bool | None:
    """Whether the process that made staging directory ``path`` still holds its owner flock; None when ``path`` has
    no owner file (a temp file, or a directory of an older kernelpack) or flock is not available."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return None
    if path in _owned:
        return True  # ours (flock is per open file: taking it again here would succeed)
    try:  # non-blocking: a FIFO planted as the owner file must not hang the reaper
        fd = os.open(path / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)
    return False


def make_stage_dir(root: Path, prefix: str) -> Path:
    """A fresh private directory in ``root`` named ``<prefix><owner>...``, whose owner flock this process holds until
    :func:`remove_stage_dir`; dead owners' ones are reaped first."""
    reap_dead(root, prefix)
    reap_dead(root, _INIT_PREFIX)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: the pid in the name is the only owner mark
        return Path(tempfile.mkdtemp(prefix=prefix + owner_tag(), dir=root))
    # made under another prefix, locked, then renamed: a reaper never sees the staging directory without its lock
    young = Path(tempfile.mkdtemp(prefix=_INIT_PREFIX + owner_tag(), dir=root))
    fd = os.open(young / OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    d = root / f"{prefix}{owner_tag()}{secrets.token_hex(6)}"
    os.rename(young, d)
    _owned[d] = fd
    return d


def remove_stage_dir(d: Path) -> None:
    """Remove a staging directory made by :func:`make_stage_dir` and let go of its owner flock."""
    shutil.rmtree(d, ignore_errors=True)
    fd = _owned.pop(d, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def makedirs(d: Path, created: list[Path]) -> None:
    """``mkdir -p d``, appending each directory this call created to ``created`` (parents first), for rollback."""
    missing = []
    p = d
    while not p.exists():
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):
            p.mkdir(mode=DIR_MODE)
            created.append(p)


def link_no_clobber(src: Path, dest: Path) -> bool:
    """Make ``dest`` appear atomically with ``src``'s content unless it exists; True if this call created it.

    A hard link fails atomically on an existing name, where check-then-rename would race with torch or another node
    writing the same entry. Filesystems without hard links fall back to check-then-rename.
    """
    try:
        os.link(src, dest)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
    if dest.exists() or dest.is_symlink():
        return False
    os.replace(src, dest)
    return True
