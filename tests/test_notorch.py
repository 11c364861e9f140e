"""The commands that only read artifacts and registries work where torch is not installed (CI publish jobs, a
laptop inspecting what CI built); the others refuse with a clear error. torch is made unimportable in a subprocess,
as CI's no-torch job does for real by not installing it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kernelpack import artifact as art

FIXTURE = Path(__file__).parent / "data" / "tiny-cpu.kpack"
BLOCK = (
    "import sys; sys.modules['torch'] = sys.modules['triton'] = None\n"  # `import torch` now raises ImportError
    "from kernelpack.cli import main\n"
    "status = main(sys.argv[1:])\n"
    "assert not [m for m in sys.modules if m.startswith(('torch', 'triton')) and sys.modules[m] is not None]\n"
    "sys.exit(status)\n"
)


def kernelpack_without_torch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK, *args], capture_output=True, text=True, check=False)


def test_help_and_inspect_work_without_torch() -> None:
    r = kernelpack_without_torch("--help")
    assert r.returncode == 0 and "inspect" in r.stdout, r.stderr
    r = kernelpack_without_torch("inspect", str(FIXTURE))
    assert r.returncode == 0, r.stderr
    m = art.read_manifest(FIXTURE).to_dict()
    assert "recipe: tiny-cpu" in r.stdout and m["configs"][0]["id"] in r.stdout
    r = kernelpack_without_torch("inspect", "--json", str(FIXTURE))
    assert r.returncode == 0 and json.loads(r.stdout)["build_key"] == m["build_key"]


def test_commands_that_need_torch_say_so_without_a_traceback(tmp_path: Path) -> None:
    r = kernelpack_without_torch("install", str(FIXTURE), "--cache-dir", str(tmp_path / "c"))
    assert r.returncode == 1
    assert "`kernelpack install` needs torch" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "c").exists()


def test_the_committed_fixture_is_intact(tmp_path: Path) -> None:
    """Every member matches the manifest's sha256 (a fixture damaged in git would otherwise fail confusingly)."""
    m = art.unpack(FIXTURE, tmp_path / "tree")
    written = {p.relative_to(tmp_path / "tree").as_posix() for p in (tmp_path / "tree").rglob("*") if p.is_file()}
    assert written == set(m.files) and m.recipe_name == "tiny-cpu"


def test_registry_commands_and_merge_work_without_torch(tmp_path: Path) -> None:
    """What a publish job without torch runs: merge shards, push, ls, lock (README: these need no torch)."""
    reg, copy = tmp_path / "reg", tmp_path / "copy.kpack"
    copy.write_bytes(FIXTURE.read_bytes())
    r = kernelpack_without_torch("merge", str(FIXTURE), str(copy), "-o", str(tmp_path / "merged"))
    assert r.returncode == 0, r.stderr
    (merged,) = (tmp_path / "merged").glob("*.kpack")
    for args in (
        ("push", str(merged), str(reg)),
        ("ls", str(reg)),
        ("lock", str(reg), "--recipe", "tiny-cpu", "-o", str(tmp_path / "k.lock")),
    ):
        r = kernelpack_without_torch(*args)
        assert r.returncode == 0, (args, r.stderr)
    lock = json.loads((tmp_path / "k.lock").read_text())
    assert [a["sha256"] for a in lock["artifacts"]] == [art.sha256_file(merged)]
