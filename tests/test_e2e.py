"""The whole path on CPU with real torch.compile: build (session fixture) -> inspect -> install -> verify."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SMOKE, repack
from kernelpack import artifact as art
from kernelpack.cli import main
from kernelpack.errors import VerifyError
from kernelpack.recipe import load_recipe
from kernelpack.verify import verify


def test_build_manifest(smoke_artifact: Path) -> None:
    import torch

    m = art.read_manifest(smoke_artifact).data
    recipe = load_recipe(SMOKE)
    assert smoke_artifact.name == f"smoke-cpu-torch{torch.__version__.split('+')[0]}-{torch.version.git_version[:12]}-cpu.kpack"
    assert m["recipe"]["sha256"] == recipe.sha256
    assert sorted(c["id"] for c in m["configs"]) == sorted(c.id for c in recipe.configs)
    assert all(c["compile_seconds"] > 0 and c["max_rel_error"] < 2e-3 for c in m["configs"])
    assert m["build_key"]["torch_git"] == torch.version.git_version
    assert any(f["path"].startswith("fxgraph/") for f in m["files"])
    assert any(f["path"].startswith("aotautograd/") for f in m["files"])
    assert not any(f["path"].startswith("locks/") for f in m["files"])
    assert m["total_size"] == sum(f["size"] for f in m["files"]) > smoke_artifact.stat().st_size


def test_inspect_json_and_text(smoke_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(smoke_artifact), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == art.read_manifest(smoke_artifact).data
    assert main(["inspect", str(smoke_artifact)]) == 0
    out = capsys.readouterr().out
    assert "torch_git" in out and data["configs"][0]["id"] in out


def test_inspect_does_not_import_torch(smoke_artifact: Path) -> None:
    code = ("import sys; from kernelpack.cli import main; rc = main(['inspect', sys.argv[1]]);"
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(smoke_artifact)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-c", "import sys; from kernelpack.cli import main; main(['--help']);"
                           "assert 'torch' not in sys.modules"], capture_output=True, text=True)
    assert proc.returncode == 0 and "build" in proc.stdout, proc.stderr


def test_verify_zero_misses_in_a_fresh_process(smoke_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = verify(smoke_artifact, seed=1, check=True)
    t = report.data["totals"]
    assert t["inductor.fxgraph_cache_miss"] == 0 and t["aot_autograd.autograd_cache_miss"] == 0
    assert t["cpp_compiled"] == 0 and t["dense_calls"] == 0
    assert t["inductor.fxgraph_cache_hit"] == len(report.data["configs"]) == 2
    assert main(["verify", str(smoke_artifact), "--seed", "2"]) == 0
    assert "misses 0" in capsys.readouterr().out


def test_verify_fails_naming_the_config_when_its_entries_are_missing(smoke_artifact: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """An artifact without its FX-graph entries and kernels: verify must see the recompiles and fail loudly."""
    broken = repack(smoke_artifact, tmp_path / "broken.kpack", tmp_path / "w",
                    drop=lambda rel: rel.startswith("fxgraph/") or rel.endswith(".so"))
    with pytest.raises(VerifyError) as exc:
        verify(broken, seed=0)
    msg = str(exc.value)
    m = art.read_manifest(smoke_artifact).data
    assert all(c["id"] in msg for c in m["configs"])
    assert "FX-graph cache misses" in msg and "C++ kernels compiled" in msg
    assert main(["verify", str(broken)]) == 1
    assert "error: " in capsys.readouterr().err


def test_build_failure_reports_config_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pkg = tmp_path / "usermasks"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def broken(config):\n    raise RuntimeError('mask factory exploded')\n")
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "bad"\ndevice = "cpu"\nmask = "usermasks:broken"\n'
                      "[matrix]\nq_heads = 2\nhead_dim = 16\nseq_len = 128\ndtypes = ['float32']\n")
    import os

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tmp_path) + (os.pathsep + old if old else "")
    try:
        assert main(["build", str(recipe), "-o", str(tmp_path / "out")]) == 1
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    err = capsys.readouterr().err
    assert "1 of 1 config(s)" in err and "mask factory exploded" in err and "B=1 Hq=2" in err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
