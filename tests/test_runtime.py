"""The runtime guard on CPU with real torch: each scenario in a fresh process (tests/runtime_scenarios.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernelpack import runtime
from kernelpack.artifact import BuiltConfig, Manifest
from kernelpack.errors import KernelpackError
from kernelpack.keys import BuildKey
from kernelpack.recipe import Config, load_recipe
from kernelpack.signature import CallSignature

SCENARIOS = Path(__file__).with_name("runtime_scenarios.py")
REPO = Path(__file__).parent.parent


def scenario(name: str, artifact: Path, tmp_path: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCENARIOS), name, str(artifact), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "crash" not in out, out.get("traceback")
    return out


def test_four_threads_first_calls_at_once_compile_nothing_20_times(smoke_artifact: Path, tmp_path: Path) -> None:
    out = scenario("threads", smoke_artifact, tmp_path)
    assert len(out["rounds"]) == 20
    for r in out["rounds"]:
        assert r["errors"] == [] and r["alive"] == 0
        # each (config, device) had exactly one first call, served from the cache, whichever thread made it
        assert r["first_calls"] == out["configs"] and r["compiled"] == 0 and r["fx_hits"] == out["configs"]


def test_strict_mode_refuses_an_uncovered_call_naming_it_and_the_nearest(smoke_artifact: Path, tmp_path: Path) -> None:
    out = scenario("strict_uncovered", smoke_artifact, tmp_path)
    assert out["error"] is not None
    assert "seq=512" in out["error"] and "float32" in out["error"] and "cpu" in out["error"]
    assert "sliding_window(64)" in out["error"] and "nearest covered configs" in out["error"]
    assert "q_len 256 vs 512" in out["error"] and "rebuild" in out["hint"]
    assert out["compiled"] == 0


def test_non_strict_compiles_under_the_lock_and_warns_once(smoke_artifact: Path, tmp_path: Path) -> None:
    out = scenario("non_strict", smoke_artifact, tmp_path)
    assert len(out["warnings"]) == 1 and "seq=128" in out["warnings"][0]
    (first,) = out["first_calls"]
    assert first["config"] is None and first["compiled"]  # it really compiled, and the report says so


def test_eager_flex_is_refused_as_dense(smoke_artifact: Path, tmp_path: Path) -> None:
    out = scenario("eager", smoke_artifact, tmp_path)
    assert "dense math path" in out["error"] and out["bytes"] == 1 * 2 * 256 * 256 * 4


def test_recompile_limit_fallback_is_refused_as_dense(smoke_artifact: Path, tmp_path: Path) -> None:
    out = scenario("recompile_limit", smoke_artifact, tmp_path)
    assert out["at_length"] == 128 and "dense math path" in out["error"]


def test_foreign_fx_trace_dense_fallback_is_refused_and_kernelpack_waits(smoke_artifact: Path, tmp_path: Path) -> None:
    """The seeds' failure: error_on_nested_fx_trace=False while another thread FX-traces runs flex uncompiled."""
    out = scenario("foreign_fx_trace", smoke_artifact, tmp_path)
    assert out["flag_set"] is True
    assert out["raw"].startswith("DenseFallbackError")
    assert 0.4 < out["kernelpack_waited"] < 30  # waited for the trace to end, then ran compiled
    assert out["dense_calls_refused"] == 1  # only torch's raw call reached the dense path


def test_steady_state_calls_do_not_serialize(smoke_artifact: Path, tmp_path: Path) -> None:
    out = scenario("overlap", smoke_artifact, tmp_path)
    assert out["first_calls"] == 1 and out["max_inside"] >= 2


def test_recompile_limit_reaches_worker_threads(smoke_artifact: Path, tmp_path: Path) -> None:
    out = scenario("thread_config", smoke_artifact, tmp_path)
    assert out["after"] >= out["floor"] and out["main"] >= out["floor"]


def test_strict_activation_without_artifact_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KERNELPACK_ARTIFACT", raising=False)
    with pytest.raises(KernelpackError, match="needs an artifact"):
        runtime.activate()
    runtime.deactivate()


@pytest.mark.parametrize(
    "rank, visible, expected",
    [("0", None, "0"), ("3", None, "3"), ("2", "4,5,6,7", "6"), ("1", "GPU-aaa,GPU-bbb", "GPU-bbb")],
)
def test_pin_local_gpu(monkeypatch: pytest.MonkeyPatch, rank: str, visible: str | None, expected: str) -> None:
    monkeypatch.setenv("LOCAL_RANK", rank)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert runtime.pin_local_gpu() == expected
    assert os.environ["CUDA_VISIBLE_DEVICES"] == expected


def test_pin_local_gpu_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(KernelpackError, match="LOCAL_RANK is not set"):
        runtime.pin_local_gpu()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(KernelpackError, match="lists 2"):
        runtime.pin_local_gpu(5)


DFLASH = load_recipe(REPO / "recipes" / "dflash-drafter.toml").configs[0]


def _signature(device_index: int, **changes: object) -> CallSignature:
    return dataclasses.replace(DFLASH, **changes).signature(device_index)


def _built_on_device_0(config: Config) -> Manifest:
    key = BuildKey(**{f.name: "x" for f in dataclasses.fields(BuildKey)})
    built = BuiltConfig(config=config, devices=(0,), mask_key=config.mask_label)
    return Manifest(name="a.kpack", recipe={"name": "a"}, build_key=key, configs=(built,), files={})


def test_refusal_names_the_device_fix_only_when_the_device_is_all_that_differs() -> None:
    """An artifact built on cuda:0 and a rank on cuda:3 (the unpinned torchrun case): the error must point at
    pin_local_gpu / --devices; a shape that is missing everywhere must point at the recipe instead."""
    manifest = _built_on_device_0(DFLASH)
    err = runtime.refusal(manifest.covers(_signature(3)), "a.kpack")
    assert "cuda:3" in str(err) and "device_index 0 vs 3" in str(err)
    assert err.hint is not None and "pin_local_gpu" in err.hint and "--devices" in err.hint
    other_shape = runtime.refusal(manifest.covers(_signature(3, q_len=2048, kv_len=2048)), "a.kpack")
    assert "q_len 4096 vs 2048" in str(other_shape)
    assert other_shape.hint is not None and "add this shape to the recipe" in other_shape.hint
