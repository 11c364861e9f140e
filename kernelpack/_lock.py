"""One file-lock helper for every lock kernelpack takes (install, download).

Locks only save work: N workers on a node that start together do a download or an install once, the others wait
and reuse it. Correctness never depends on them (network filesystems can lie about flock): every commit is atomic
on its own. Waiting says so every :data:`LOG_EVERY` seconds, and a holder stuck past ``KERNELPACK_LOCK_TIMEOUT``
raises :class:`LockTimeoutError` (the caller decides whether to go on without the lock), like huggingface_hub's
``WeakFileLock``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from . import settings
from .errors import LockTimeoutError

log = logging.getLogger(__name__)

LOG_EVERY = 10.0


@contextlib.contextmanager
def file_lock(path: Path, *, what: str, timeout: float | None = None) -> Iterator[None]:
    """Hold the exclusive lock ``path`` (created if needed) for the body; ``what`` names it in messages.

    ``timeout`` defaults to ``KERNELPACK_LOCK_TIMEOUT``."""
    from filelock import FileLock, Timeout

    limit = settings.lock_timeout() if timeout is None else timeout
    lock = FileLock(str(path))
    deadline = time.monotonic() + limit
    while True:
        left = deadline - time.monotonic()
        try:
            lock.acquire(timeout=max(0.0, min(LOG_EVERY, left)))
            break
        except Timeout:
            if time.monotonic() >= deadline:
                raise LockTimeoutError(str(path), what, limit) from None
            log.warning("still waiting for the %s lock %s (another process holds it)", what, path)
    try:
        yield
    finally:
        lock.release()


def user_lock_dir() -> Path | None:
    """A directory for lock files outside any target, private to this user: ``$TMPDIR/kernelpack-locks-<uid>``.

    None when it cannot be had or is not ours (another user could pre-create it and hold our locks)."""
    d = Path(tempfile.gettempdir()) / f"kernelpack-locks-{os.getuid()}"
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        st = d.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return None
    return d
