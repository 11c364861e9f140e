"""One protocol for the fresh processes that ``build`` and ``verify`` run their work in.

Torch's compile state (Dynamo's caches, inductor's in-memory caches, counters) is process-wide, so each config is
built, and each artifact verified, in a process of its own with its own cache dir:

    parent: run("kernelpack.build", payload, ...)  ->  python -m kernelpack.build --worker PAYLOAD_JSON RESULT_FILE
    child:  the module's ``__main__`` calls child_main(work, sys.argv[1:]); work(payload) returns a JSON-able dict

The child writes ``{"value": ...}`` or ``{"error": "..."}`` atomically (a parent never reads half a result) and prints
tracebacks to its log, which the parent keeps in the work dir and quotes (the tail) when the work failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _fs, settings
from .errors import KernelpackError

LOG_TAIL_LINES = 25


@dataclass(frozen=True, slots=True)
class Outcome:
    value: dict[str, Any] | None  # what the work returned; None when it raised or the process died
    error: str | None  # why there is no value (the work's exception, a crash, a timeout); None when ok
    returncode: int | None  # None: killed at the timeout
    seconds: float  # the process, start-up included
    log_tail: str  # when it failed: the compiler's first error, else the end of its output; "" when ok
    log_path: Path | None = None  # its whole output

    @property
    def ok(self) -> bool:
        return self.value is not None and self.returncode == 0


def fresh_cache_env(cache_dir: Path, **extra: str) -> dict[str, str]:
    """This process's environment with a private inductor cache (Triton's under it, inductor's default layout) and
    the FX-graph and AOTAutograd caches forced on, whatever the caller's environment says."""
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    env.pop("TRITON_CACHE_DIR", None)
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    env["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


EVENTS_ENV = "KERNELPACK_WORKER_EVENTS"


def emit(event: Mapping[str, Any]) -> None:
    """The child's side of progress: one JSON line the parent's ``on_event`` receives while the work runs (nothing
    when the parent asked for none)."""
    path = settings.worker_events()
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")


class Stopped(KernelpackError):
    """The run was stopped (^C, SIGTERM) before or while this worker ran; its processes were killed."""


def run(
    module: str,
    payload: Mapping[str, Any],
    *,
    workdir: Path,
    env: Mapping[str, str],
    timeout: float,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    stop: threading.Event | None = None,
) -> Outcome:
    """Run ``python -m module --worker`` on ``payload`` in ``workdir`` (log and result live there); ``on_event``
    gets each :func:`emit` of the child as it comes (polled, in this thread).

    The worker runs in a session of its own, so that killing it kills what it started too (inductor's compile
    workers, gcc); it is killed at the timeout, when ``stop`` is set (another thread saw ^C or SIGTERM: raises
    :class:`Stopped`), on any exception here, and by the kernel when this process dies, however it dies
    (PR_SET_PDEATHSIG, set by :func:`child_main`)."""
    if stop is not None and stop.is_set():
        raise Stopped("stopped before the worker started")
    workdir.mkdir(parents=True, exist_ok=True)
    result_file, log_file, events = workdir / "result.json", workdir / "worker.log", workdir / "events.jsonl"
    result_file.unlink(missing_ok=True)  # a result left by an earlier run must not pass for this one's
    events.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", module, "--worker", json.dumps(payload), str(result_file)]
    env = {**env, EVENTS_ENV: str(events)} if on_event else dict(env)
    env[PARENT_ENV] = str(os.getpid())
    # No working directory first on sys.path (python -m puts it there): a zstandard.py or torch/ in the directory
    # kernelpack runs in must not shadow the installed one. child_main appends it instead, for the user's
    # mask factories. Python >= 3.11; on 3.10 child_main moves it.
    env["PYTHONSAFEPATH"] = "1"
    start = time.perf_counter()
    seen = 0

    def deliver() -> None:
        nonlocal seen
        if on_event is None or not events.exists():
            return
        data = events.read_bytes()
        end = data.rfind(b"\n") + 1  # whole lines only: the child may be mid-write
        for line in data[seen:end].splitlines():
            on_event(json.loads(line))
        seen = max(seen, end)

    poll = on_event is not None or stop is not None
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        rc: int | None = None
        try:
            while True:
                try:
                    rc = proc.wait(timeout=0.25 if poll else max(0.0, timeout - (time.perf_counter() - start)))
                    break
                except subprocess.TimeoutExpired:
                    deliver()
                    if stop is not None and stop.is_set():
                        raise Stopped("stopped while the worker ran") from None
                    if time.perf_counter() - start >= timeout:
                        rc = None
                        break
            deliver()
        finally:  # a timeout, or whatever stopped this thread (a callback's error, ^C): never leave the worker running
            _kill_session(proc)
    seconds = time.perf_counter() - start
    try:
        data = json.loads(result_file.read_text())
    except (OSError, ValueError):
        data = {}  # no result: the process crashed, was killed, or timed out
    value = data.get("value") if isinstance(data, dict) else None
    error = data.get("error") if isinstance(data, dict) else None
    if rc != 0:
        why = f"timed out after {timeout:.0f} s" if rc is None else f"worker exited with status {rc}"
        if rc is not None and rc < 0:
            why += f" (signal {-rc}; out of memory?)"
        error = f"{error}; {why}" if error else why
    ok = value is not None and rc == 0
    tail = "" if ok else _tail(log_file)
    return Outcome(value=value, error=error, returncode=rc, seconds=seconds, log_tail=tail, log_path=log_file)


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    """Kill the worker and every process of its session (what it started and left running, too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


PARENT_ENV = "KERNELPACK_WORKER_PARENT"


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this worker when the process that started it dies (Linux): a SIGKILLed
    ``kernelpack build`` must not leave its workers compiling for minutes. The parent may have died before this
    ran: then exit at once."""
    parent = settings.worker_parent()
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if str(os.getppid()) != parent:
        os._exit(1)


def _working_dir_last() -> None:
    """The working directory at the end of sys.path, not the start: the user's mask factories (``mypkg.masks``
    beside the recipe) import, installed packages are never shadowed by a file of the same name there."""
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", cwd)] + [cwd]


def _tail(log_file: Path) -> str:
    """What to quote of a failed worker's log: the compiler's first error and the lines after it (gcc prints dozens
    of warnings, and the last lines of the log are warnings), else the log's last lines."""
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    at = next((i for i, line in enumerate(lines) if _COMPILER_ERROR.search(line)), None)
    if at is not None:
        return "\n".join(lines[at : at + 4])
    return "\n".join(lines[-LOG_TAIL_LINES:])


# gcc/clang/nvcc's error lines (``file.cpp:1091:45: error: ...``), not their warnings
_COMPILER_ERROR = re.compile(r":\d+(:\d+)?: (fatal )?error:|\berror: ")


def first_compiler_error(text: str) -> str | None:
    """The first compiler error line in ``text`` (an inductor CppCompileError carries gcc's whole output), without
    the file's directory, or None."""
    for line in text.splitlines():
        if _COMPILER_ERROR.search(line):
            return re.sub(r"^\S*/", "", line.strip())[:500]
    return None


def child_main(work: Callable[[dict[str, Any]], dict[str, Any]], argv: Sequence[str]) -> int:
    """The child's side: ``work(payload)``, its value or error written to the result file. Exit status 0 iff a
    value was written."""
    if len(argv) != 3 or argv[0] != "--worker":
        print("usage: python -m MODULE --worker PAYLOAD_JSON RESULT_FILE (started by kernelpack)", file=sys.stderr)
        return 2
    _die_with_parent()
    _working_dir_last()
    payload, result_file = argv[1], Path(argv[2])
    try:
        result: dict[str, Any] = {"value": work(json.loads(payload))}
    except KernelpackError as e:
        result = {"error": str(e)}
    except Exception as e:  # the worker must report whatever torch raised (compile error, OOM, ...)
        traceback.print_exc()
        first = str(e).splitlines()[0] if str(e) else ""
        compiler = first_compiler_error(str(e))
        result = {"error": f"{type(e).__name__}: {first}" + (f": {compiler}" if compiler else "")}
    _fs.write_bytes(result_file, json.dumps(result).encode())
    return 0 if "value" in result else 1
