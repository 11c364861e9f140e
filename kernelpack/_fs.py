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


class NotARegularFile(FileExistsError):
    """``final`` is something a rename must not replace: a device, a directory, a FIFO, a socket, a symlink."""


_KINDS = {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symlink"}  # fmt: skip


def check_replaceable(final: Path) -> None:
    """Raise :class:`NotARegularFile` unless ``final`` is absent or a regular file. A rename replaces whatever
    the name holds: ``kernelpack lock -o /dev/null`` as root in a CI container would replace the system's
    /dev/null, and over a symlink it would replace the link, not the file it names."""
    try:
        mode = os.lstat(final).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise NotARegularFile(
            errno.EEXIST,
            f"is {kind}: kernelpack writes files by renaming over them, so only a regular file or a "
            "new name can take its output",
            str(final),
        )


class NotAFileToRead(OSError):
    """A path kernelpack was told to read is a device, a FIFO, a socket or a directory."""


def open_regular(path: str | os.PathLike[str]) -> IO[bytes]:
    """``open(path, "rb")`` for a regular file only: a FIFO would block the open forever, and a device such as
    /dev/zero or /dev/urandom would be read without end (a lock file or recipe named by mistake or malice). The
    open itself does not block (O_NONBLOCK, cleared once the file is known to be regular)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
            raise NotAFileToRead(errno.EINVAL, f"is {kind}, not a file", os.fsdecode(path))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """A regular file's bytes (:func:`open_regular`); ValueError past ``limit`` bytes, read no further."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"over {limit} bytes: not a file kernelpack writes")
    return data


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """The body writes the yielded temp path (by any means: a download, a copy); when it returns, the file becomes
    ``final``; when it raises, the temp file is removed and ``final`` is untouched. ``final`` must be absent or a
    regular file (:func:`check_replaceable`), before the body runs and again just before the rename."""
    check_replaceable(final)
    tmp = temp_path(final)
    try:
        yield tmp
        check_replaceable(final)
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


def private_dir_problem(directory: Path) -> str | None:
    """Why another local user could change what ``directory`` holds, or None when only this user (and root) can.

    For directories whose files workers execute (the download cache, inductor's cache dir): one owned by another
    user, writable by group or others, reached through a symlink someone else owns, or lying in a directory others
    can write without the sticky bit (whoever can rename a parent can swap the whole tree). torch's default cache dir
    ``/tmp/torchinductor_<user>`` can be made by any local user before the job starts. A directory that does not
    exist yet is judged by the parents it will be made in. POSIX only (None elsewhere)."""
    if not hasattr(os, "getuid"):  # pragma: no cover - Windows
        return None
    me = os.getuid()
    trusted = (me, 0)
    p = directory.absolute()
    for part in (p, *p.parents):  # a symlink on the way that another user owns can be re-pointed at any time
        with contextlib.suppress(OSError):
            st = os.lstat(part)
            if stat.S_ISLNK(st.st_mode) and st.st_uid not in trusted:
                return f"is reached through the symlink {part}, owned by uid {st.st_uid}"
    real = p.resolve()
    existing = real
    while not existing.exists():
        existing = existing.parent
    if existing == real:
        st = real.stat()
        if st.st_uid != me:
            return f"is owned by uid {st.st_uid}, not by this user (uid {me})"
        if st.st_mode & 0o002 or (st.st_mode & 0o020 and not _private_group(st.st_gid)):
            return f"is writable by other users (mode {oct(st.st_mode & 0o777)})"
    for parent in (existing, *existing.parents) if existing != real else existing.parents:
        pst = parent.stat()
        others = pst.st_mode & 0o002 or (pst.st_mode & 0o020 and not (pst.st_uid == me and _private_group(pst.st_gid)))
        if others and not pst.st_mode & stat.S_ISVTX:
            return f"lies in {parent}, which other users can write (mode {oct(pst.st_mode & 0o777)}, no sticky bit)"
    return None


def _private_group(gid: int) -> bool:
    """Whether group ``gid`` is this user's private group (the user-private-group scheme of most distributions and
    clusters, where umask 002 makes directories 0775): this user's primary group, named like the user, with no
    other members. Group write on such a directory lets no one else in."""
    try:
        import grp
        import pwd

        user = pwd.getpwuid(os.getuid())
        group = grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return gid == user.pw_gid and group.gr_name == user.pw_name and not [m for m in group.gr_mem if m != user.pw_name]


def writable_dir_problem(directory: Path) -> str | None:
    """Why this process cannot create files in ``directory`` (or create it), or None. A directory that does not
    exist yet is judged by its nearest existing parent, which must be a directory."""
    existing = directory.absolute()
    while not existing.exists() and not existing.is_symlink():
        existing = existing.parent
    if not existing.is_dir():
        return f"lies under {existing}, which is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):  # EROFS for root too
        what = "is" if existing == directory.absolute() else f"would be made in {existing}, which is"
        return f"{what} not writable by this process"
    return None


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
