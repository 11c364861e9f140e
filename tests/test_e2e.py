"""The whole path on CPU with real torch.compile: build (session fixture) -> inspect -> install -> verify."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMOKE, repack

from kernelpack import artifact as art
from kernelpack.cli import main
from kernelpack.recipe import load_recipe
from kernelpack.records import VerifyReport
from kernelpack.verify import verify_artifact as verify


def test_build_manifest(smoke_artifact: Path) -> None:
    import torch

    m = art.read_manifest(smoke_artifact).to_dict()
    recipe = load_recipe(SMOKE)
    version = torch.__version__.split("+")[0]
    cuda = f"-cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else ""
    assert smoke_artifact.name == f"smoke-cpu-torch{version}-{torch.version.git_version[:12]}{cuda}-cpu.kpack"
    assert m["recipe"]["sha256"] == recipe.sha256
    assert sorted(c["id"] for c in m["configs"]) == sorted(c.id for c in recipe.configs)
    assert all(c["compile_seconds"] > 0 and c["max_rel_error"] < 2e-3 for c in m["configs"])
    assert m["build_key"]["torch_git"] == torch.version.git_version
    assert any(f["path"].startswith("fxgraph/") for f in m["files"])
    assert any(f["path"].startswith("aotautograd/") for f in m["files"])
    assert not any(f["path"].startswith("locks/") for f in m["files"])
    assert m["total_size"] == sum(f["size"] for f in m["files"]) > smoke_artifact.stat().st_size
    assert m["devices"] == [0] and all(c["devices"] == [0] for c in m["configs"])


def test_inspect_json_and_text(smoke_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(smoke_artifact), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == art.read_manifest(smoke_artifact).to_dict()
    assert main(["inspect", str(smoke_artifact)]) == 0
    out = capsys.readouterr().out
    assert "torch_git" in out and data["configs"][0]["id"] in out


def test_inspect_does_not_import_torch(smoke_artifact: Path) -> None:
    code = (
        "import sys; from kernelpack.cli import main; rc = main(['inspect', sys.argv[1]]);"
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    cmd = [sys.executable, "-c", code, str(smoke_artifact)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from kernelpack.cli import main; main(['--help']);assert 'torch' not in sys.modules",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0 and "build" in proc.stdout, proc.stderr


def seeds_with_both_orders(n: int) -> tuple[int, int]:
    """Two verify seeds whose shuffles of n configs differ, so hits are shown not to depend on the order."""
    orders: dict[tuple[int, ...], int] = {}
    for seed in range(100):
        order = list(range(n))
        random.Random(seed).shuffle(order)
        orders.setdefault(tuple(order), seed)
        if len(orders) == 2:
            return tuple(orders.values())  # type: ignore[return-value]
    raise AssertionError("no two orders")


def test_verify_zero_misses_in_a_fresh_process_in_any_order(
    smoke_artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    n = len(art.read_manifest(smoke_artifact).to_dict()["configs"])
    first, second = seeds_with_both_orders(n)
    report = verify(smoke_artifact, seed=first, check=True)
    t = report.to_dict()["totals"]
    assert t["inductor.fxgraph_cache_miss"] == 0 and t["aot_autograd.autograd_cache_miss"] == 0
    assert t["cpp_compiled"] == 0 and t["dense_calls"] == 0
    assert t["inductor.fxgraph_cache_hit"] == len(report.to_dict()["configs"]) == n
    assert main(["verify", str(smoke_artifact), "--seed", str(second), "--json"]) == 0
    other = json.loads(capsys.readouterr().out)
    assert [c["id"] for c in other["configs"]] != [c["id"] for c in report.to_dict()["configs"]]
    assert other["totals"]["inductor.fxgraph_cache_miss"] == 0 and other["totals"]["cpp_compiled"] == 0
    # the typed report reads back what verify --json printed, field by field
    assert VerifyReport.from_dict(other).to_dict() == other and VerifyReport.from_dict(report.to_dict()) == report


def test_verify_fails_naming_the_config_when_its_entries_are_missing(
    smoke_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An artifact without its FX-graph entries and kernels: verify must see the recompiles and fail loudly, naming
    every config, with the error and its hint on stderr and, where the hint points, the failed report with every
    config's counters on stdout. Through the CLI only: each verify of this artifact compiles every config
    cold, and the CLI's error is the API's VerifyError, printed."""
    broken = repack(
        smoke_artifact,
        tmp_path / "broken.kpack",
        tmp_path / "w",
        drop=lambda rel: rel.startswith("fxgraph/") or rel.endswith(".so"),
    )
    assert main(["verify", "--json", str(broken)]) == 1
    out, err = capsys.readouterr()
    m = art.read_manifest(smoke_artifact).to_dict()
    assert all(c["id"] in err for c in m["configs"]), err
    assert "FX-graph cache misses" in err and "C++ kernels compiled" in err, err
    assert "error: " in err and "kernelpack verify --json" in err, err
    data = json.loads(out)
    assert {c["id"] for c in data["configs"]} == {c["id"] for c in m["configs"]}
    assert all(c["reasons"] and c["counters"]["inductor.fxgraph_cache_miss"] for c in data["configs"])


