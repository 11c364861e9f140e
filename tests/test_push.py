"""`kernelpack push` to a local path: a mistyped path must not silently become a new registry. The
committed fixture tests/data/tiny-cpu.kpack is pushed (push needs no torch, nothing compiles)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelpack.cli import main
from kernelpack.store import Registry

FIXTURE = Path(__file__).resolve().parent / "data" / "tiny-cpu.kpack"


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_push_refuses_a_missing_parent_directory(
    tmp_path: Path, scheme: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing-parent"
    assert main(["push", str(FIXTURE), f"{scheme}{missing / 'reg'}"]) == 1
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("error: ") and f"{missing} does not exist" in err and "Traceback" not in err
    assert f"hint: create {missing} first" in err and "typo" in err
    assert captured.out == ""
    assert not missing.exists() and list(tmp_path.iterdir()) == []  # nothing created


def test_push_says_when_it_creates_a_registry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reg = tmp_path / "reg"
    assert main(["push", str(FIXTURE), str(reg)]) == 0
    out = capsys.readouterr().out
    assert f"created new registry {reg}\n" in out and "pushed: " in out
    assert main(["push", str(FIXTURE), str(reg)]) == 0  # the same artifact again: unchanged, no new registry
    out = capsys.readouterr().out
    assert "created new registry" not in out and out.startswith("unchanged: ")
    # the library says it too; an empty directory made beforehand is a new registry as well
    (tmp_path / "empty").mkdir()
    result = Registry(str(tmp_path / "empty")).push(FIXTURE)
    assert result.created_registry and result.status == "pushed"
    assert not Registry(str(tmp_path / "empty")).push(FIXTURE, force=True).created_registry
