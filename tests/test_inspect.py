"""`kernelpack inspect` on damaged artifacts: plain inspect says it read the manifest only, and
``inspect --verify`` reads every member against the manifest, without torch. The committed fixture
tests/data/tiny-cpu.kpack stands in for a build, so nothing compiles here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernelpack.artifact import read_manifest
from kernelpack.cli import main

FIXTURE = Path(__file__).resolve().parent / "data" / "tiny-cpu.kpack"


def _damaged(tmp_path: Path, how: str) -> Path:
    data = bytearray(FIXTURE.read_bytes())
    if how == "half":
        data = data[: len(data) // 2]
    else:  # one bit flipped in the middle
        data[len(data) // 2] ^= 0x01
    out = tmp_path / f"{how}-{FIXTURE.name}"
    out.write_bytes(bytes(data))
    return out


def test_verify_intact_fixture_counts_members(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--verify", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    files = len(read_manifest(FIXTURE).files)
    assert f"verified {files} members (" in out and "against the manifest" in out
    assert "read the manifest only" not in out


@pytest.mark.parametrize("how", ["half", "flip"])
def test_verify_refuses_a_damaged_artifact(tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _damaged(tmp_path, how)
    assert main(["inspect", str(bad)]) == 0  # the manifest, at the front, is intact: plain inspect cannot tell...
    out = capsys.readouterr().out
    assert "read the manifest only; `kernelpack inspect --verify` checks every member's hash" in out  # ...and says so
    assert main(["inspect", "--verify", str(bad)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # no manifest printed for a damaged file
    err = captured.err
    assert err.startswith(f"error: {bad}: ") and "(member 'cache/" in err and "\nhint: " in err
    assert "truncated" in err if how == "half" else "corrupt" in err
    assert "hint: the artifact is damaged" in err and "target cache" not in err  # nothing was installed anywhere
    assert "Traceback" not in err


def test_verify_with_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json with --verify: the manifest only once every member checked out."""
    good = tmp_path / FIXTURE.name
    shutil.copy(FIXTURE, good)
    assert main(["inspect", "--verify", "--json", str(good)]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == read_manifest(FIXTURE).name
    bad = _damaged(tmp_path, "half")
    assert main(["inspect", "--verify", "--json", str(bad)]) == 1
    assert capsys.readouterr().out == ""


def test_inspect_verify_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from kernelpack.cli import main; rc = main(['inspect', '--verify', sys.argv[1]]);"
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    for path, rc in ((FIXTURE, 0), (_damaged(tmp_path, "flip"), 1)):
        proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=False)
        assert proc.returncode == rc, proc.stderr
        assert "torch imported" not in proc.stderr and "Traceback" not in proc.stderr


def test_cpu_artifact_shows_devices_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert read_manifest(FIXTURE).build_key.device_type == "cpu"
    assert main(["inspect", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    assert "devices: cpu" in out and "[0]" not in out
    assert main(["inspect", "--json", str(FIXTURE)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["devices"] == [0] and all(c["devices"] == [0] for c in data["configs"])  # the JSON is unchanged


def test_check_members_finds_damage_past_the_last_member(tmp_path: Path) -> None:
    """A flipped bit in zstd's frame checksum, the file's last bytes: every member's sha256 is right, and the error
    still comes."""
    from kernelpack.artifact import check_members
    from kernelpack.errors import ArtifactError

    assert check_members(FIXTURE).members == len(read_manifest(FIXTURE).files)
    data = bytearray(FIXTURE.read_bytes())
    data[-1] ^= 0x01
    bad = tmp_path / "checksum.kpack"
    bad.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum"):
        check_members(bad)


@pytest.mark.parametrize("cut", [1, 2, 3, 5])
def test_check_members_finds_a_file_cut_inside_the_frame_checksum(tmp_path: Path, cut: int) -> None:
    """A cut of 1 to 3 bytes falls inside zstd's 4-byte frame checksum: the decoder has every block, every member's
    sha256 is right, and only the frame walk tells (a cut of 5 reaches the last block: the decoder tells then)."""
    from kernelpack.artifact import check_members
    from kernelpack.errors import ArtifactError

    bad = tmp_path / "cut.kpack"
    bad.write_bytes(FIXTURE.read_bytes()[:-cut])
    with pytest.raises(ArtifactError, match="truncated"):
        check_members(bad)


def test_check_members_refuses_bytes_after_the_frame(tmp_path: Path) -> None:
    from kernelpack.artifact import check_members
    from kernelpack.errors import ArtifactError

    bad = tmp_path / "tail.kpack"
    bad.write_bytes(FIXTURE.read_bytes() + b"\0" * 7)
    with pytest.raises(ArtifactError, match="7 bytes after the end"):
        check_members(bad)
