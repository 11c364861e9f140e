"""The one worker-process protocol build and verify share, with a real child process for each outcome."""

from __future__ import annotations

import json
import os
from pathlib import Path

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