USER_MASKS = """
def anchored(config):
    # a user mask: causal sliding window plus the first 8 tokens (attention sink)
    w = config.window
    if w == 64:
        raise RuntimeError("mask factory exploded")
    def mask_mod(b, h, q, kv):
        return (q >= kv) & ((q - kv < w) | (kv < 8))
    return mask_mod
"""


@pytest.fixture
def user_masks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "usermasks.py").write_text(USER_MASKS)
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + (os.pathsep + old if old else ""))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def user_recipe(tmp_path: Path, windows: str) -> Path:
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'name = "user"\ndevice = "cpu"\nmask = "usermasks:anchored"\nwindows = {windows}\n'
        "[matrix]\nq_heads = 2\nhead_dim = 16\nseq_len = 128\ndtypes = ['float32']\n"
    )
    return recipe


def test_user_mask_factory_keep_going_builds_the_rest_and_verifies(
    user_masks: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from kernelpack.build import build_recipe

    result = build_recipe(user_recipe(tmp_path, "[32, 64]"), tmp_path / "out", jobs=2, keep_going=True)
    assert result.artifact is not None and len(result.failed) == 1
    # from Python too, a line per config as it starts and ends (a minute or more of silence)
    err = capfd.readouterr().err
    assert "building 2 config(s), 2 at a time" in err and err.count("started ") == 2
    assert "] ok " in err and "] FAIL " in err
    m = art.read_manifest(result.artifact).to_dict()
    assert [c["params"]["window"] for c in m["configs"]] == [32]
    assert [f["params"]["window"] for f in m["failed"]] == [64] and "exploded" in m["failed"][0]["error"]
    report = verify(result.artifact, check=True)
    assert (
        report.to_dict()["totals"]["inductor.fxgraph_cache_miss"] == 0
        and report.to_dict()["totals"]["cpp_compiled"] == 0
    )


def test_build_failure_reports_config_and_writes_nothing(
    user_masks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["build", str(user_recipe(tmp_path, "[64]")), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "1 (config, device) build(s)" in err and "mask factory exploded" in err and "B=1 Hq=2" in err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_package_api_is_stable_and_lazy() -> None:
    code = (
        "import sys, kernelpack; assert 'torch' not in sys.modules;"
        "import kernelpack.installer, kernelpack.verify, kernelpack.build;"
        "assert callable(kernelpack.install), kernelpack.install;"
        "assert 'torch' not in sys.modules;"
        "assert callable(kernelpack.flex_attention) and kernelpack.masks.sliding_window(8)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_unwritable_output_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main(["build", str(SMOKE), "-o", str(blocker / "out"), "--jobs", "2"]) == 1
    err = capsys.readouterr().err
    assert "error: cannot write the artifact" in err and "Traceback" not in err


def test_worker_timeout_is_a_failure_with_a_reason(tmp_path: Path) -> None:
    """A worker that does not finish in time is killed and reported, with the reason, not dropped silently."""
    from kernelpack.build import _run_worker
    from kernelpack.recipe import load_recipe

    outcome = _run_worker(load_recipe(SMOKE).configs[0], tmp_path / "w", 0, timeout=0.01)
    assert not outcome.ok and "timed out" in outcome.message


def test_devices_do_not_apply_to_cpu_recipes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build", str(SMOKE), "-o", str(tmp_path), "--devices", "0,1"]) == 1
    assert "does not apply" in capsys.readouterr().err
    assert main(["build", str(SMOKE), "-o", str(tmp_path), "--devices", "zero"]) == 1  # usage: error:/hint:, exit 1


def test_a_build_without_precompiled_functions_says_so(
    user_masks: Path,
    smoke_artifact: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A build whose tier 2 is missing still works (tier 1 serves), so the CLI warns with the reason and inspect shows
    it per config. (On the H200, torch 2.11's missing aot_compile left every graph without a function, silently.)"""
    monkeypatch.setenv("KERNELPACK_PRECOMPILE", "0")
    out = tmp_path / "out"
    assert main(["build", str(user_recipe(tmp_path, "[32]")), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "warning: 1 of 1 graph(s) have no precompiled function" in err and "KERNELPACK_PRECOMPILE=0" in err, err
    assert main(["inspect", str(next(out.glob("*.kpack")))]) == 0
    text = capsys.readouterr().out
    assert "tier 2 0/1" in text and "not precompiled: built with KERNELPACK_PRECOMPILE=0" in text, text
    assert main(["inspect", str(smoke_artifact)]) == 0
    text = capsys.readouterr().out
    assert "not precompiled" not in text and "tier 2 0/" not in text and "tier 2 1/1" in text, text
