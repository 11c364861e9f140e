"""The one worker-process protocol build and verify share, with a real child process for each outcome."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelpack import _worker

CHILD = """
import os, sys, time
from kernelpack import _worker
from kernelpack.errors import KernelpackError

def work(payload):
    what = payload["do"]
    if what == "ok":
        return {"echo": payload, "cache": os.environ["TORCHINDUCTOR_CACHE_DIR"]}
    if what == "refuse":
        raise KernelpackError("refused: " + payload["why"])
    if what == "crash":
        raise RuntimeError("boom\\nsecond line")
    if what == "die":
        print("about to die", flush=True)
        os._exit(3)
    time.sleep(60)

if __name__ == "__main__":
    sys.exit(_worker.child_main(work, sys.argv[1:]))
"""


@pytest.fixture
def child(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "kp_child.py").write_text(CHILD)
    env = _worker.fresh_cache_env(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    return env


def run(env: dict[str, str], tmp_path: Path, payload: dict, timeout: float = 60) -> _worker.Outcome:
    return _worker.run("kp_child", payload, workdir=tmp_path / "w", env=env, timeout=timeout)


def test_value(child: dict[str, str], tmp_path: Path) -> None:
    out = run(child, tmp_path, {"do": "ok", "n": 1})
    assert out.ok and out.error is None and out.log_tail == "" and out.returncode == 0
    assert out.value == {"echo": {"do": "ok", "n": 1}, "cache": str(tmp_path / "cache")}


def test_a_kernelpack_error_is_its_message(child: dict[str, str], tmp_path: Path) -> None:
    out = run(child, tmp_path, {"do": "refuse", "why": "no GPU"})
    assert not out.ok and out.value is None and out.returncode == 1
    assert out.error == "refused: no GPU; worker exited with status 1"


def test_any_other_exception_is_its_first_line_and_the_traceback_is_in_the_log(
    child: dict[str, str], tmp_path: Path
) -> None:
    out = run(child, tmp_path, {"do": "crash"})
    assert out.error is not None and out.error.startswith("RuntimeError: boom;") and "second line" not in out.error
    assert "Traceback" in out.log_tail and "second line" in out.log_tail


def test_a_process_that_dies_has_no_result_and_says_so(child: dict[str, str], tmp_path: Path) -> None:
    out = run(child, tmp_path, {"do": "die"})
    assert out.value is None and out.error == "worker exited with status 3" and "about to die" in out.log_tail


def test_a_timeout_is_killed_and_reported(child: dict[str, str], tmp_path: Path) -> None:
    out = run(child, tmp_path, {"do": "hang"}, timeout=2)
    assert out.returncode is None and out.error == "timed out after 2 s" and not out.ok


def test_a_stale_result_file_is_never_read_as_this_run(child: dict[str, str], tmp_path: Path) -> None:
    """The result is written whole or not at all, and a dead child's result is absent, not a leftover."""
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "result.json").write_text(json.dumps({"value": {"stale": True}}))
    out = run(child, tmp_path, {"do": "die"})
    assert out.value is None and not list((tmp_path / "w").glob("*.tmp"))


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line holds ``text`` (a test's own temp path: other runs never match)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(
                (line for line in (entry / "status").read_text().splitlines() if line.startswith("State:")), ""
            )
        except OSError:
            continue
        if text in cmdline and "zombie" not in state:
            found.append(int(entry.name))
    return found


def _wait_for(predicate: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.fixture
def sigint_delivered() -> Iterator[None]:
    """The commands as a terminal starts them, ^C delivered: a test run started in the background of a shell
    (`pytest &`) ignores SIGINT, a command started from it inherits that, and keeps an ignored SIGINT ignored, as
    POSIX programs do. A handler (not SIG_IGN) is reset to the default at exec."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.usefixtures("sigint_delivered")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_a_build_stops_everything_it_started_at_once_on_every_signal(tmp_path: Path, sig: signal.Signals) -> None:
    """^C on a --jobs 1 build printed `aborted` after the remaining configs compiled; SIGTERM killed the
    main process and left its worker compiling and its work dir. Now: the workers (and what they started) are gone
    within seconds of any signal, SIGKILL included, and the work dir with them (SIGKILL: nothing can clean up)."""
    from conftest import SMOKE

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernelpack", "build", str(SMOKE), "-o", str(out), "--jobs", "1"],
        env={**os.environ, "TMPDIR": str(tmp)},
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:  # the first worker is compiling
        if line.startswith("started "):
            break
    assert _wait_for(lambda: _processes_mentioning(str(tmp)), 30)
    time.sleep(2)
    start = time.monotonic()
    proc.send_signal(sig)
    rest = proc.stderr.read()
    rc = proc.wait(timeout=60)
    assert time.monotonic() - start < 15, rest
    assert _wait_for(lambda: not _processes_mentioning(str(tmp)), 10), _processes_mentioning(str(tmp))
    assert not out.exists() or not list(out.iterdir())
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL
        return
    assert rc == 128 + sig, (rc, rest)
    assert ("aborted" if sig == signal.SIGINT else "terminated (SIGTERM)") in rest and "Traceback" not in rest
    assert not list(tmp.glob("kernelpack-build-*")), sorted(tmp.iterdir())
    assert rest.count("started ") == 0  # the second config never started


JOB = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
time.sleep(600)
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.usefixtures("sigint_delivered")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_record_stops_the_command_it_runs_on_every_signal(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM to `kernelpack record` left the recorded command running and record's temp dir."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp_path / "job.py").write_text(JOB)
    pids = tmp_path / "pids"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernelpack", "record", "-o", str(tmp_path / "r.toml"), "--",
         sys.executable, str(tmp_path / "job.py"), str(pids)],
        env={**os.environ, "TMPDIR": str(tmp)},
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert _wait_for(lambda: pids.exists() and pids.read_text(), 60)
    job, child = map(int, pids.read_text().split())
    proc.send_signal(sig)
    rc = proc.wait(timeout=30)
    err = proc.stderr.read() if proc.stderr else ""
    assert rc == 128 + sig, (rc, err)
    for pid in (job, child):
        assert _wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists() or "zombie" in
                         Path(f"/proc/{pid}/status").read_text(), 5), pid  # fmt: skip
    assert not list(tmp.glob("kernelpack-record-*")) and not (tmp_path / "r.toml").exists()


def test_workers_import_nothing_from_the_working_directory_before_the_installed_packages(
    smoke_artifact: Path, tmp_path: Path
) -> None:
    """`kernelpack verify`'s worker imported a zstandard.py from the directory it ran in. The workers'
    sys.path ends with the working directory (for the user's mask factories) instead of starting with it."""
    planted = tmp_path / "zstandard.py"
    planted.write_text(f"open({str(tmp_path / 'imported')!r}, 'w').write('yes')\nraise ImportError('planted')\n")
    r = subprocess.run(
        [str(Path(sys.executable).parent / "kernelpack"), "verify", str(smoke_artifact)],  # the script, as run
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (tmp_path / "imported").exists()
