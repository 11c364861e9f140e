"""Environment variables: one validated reader (kernelpack.settings), and every bad value or lock timeout reaches
the user as `error:`/`hint:` with exit 1, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernelpack import settings
from kernelpack.errors import SettingError


@pytest.mark.parametrize(
    "variable, value, read",
    [
        ("KERNELPACK_LOCK_TIMEOUT", "soon", settings.lock_timeout),
        ("KERNELPACK_LOCK_TIMEOUT", "-1", settings.lock_timeout),
        ("KERNELPACK_LOCK_TIMEOUT", "nan", settings.lock_timeout),
        ("KERNELPACK_FX_WAIT_SECONDS", "5m", settings.fx_wait_seconds),
        # a wait of inf seconds made every guarded call raise OverflowError from threading
        ("KERNELPACK_WARMUP_WAIT_SECONDS", "inf", settings.warmup_wait_seconds),
        ("KERNELPACK_BACKWARD_WAIT_SECONDS", "1e400", settings.backward_wait_seconds),
        ("KERNELPACK_INSTALL_LOCK", "no", settings.install_lock),
        ("KERNELPACK_MAX_EXPANDED_BYTES", "64G", settings.max_expanded_bytes),
        ("LOCAL_RANK", "first", settings.local_rank),
        ("SOURCE_DATE_EPOCH", "yesterday", settings.source_date_epoch),
        ("KERNELPACK_INSTALL", "some", settings.install_used_parts),
        ("KERNELPACK_START_SWITCH_INTERVAL", "5ms", settings.start_switch_interval),
        # Python takes an interval of an hour; a start that switches threads once a minute starves its own
        ("KERNELPACK_START_SWITCH_INTERVAL", "60", settings.start_switch_interval),
    ],
)
def test_a_bad_value_names_the_variable_the_value_and_what_is_expected(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, read: object
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingError) as exc:
        read()  # type: ignore[operator]
    assert str(exc.value).startswith(f"{variable}={value!r} is not ") and exc.value.hint


def test_activate_refuses_a_bad_start_setting_before_it_starts(
    smoke_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A background start reads KERNELPACK_INSTALL in its install thread: a bad value is refused by activate()
    itself, naming it, with nothing installed."""
    from kernelpack import runtime

    monkeypatch.setenv("KERNELPACK_INSTALL", "some")
    with pytest.raises(SettingError, match="KERNELPACK_INSTALL='some'"):
        runtime.activate(smoke_artifact, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.py"))


def test_values_are_read_at_call_time_and_empty_means_unset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KERNELPACK_LOCK_TIMEOUT", "2.5")
    assert settings.lock_timeout() == 2.5
    monkeypatch.setenv("KERNELPACK_LOCK_TIMEOUT", "")
    assert settings.lock_timeout() == 600.0
    monkeypatch.delenv("KERNELPACK_DOWNLOAD_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert settings.download_dir() == tmp_path / "kernelpack" / "downloads"
    monkeypatch.setenv("KERNELPACK_DOWNLOAD_DIR", str(tmp_path / "d"))
    assert settings.download_dir() == tmp_path / "d"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", " 4, 5,,")
    assert settings.cuda_visible_devices() == ["4", "5"]


def test_local_rank_errors_are_the_same_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """rank_cache_dir and pin_local_gpu both read LOCAL_RANK through settings (one gave a raw ValueError at ecc4142)."""
    import kernelpack
    from kernelpack import runtime

    monkeypatch.setenv("LOCAL_RANK", "x")
    for call in (kernelpack.rank_cache_dir, runtime.pin_local_gpu):
        with pytest.raises(SettingError, match="LOCAL_RANK='x' is not a rank"):
            call()


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kernelpack.cli", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_bad_variable_in_the_cli_is_an_error_and_a_hint(smoke_artifact: Path, tmp_path: Path) -> None:
    r = cli("install", str(smoke_artifact), "--cache-dir", str(tmp_path / "c"), env={"KERNELPACK_LOCK_TIMEOUT": "soon"})
    assert r.returncode == 1, r.stderr
    assert "error: KERNELPACK_LOCK_TIMEOUT='soon' is not a number of seconds" in r.stderr
    assert "hint: " in r.stderr and "Traceback" not in r.stderr


HOLD = """
import sys, time
from filelock import FileLock
lock = FileLock(sys.argv[1])
lock.acquire()
print("HELD", flush=True)
time.sleep(120)
"""


def hold(lock_file: Path) -> subprocess.Popen[str]:
    """Another process holding a kernelpack lock (a stuck job on the node)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(lock_file)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "HELD"
    return p


def test_a_download_lock_held_past_the_timeout_is_an_error(smoke_artifact: Path, tmp_path: Path) -> None:
    from kernelpack import artifact as art
    from kernelpack.store import Registry

    Registry(str(tmp_path / "reg")).push(smoke_artifact)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    holder = hold(downloads / f"{art.sha256_file(smoke_artifact)}.lock")
    try:
        env = {"KERNELPACK_DOWNLOAD_DIR": str(downloads), "KERNELPACK_LOCK_TIMEOUT": "1"}
        r = cli("pull", str(tmp_path / "reg"), "--recipe", "smoke-cpu", env=env)
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 1, r.stderr
    assert "error: waited 1 s for the download lock" in r.stderr and "KERNELPACK_LOCK_TIMEOUT" in r.stderr
    assert "Traceback" not in r.stderr and not list(downloads.glob("*.kpack"))


def test_an_install_lock_held_past_the_timeout_only_costs_the_lock(smoke_artifact: Path, tmp_path: Path) -> None:
    """The install lock only saves work (commits are no-clobber links): past the timeout the install goes on."""
    import hashlib

    from kernelpack import _lock

    target = tmp_path / "cache"
    lock_dir = _lock.user_lock_dir()
    assert lock_dir is not None
    # the whole install's lock: the cache dir and the artifact's sha256 (each part has one of its own too)
    what = hashlib.sha256(smoke_artifact.read_bytes()).hexdigest()
    name = hashlib.sha256(f"{target.resolve()}\0{what}".encode()).hexdigest()[:24]
    holder = hold(lock_dir / f"{name}.lock")
    try:
        r = cli("install", str(smoke_artifact), "--cache-dir", str(target), env={"KERNELPACK_LOCK_TIMEOUT": "1"})
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 0, r.stderr
    assert "installing without it" in r.stderr and "installed " in r.stdout
