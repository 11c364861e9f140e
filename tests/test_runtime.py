"""The runtime guard on CPU with real torch: each scenario in a fresh process (tests/runtime_scenarios.py)."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path

import pytest
from conftest import run_json, torch_release

from kernelpack import runtime
from kernelpack.artifact import read_manifest
from kernelpack.config import Config
from kernelpack.errors import KernelpackError
from kernelpack.keys import BuildKey
from kernelpack.manifest import BuiltConfig, Manifest
from kernelpack.recipe import load_recipe
from kernelpack.runtime.refusals import not_warmed
from kernelpack.signature import CallSignature, Graph

SCENARIOS = Path(__file__).with_name("runtime_scenarios.py")
REPO = Path(__file__).parent.parent


def scenario(name: str, artifact: Path, tmp_path: Path, **env: str) -> dict:
    out = run_json([sys.executable, str(SCENARIOS), name, str(artifact), str(tmp_path / "cache")], env=env)
    assert "crash" not in out, out.get("traceback")
    return out


@pytest.mark.parametrize("tier", ["precompiled", "inductor-cache"])
def test_four_threads_after_the_warm_up_compile_nothing_20_times(
    smoke_artifact: Path, tmp_path: Path, tier: str
) -> None:
    """Both tiers: the precompiled functions (one loaded function called by 4 threads at once), and the inductor
    cache (KERNELPACK_PRECOMPILED=0)."""
    out = scenario("threads", smoke_artifact, tmp_path, KERNELPACK_PRECOMPILED="1" if tier == "precompiled" else "0")
    assert len(out["rounds"]) == 20
    for r in out["rounds"]:
        assert r["errors"] == [] and r["alive"] == 0
        # activate() made every first call from the cache, or loaded and called one precompiled function, the
        # others loading at their first call (KERNELPACK_LOAD=lazy); the threads' calls (grad mode on, inputs that
        # need no grad) are made under no_grad like the warm-up's, so they are served by what it warmed or loaded
        warmed = 1 if tier == "precompiled" else out["configs"]
        assert r["first_calls"] == out["configs"] and r["warmup_calls"] == warmed and r["compiled"] == 0
        assert r["tiers"] == [tier] * out["configs"] and r["served"] == {tier: 4 * out["configs"]}, r
        assert r["fx_hits"] == (out["configs"] if tier == "inductor-cache" else 0)


@pytest.mark.skipif(
    torch_release() < (2, 13),
    reason="torch 2.11 (CPU) segfaults in FakeTensorMode.__enter__ inside the one Dynamo trace of a worker thread "
    "after torch._dynamo.reset(), the other threads waiting at the gate; the same at df77287 (docs/torch-compat.md)",
)
def test_four_threads_first_calls_at_once_without_warm_up_20_times(smoke_artifact: Path, tmp_path: Path) -> None:
    out = scenario("threads_no_warmup", smoke_artifact, tmp_path)
    assert len(out["rounds"]) == 20
    for r in out["rounds"]:
        assert r["errors"] == [] and r["alive"] == 0 and r["warmup_calls"] == 0
        # each (config, device) had exactly one first call, served from the cache, whichever thread made it
        assert r["first_calls"] == out["configs"] and r["compiled"] == 0 and r["fx_hits"] == out["configs"]
        assert r["tier1_why"] == ["activate(warmup=False) loads no precompiled function"], r


def test_strict_mode_refuses_an_uncovered_call_naming_it_and_the_nearest(smoke_artifact: Path, tmp_path: Path) -> None:
    out = scenario("strict_uncovered", smoke_artifact, tmp_path)
    assert out["error"] is not None
    assert "seq=512" in out["error"] and "float32" in out["error"] and "cpu" in out["error"]
    assert "sliding_window(64)" in out["error"] and "nearest covered configs" in out["error"]
    assert "q_len 256 vs 512" in out["error"] and "rebuild" in out["hint"]
    assert out["compiled"] == 0
    # a mask in another op order: refused, and the error says it is other code than the artifact's (no graph dumps)
    assert "the call's mask_mod is " in out["reordered"] and "other code is another graph" in out["reordered"]
    assert "computes:" not in out["reordered"]


def test_non_strict_without_warm_up_compiles_under_the_lock_and_warns_once(
    smoke_artifact: Path, tmp_path: Path
) -> None:
    out = scenario("non_strict_no_warmup", smoke_artifact, tmp_path)
    assert len(out["warnings"]) == 1 and "seq=128" in out["warnings"][0]
    (first,) = out["first_calls"]
    assert first["config"] is None and first["compiled"]  # it really compiled, and the report says so


def test_eager_flex_is_refused_as_dense(smoke_artifact: Path, tmp_path: Path) -> None:
    out = scenario("eager", smoke_artifact, tmp_path)
    assert "dense math path" in out["error"] and out["bytes"] == 1 * 2 * 256 * 256 * 4


def test_recompile_limit_fallback_is_refused_as_dense(smoke_artifact: Path, tmp_path: Path) -> None:
    out = scenario("recompile_limit", smoke_artifact, tmp_path)
    assert out["at_length"] == 64 and "dense math path" in out["error"]


def test_foreign_fx_trace_dense_fallback_is_refused_and_kernelpack_waits(smoke_artifact: Path, tmp_path: Path) -> None:
    """The seeds' failure: error_on_nested_fx_trace=False while another thread FX-traces runs flex uncompiled (torch
    <= 2.13, whose tracing flag is process-global). On torch >= 2.14 the flag is the tracing thread's own and torch's
    call compiles instead; the module patcher is still process-wide, and kernelpack waits for it on every version."""
    out = scenario("foreign_fx_trace", smoke_artifact, tmp_path)
    assert out["patcher_set"] is True
    if out["flag_set"]:  # torch <= 2.13
        assert out["raw"].startswith("DenseFallbackError")
        assert out["dense_calls_refused"] == 1  # only torch's raw call reached the dense path
    else:  # torch >= 2.14
        assert out["raw"] == "ran" and out["dense_calls_refused"] == 0
    assert 0.4 < out["kernelpack_waited"] < 30  # waited for the trace to end, then ran compiled


def test_after_the_warm_up_calls_that_would_trace_are_refused_and_explained(
    smoke_artifact: Path, tmp_path: Path
) -> None:
    """Non-strict mode too: nothing compiles during training. Each refusal says why in Dynamo's words."""
    out = scenario("not_warmed", smoke_artifact, tmp_path)
    assert out["same_call"] == "served"  # another thread, a BlockMask rebuilt from the recipe's mask function
    assert out["own_mask"] == "served"  # the user's own function, the same graph: masks by graph
    other_order = out["reordered"]  # the same meaning in another op order: another graph, both shown
    assert other_order["type"] == "NotWarmedError" and "does not cover it" in other_order["error"]
    assert "other code is another graph" in other_order["error"] and "computes:" not in other_order["error"]
    other = out["other_code"]  # covered by name, but Dynamo guards on the mask function's code object
    assert other["type"] == "NotWarmedError" and "warmed it" in other["error"] and "mask_mod" in other["error"]
    assert "recipe's mask function" in other["hint"]
    bshd = out["transposed"]
    # the signature sees the layout: not covered, and the nearest covered signature says it is the layout
    assert bshd["type"] == "NotWarmedError" and "does not cover it" in bshd["error"]
    assert "layout 'bhsd' vs 'bshd'" in bshd["error"]
    unc = out["uncovered"]
    assert (
        unc["type"] == "NotWarmedError" and "does not cover it" in unc["error"] and "q_len 256 vs 128" in unc["error"]
    )
    assert "warmup=False" in unc["hint"]
    assert out["no_grad_on_inputs_requiring_grad"] == out["grad_mode_on"] == "served"
    auto = out["autocast"]
    assert auto["type"] == "NotWarmedError" and "GLOBAL_STATE" in auto["error"] and "autocast" in auto["hint"]
    foreign = out["foreign_entry"]  # Dynamo has an entry for it, from another backend: it would still trace
    assert foreign["type"] == "NotWarmedError" and "does not cover it" in foreign["error"]
    assert out["frames_compiled_by_kernelpack"] == 0
    assert out["compiled"] == 0 and len(out["refused"]) == 6 and "6 calls refused" in out["summary"]
    assert out["refused"][0].startswith("the artifact does not cover it") and "warmed it" in out["refused"][1]
    # the warm-up's (one precompiled function loaded and called), then any loaded at a served call's first call
    assert out["first_calls"][0] == [True, "fwd"] and all(not w for w, _ in out["first_calls"][1:]), out


def test_background_warm_up_returns_at_once_and_calls_wait_for_it(smoke_artifact: Path, tmp_path: Path) -> None:
    """activate() returns before its warm-up has made a call, and the threads' calls wait for it. It checks the
    manifest and the build key in the foreground and leaves the install's files (in a thread of their own) and
    Dynamo's and inductor's imports (2.8 s of a 2-config activate() on torch 2.15.0) to the start's thread, while
    the main thread imports inductor's internals too."""
    out = scenario("background", smoke_artifact, tmp_path)
    assert out["errors"] == [] and out["compiled"] == 0
    assert out["done_at_return"] is False and out["install"], out
    assert set(out["imported_by"].values()) == {"kernelpack-warmup"} and len(out["imported_by"]) == 2, out
    # the warm-up loads and calls one precompiled function in its thread; the other loads at its first call, in
    # one of the job's threads (KERNELPACK_LOAD=lazy)
    assert [w for w, _ in out["first_calls"]] == [True, False], out
    assert out["first_calls"][0][1] == "kernelpack-warmup" and out["first_calls"][1][1] != "MainThread", out
    # the start's files (the warm-up's signature's part) are written by the install's child process, not beside the
    # imports under this process's GIL; the other signature's part by the thread whose call loads it, at that call
    # (KERNELPACK_INSTALL=used); and inductor's own torch_key is not computed (kernelpack's reading of torch's sources
    # matched the artifact's)
    assert out["installed"] > 0 and out["extracted_here"] == [out["first_calls"][1][1]], out
    assert out["inductor_key_reads"] == [], out
    # the start imports with Python's thread switch interval at 0.5 ms (Triton's key and the install's writes win
    # the GIL back sooner), and puts the job's own back when its imports are done
    assert out["switch_intervals"] == {"before": 0.005, "importing": 0.0005, "after": 0.005}, out


def test_a_background_start_can_install_in_its_own_process_and_reads_inductors_key_where_ours_differs(
    smoke_artifact: Path, tmp_path: Path
) -> None:
    """KERNELPACK_INSTALL_PROCESS=0: the install's thread writes the start's files in the job's process. And
    where kernelpack's reading of torch's sources is not what matched the artifact (KERNELPACK_TEST_MISREAD: a torch
    whose sources it would misread), the start's thread computes inductor's own torch_key, which decides."""
    out = scenario(
        "background",
        smoke_artifact,
        tmp_path,
        KERNELPACK_INSTALL_PROCESS="0",
        KERNELPACK_TEST_MISREAD="1",
        KERNELPACK_START_SWITCH_INTERVAL="0",
    )
    assert out["errors"] == [] and out["compiled"] == 0, out
    assert set(out["switch_intervals"].values()) == {0.005}, out  # 0: the job's own interval, untouched
    # the start's parts (its config's own and the one both configs' workers wrote) in the install's thread, then the
    # other config's own part in the thread of its first call
    *start, later = out["extracted_here"]
    assert out["installed"] > 0 and start and set(start) == {"kernelpack-install"}, out
    assert later == out["first_calls"][1][1], out
    assert out["inductor_key_reads"] == ["kernelpack-warmup"], out


def test_a_call_waits_for_a_background_warm_up_only_so_long(
    smoke_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELPACK_WARMUP_WAIT_SECONDS", "0.01")
    out = scenario("background_timeout", smoke_artifact, tmp_path)
    assert "has not finished after 0 s" in out["early"] and "KERNELPACK_WARMUP_WAIT_SECONDS" in out["early"]
    assert out["later"] == "served" and out["compiled"] == 0


def test_no_wait_closes_a_cycle_with_a_single_engine_thread(smoke_artifact: Path, tmp_path: Path) -> None:
    """The checkpoint deadlock, synthetic (see runtime_scenarios.synthetic_engine): against the gate of 58147ec the
    two threads are still alive after 60 s; now the recompute is served and the compile refused, at once."""
    out = scenario("synthetic_engine", smoke_artifact, tmp_path)
    assert out["alive"] == 0, out
    assert out["b"] == "done" and out["a"] == "NotWarmedError" and out["seconds"] < 30


def test_without_warm_up_a_call_in_backward_waits_briefly_then_raises(
    smoke_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELPACK_BACKWARD_WAIT_SECONDS", "2")
    out = scenario("backward_wait", smoke_artifact, tmp_path)
    assert out["alive"] == 0 and out["a"] == "compiled" and out["in_backward"] is True
    assert "inside a backward pass" in out["b"] and "waited 2 s" in out["b"]
    assert out["b_seconds"] < 30, out


def test_steady_state_calls_do_not_serialize(smoke_artifact: Path, tmp_path: Path) -> None:
    out = scenario("overlap", smoke_artifact, tmp_path)
    assert out["first_calls"] == 1 and out["max_inside"] >= 2


def test_recompile_limit_reaches_worker_threads(smoke_artifact: Path, tmp_path: Path) -> None:
    """Where Dynamo serves the call (tier 1): the floor is in force in the worker thread. A precompiled function's
    call (tier 2) does not consult it, and does not pay for setting it."""
    out = scenario("thread_config", smoke_artifact, tmp_path, KERNELPACK_PRECOMPILED="0")
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


def _signature(device_index: int, graph: Graph = "fwd+bwd", **changes: object) -> CallSignature:
    return dataclasses.replace(DFLASH, **changes).signature(device_index, graph)


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
    # the device differs too: not a length fix alone
    assert other_shape.hint is not None and "add this shape to the recipe" in other_shape.hint
    lengths_only = runtime.refusal(manifest.covers(_signature(0, q_len=2048, kv_len=2048)), "a.kpack")
    assert lengths_only.hint is not None and "q_len 2048 (covered: 4096)" in lengths_only.hint
    assert "widen the range" in lengths_only.hint and "padded_lengths" in lengths_only.hint


def test_a_length_of_one_block_outside_a_dynamic_range_is_told_it_needs_its_own_table(tmp_path: Path) -> None:
    """A dynamic range starts above one block (torch specializes a one-block BlockMask): a call at 128 or below is
    told to add a static table, not to widen the range (which the recipe would refuse); a call above the range is told
    to widen it. Each hint names the covered range and the call's length."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        'name = "r"\ndevice = "cpu"\n[[calls]]\nmask = "sliding_window"\nwindow = 64\nbatch = 1\nq_heads = 4\n'
        "kv_heads = 2\n"
        'seq_len = { min = 129, max = 1024 }\nhead_dim = 16\ndtype = "float32"\ngraphs = ["fwd"]\ndynamic = true\n'
    )
    config = load_recipe(recipe).configs[0]
    manifest = _built_on_device_0(config)

    def hint(length: int) -> str:
        call = dataclasses.replace(config, q_len=length, kv_len=length, q_range=None, kv_range=None)
        err = runtime.refusal(manifest.covers(call.signature(0, "fwd")), "a.kpack")
        assert err.hint is not None, err
        return err.hint

    for length in (128, 64):
        small = hint(length)
        assert f"q_len {length} (covered: 129..1024)" in small and f"seq_len = {length}" in small, small
        assert "widen the range" not in small and "one block (128)" in small, small
    big = hint(2048)
    assert "q_len 2048 (covered: 129..1024)" in big and "widen the range" in big and "one block" not in big, big
    assert manifest.covers(dataclasses.replace(config, q_len=129, kv_len=129).signature(0, "fwd")).covered


def test_a_non_strict_refusal_of_another_device_index_names_the_device_fix_too() -> None:
    """Non-strict mode after the warm-up refuses an uncovered call as well (NotWarmedError: tracing it could hang
    threads); an unpinned torchrun rank on cuda:3 must get the same device fix as in strict mode, not "add it to the
    recipe"."""
    manifest = _built_on_device_0(DFLASH)
    err = not_warmed(manifest.covers(_signature(3)))
    assert "device_index 0 vs 3" in str(err) and "pin_local_gpu()" in err.hint and "--devices" in err.hint
    other_shape = not_warmed(manifest.covers(_signature(3, q_len=2048, kv_len=2048)))
    assert "add it to the recipe" in other_shape.hint  # the device and the graph differ too: not a length fix


def test_refusal_of_a_forward_only_call_against_a_training_only_artifact_names_the_graph_fix() -> None:
    """Reentrant checkpointing runs the forward under no_grad: against `backward = true` (fwd+bwd only) that call is
    refused, and the hint says to add the forward graph or checkpoint without reentrancy."""
    training_only = _built_on_device_0(dataclasses.replace(DFLASH, graphs=("fwd+bwd",)))
    err = runtime.refusal(training_only.covers(_signature(0, "fwd", graphs=("fwd+bwd",))), "a.kpack")
    assert "graph 'fwd+bwd' vs 'fwd'" in str(err)
    assert err.hint is not None and '"fwd", "fwd+bwd"' in err.hint and "use_reentrant=False" in err.hint
    assert training_only.covers(_signature(0, "fwd+bwd", graphs=("fwd+bwd",))).covered
    both = _built_on_device_0(DFLASH)
    assert both.covers(_signature(0, "fwd")).covered and both.covers(_signature(0, "fwd+bwd")).covered
    forward_only = _built_on_device_0(dataclasses.replace(DFLASH, graphs=("fwd",)))
    err = runtime.refusal(forward_only.covers(_signature(0, "fwd+bwd", graphs=("fwd",))), "a.kpack")
    assert err.hint is not None and "add the training graph" in err.hint


HF_RECIPE = """
name = "hf-block-cpu"
device = "cpu"
mask = "sliding_window"
windows = [64]

[matrix]
q_heads = 4
kv_heads = 2
seq_len = [256]
head_dim = 16
dtypes = ["float32"]

[call]
layout = "bshd"
scale = 0.25
score_mod = "identity"
"""


def test_an_hf_style_block_is_served_by_an_artifact_built_for_its_call(tmp_path: Path) -> None:
    """Linear projections seen through .view().transpose(1, 2), a scale and transformers' score_mod closure (an
    identity without softcap; the lse is CUDA-only): built with `[call]` keys, the block's own call compiles nothing
    in a fresh process; the contiguous call is refused, naming the layout."""
    from kernelpack.build import build_recipe

    recipe = tmp_path / "hf.toml"
    recipe.write_text(HF_RECIPE)
    built = build_recipe(recipe, tmp_path / "out")
    assert built.artifact is not None and not built.failed
    assert set(built.outcomes[0].errors) == {"fwd:out"} and 0 < built.outcomes[0].errors["fwd:out"] < 2e-3
    out = scenario("hf_block", built.artifact, tmp_path)
    assert out["out"] == [1, 256, 64]
    assert out["compiled"] == 0 and out["refused"] == [], out
    assert out["summary"].startswith("0 of 1 compiles missed (0 FX-graph misses, 0 AOTAutograd misses, 0 kernels"), out
    assert out["compiles"] == [["kernelpack warm-up", False]], out  # the user's own mask: no compile of its own
    assert "layout 'bshd' vs 'bhsd'" in out["contiguous"] and "rebuild" in out["contiguous"]


MISMATCHES = ("layout", "scale", "mask", "q_len", "score_mod", "mask_dims", "alias")


def test_every_miss_is_refused_or_reported_with_the_field_whatever_the_code_path(
    smoke_artifact: Path, tmp_path: Path
) -> None:
    """Mismatch class x code path, after the warm-up: kernelpack's entry refuses, naming the field; strict mode
    refuses the user's own torch.compile(flex_attention) before it compiles; non-strict mode lets it compile and
    reports it from torch's per-compile records (path, site, differing field) with one warning per call site; other
    compiled code and the dense path are reported too, and the summary never says 0 misses."""
    out = scenario("code_paths", smoke_artifact, tmp_path)
    for name in MISMATCHES:
        ours, theirs = out[f"kernelpack/{name}"], out[f"torch.compile/{name}"]
        assert ours.startswith("NotPrecompiledError: "), ours
        # Dynamo re-raises what a compile callback raises under its own name; the message is kernelpack's
        assert theirs.startswith("InternalTorchDynamoError: NotPrecompiledError: "), theirs
        assert "outside kernelpack's entry" in theirs
        # the hint travels in str(), through Dynamo too; a length alone gets the lengths' fixes
        assert (
            "\nhint: q_len 128 (covered: 256)" if name == "q_len" else "\nhint: add this shape to the recipe"
        ) in theirs
        field = "q_len 256 vs 128" if name == "q_len" else f"differs in: {name} "
        assert field in ours and field in theirs, (name, ours, theirs)
    assert out["eager"].startswith("DenseFallbackError")
    assert out["covered"].startswith("served"), out["covered"]
    strict = out["strict"]
    assert strict["refused"] == 2 * len(MISMATCHES)
    refused_compiles = [c for c in strict["compiles"] if c["path"] == "torch.compile(flex_attention)"]
    assert len(refused_compiles) == len(MISMATCHES)
    assert all(c["failed"].startswith("NotPrecompiledError") and not c["missed"] for c in refused_compiles)
    assert sorted(d["field"] for c in refused_compiles for d in c["differences"]) == sorted(
        ["layout", "scale", "mask", "q_len", "kv_len", "score_mod", "mask_dims", "alias"]
    )
    assert [d["path"] for d in strict["dense"]] == ["flex_attention (eager)"]
    assert strict["dense"][0]["site"].endswith(".py:" + strict["dense"][0]["site"].rsplit(":", 1)[1])
    assert "runtime_scenarios.py" in strict["dense"][0]["site"]

    non_strict = out["non_strict"]
    own = [c for c in non_strict["compiles"] if c["path"] == "torch.compile(flex_attention)"]
    assert [c["missed"] for c in own] == [True, True], own
    assert [d["field"] for d in own[0]["differences"]] == ["layout"]
    assert own[0]["differences"][0] == {"field": "layout", "call": "bshd", "covered": "bhsd"}
    assert own[0]["fx_misses"] >= 1 and "runtime_scenarios.py" in own[0]["site"]
    assert [c["path"] for c in non_strict["compiles"] if c["missed"]] == [
        "torch.compile(flex_attention)",
        "torch.compile(flex_attention)",
        "other compiled code",
    ]
    # one warning per call site: two compiles at the flex site, one at the other
    assert len(out["warnings"]) == 2, out["warnings"]
    assert (
        "torch.compile(flex_attention) compiled" in out["warnings"][0]
        and "layout 'bshd' vs 'bhsd'" in out["warnings"][0]
    )
    assert out["warnings"][1].startswith("kernelpack: other compiled code compiled <lambda>")
    assert non_strict["summary"].startswith("3 of "), non_strict["summary"]
    assert "3 outside kernelpack's entry (other compiled code, torch.compile(flex_attention))" in non_strict["summary"]

    assert out["keys"] == documented_report_keys()


def documented_report_keys() -> dict[str, list[str]]:
    """The keys docs/REPORT.md documents, per section (the first column of each table; "a`, `b" rows are two)."""
    import re

    keys: dict[str, list[str]] = {}
    section = ""
    for line in (REPO / "docs" / "REPORT.md").read_text().splitlines():
        if line.startswith("## "):
            heading = re.search(r"`(\w+)\[\]`", line)
            section = heading.group(1) if heading else ""
        elif line.startswith("| `"):
            keys.setdefault(section, []).extend(re.findall(r"`(\w+)`", line.split("|")[1]))
    return {k: sorted(v) for k, v in keys.items()}


def test_settings_that_enter_inductors_keys_are_checked_at_activate(smoke_artifact: Path, tmp_path: Path) -> None:
    """The builder's inductor config and CPU thread count are in the manifest; a process that differs would miss
    every entry: strict activate() refuses naming each setting, non-strict warns, and set back it is served."""
    out = scenario("key_settings", smoke_artifact, tmp_path)
    assert "inductor.max_autotune: built with False, here True" in out["strict"], out["strict"]
    assert "cpu_threads: built with " in out["strict"] and "\nhint: set them as the builder had them" in out["strict"]
    # a background start refuses at activate() when the job imported the config modules (this one did)...
    assert "inductor.max_autotune: built with False, here True" in out["background_activate"], out
    # ... and otherwise at the first guarded call, from its thread (a child that set it through the environment)
    assert "activate()'s background start failed" in out["background"], out["background"]
    assert "inductor.max_autotune: built with False, here True" in out["background"], out["background"]
    assert len(out["warnings"]) == 1 and "inductor.max_autotune" in out["warnings"][0]
    assert re.match(r"0 of [12] compiles missed", out["summary"]), out["summary"]


DECLARED_RECIPE = """
name = "declared-cpu"
device = "cpu"
mask = "sliding_window"
windows = [64]

[matrix]
q_heads = 2
seq_len = [256]
head_dim = 16
dtypes = ["float32"]

[call]
mask_dims = "per-head"
alias = "k=v"
"""


def test_a_per_head_mask_and_one_tensor_as_key_and_value_are_built_and_served(tmp_path: Path) -> None:
    """`[call] mask_dims` and `alias`: the builder compiles exactly that call, the user's own call of that form is
    served with nothing compiled, and the other form of each is refused naming the field."""
    from kernelpack.build import build_recipe
    from kernelpack.errors import BuildError

    recipe = tmp_path / "declared.toml"
    recipe.write_text(DECLARED_RECIPE)
    try:
        built = build_recipe(recipe, tmp_path / "out")
    except BuildError as e:
        # torch 2.11's CPU flex kernel has no lowering for key and value in one buffer: the build fails naming it
        if torch_release() < (2, 13) and "same buffer" in str(e):
            assert "alias=k=v" in str(e) and "LoweringException" in str(e)
            pytest.skip("torch < 2.13 cannot compile key and value in one buffer on the CPU; the build says so")
        raise
    assert built.artifact is not None and not built.failed
    out = scenario("declared_call", built.artifact, tmp_path)
    assert out["declared"] == "served", out
    assert "differs in: mask_dims 'per-head' vs 'broadcast'" in out["broadcast_mask"], out["broadcast_mask"]
    assert "differs in: alias 'k=v' vs 'none'" in out["value_copy"], out["value_copy"]
    assert out["missed"] == 0 and out["summary"].startswith("0 of 1 compiles missed"), out


DOC_MASKS = """
import torch


def same_document(doc_ids):
    # attend within one's own document, causally: the mask closes over a tensor that changes every batch
    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)

    return mask_mod


def example(config):
    # the recipe's factory: a mask of the recipe's shapes over example ids (their values do not enter the graph)
    return same_document(torch.zeros(config.q_len, dtype=torch.int32))


def softcap(config):
    # the recipe's score_mod factory: tanh soft-capping at 30, as transformers writes it for Gemma-style models
    cap = 30.0

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return score_mod
"""


def test_a_mask_closing_over_a_tensor_is_served_from_its_factory_with_each_steps_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Masks over per-batch tensors (document ids, anchors) through a recipe factory: built from example tensors of
    the recipe's shapes; each step's new closure over new values is served with nothing compiled and computes with
    its own values; the user's own function with the same graph is refused, not swapped for the warmed closure. The
    score_mod comes from a recipe factory too (a tanh softcap); the user's own closure computing it is served."""
    from kernelpack.build import build_recipe

    (tmp_path / "doc_masks.py").write_text(DOC_MASKS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = tmp_path / "docs.toml"
    recipe.write_text(
        'name = "docs"\ndevice = "cpu"\nmask = "doc_masks:example"\n'
        "[matrix]\nq_heads = 2\nhead_dim = 16\nseq_len = 256\ndtypes = ['float32']\ngraphs = ['fwd']\n"
        '[call]\nscore_mod = "doc_masks:softcap"\n'
    )
    built = build_recipe(recipe, tmp_path / "out")
    assert built.artifact is not None and not built.failed
    out = scenario("document_mask", built.artifact, tmp_path)
    assert len(out["errors"]) == 3 and max(out["errors"]) < 1e-4, out
    assert out["missed"] == 0, out["summary"]
    assert out["own"].startswith("NotWarmedError") and "mask_mod" in out["own"], out["own"]
    manifest = read_manifest(built.artifact)
    assert manifest.configs[0].score_key.startswith("graph#")
    assert manifest.signatures[0].score_mod == manifest.configs[0].score_key


def test_per_compile_records_see_bypasses_ignore_foreign_kernels_and_survive_dynamo_reset(
    smoke_artifact: Path, tmp_path: Path
) -> None:
    out = scenario("evidence_edges", smoke_artifact, tmp_path)
    assert out["after_reset"].startswith("InternalTorchDynamoError: NotPrecompiledError"), out["after_reset"]
    fx_hits, missed, cpp = out["hit_after_cpp"]
    assert fx_hits >= 1 and not missed and cpp == 0, out["hit_after_cpp"]
    assert out["bypassed"]["missed"] and "1 FX-graph cache bypasses" in out["bypassed"]["compiled"], out["bypassed"]
    assert not out["bypassed"]["summary"].startswith("0 of"), out["bypassed"]["summary"]


def test_a_transformers_model_with_attn_implementation_kernelpack_compiles_nothing(tmp_path: Path) -> None:
    """On CPU: the recipe written from a tiny Mistral config (sliding window, GQA 4/2), built, then the model
    with attn_implementation="kernelpack" in a fresh process after activate(): its forward compiles nothing (the mask
    is built without torch.compile); its logits equal transformers' own flex_attention and SDPA."""
    pytest.importorskip("transformers")
    from transformers import MistralConfig

    from kernelpack.build import build_recipe
    from kernelpack.integrations.transformers import recipe_for

    sys.path.insert(0, str(SCENARIOS.parent))
    from runtime_scenarios import TINY_MISTRAL

    recipe = tmp_path / "mistral.toml"
    recipe.write_text(
        recipe_for(MistralConfig(**TINY_MISTRAL), seq_lens=[256], dtype="float32", device="cpu", graphs=["fwd"])
    )
    built = build_recipe(recipe, tmp_path / "out")
    assert built.artifact is not None and not built.failed, recipe.read_text()
    out = scenario("transformers_model", built.artifact, tmp_path)
    assert out["registered_by_activate"] and len(out["calls"]) == TINY_MISTRAL["num_hidden_layers"], out
    assert out["calls"][0] == [256 * 64, 16, 64, 1], out  # the transposed view of q_proj's output
    assert out["missed"] == 0 and out["refused"] == [], out
    assert out["paths"] == ["kernelpack warm-up"], out  # no compile of the model's own: no mask builder graph
    assert out["vs_sdpa"] < 1e-4 and out["vs_flex"] < 1e-4, out
    assert out["takeover"] == {"registered": True, "missed": 0, "vs_ours": 0.0}, out["takeover"]
    assert out["late_pytree"] == "served", out["late_pytree"]


@pytest.mark.once  # the integration's masks: test_integrations on 2.11
def test_packed_sequences_through_the_integration_keep_each_rows_documents(
    smoke_artifact: Path, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    out = scenario("transformers_packed", smoke_artifact, tmp_path)
    assert max(out["packed"] + out["flipped"]) < 1e-5, out


FORK_DURING_WARMUP = """
import json, os, sys, time
from kernelpack import runtime
from kernelpack.runtime import warmup
real = warmup.warm_up
def slow(state, activation):  # the job forks while the warm-up is still at it
    time.sleep(3)
    real(state, activation)
warmup.warm_up = slow  # what the background start's thread calls
activation = runtime.activate(sys.argv[1], warmup="background")
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    start = time.monotonic()
    try:
        activation.warmup.wait()
        result = "waited"
    except Exception as e:
        result = str(e)
    os.write(write, json.dumps({"result": result, "seconds": time.monotonic() - start}).encode())
    os._exit(0)
os.waitpid(pid, 0)
child = json.loads(os.read(read, 65536))
activation.warmup.wait()  # the parent's warm-up is unaffected
print(json.dumps({**child, "parent_done": activation.warmup.error is None}))
"""


def test_a_child_forked_during_a_background_warm_up_fails_at_once_saying_why(
    smoke_artifact: Path, tmp_path: Path
) -> None:
    """A fork during a background warm-up left the child waiting 900 s for a thread it does not have."""
    out = run_json(
        [sys.executable, "-c", FORK_DURING_WARMUP, str(smoke_artifact)],
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "c"), "KERNELPACK_WARMUP_WAIT_SECONDS": "60"},
    )
    assert "forked while activate()'s background warm-up ran" in out["result"], out
    assert out["seconds"] < 1 and out["parent_done"]


def test_a_warmed_call_that_fails_a_tensor_guard_is_told_its_layout_not_its_mask() -> None:
    """Gemma3's refusal blamed the mask while Dynamo said stride. The hint follows the guard Dynamo
    names, here a real one: a function compiled on k as transformers passes it with one kv head (the transposed
    view: contiguous but for the size-1 head dim's stride), then called with a contiguous k; the hint names the
    argument and its layout. A BlockMask table's guard gets the BlockMask's hint, the mask's code its own."""
    import torch

    def attend(query, key, value):  # type: ignore[no-untyped-def]
        return query + key + value

    compiled = torch.compile(attend, backend="eager", dynamic=False)
    q = torch.randn(1, 2, 64, 32)
    view = torch.randn(1, 64, 1, 32).transpose(1, 2)
    compiled(q, view, view)
    torch._dynamo.utils.guard_failures.clear()
    compiled(
        q, torch.randn(1, 1, 64, 32), view
    )  # contiguous: strides (2048, 2048, 32, 1), the view's (2048, 32, 32, 1)
    (reasons,) = torch._dynamo.utils.guard_failures.values()
    failed = "; ".join(map(str, reasons))
    assert "stride mismatch" in failed and "key" in failed, failed
    sig = CallSignature(
        device="cpu", batch=1, q_heads=2, kv_heads=1, q_len=64, kv_len=64, head_dim=32, dtype="float32",
        layout="q=bhsd k=bhsd v=bshd", mask="m", device_index=None, graph="fwd",
    )  # fmt: skip
    hint = runtime.guard_hint(failed + "; the mask_mod or score_mod runs other code", sig)
    assert hint is not None and hint.startswith("key's strides differ") and "q=bhsd k=bhsd v=bshd" in hint, hint
    table = runtime.guard_hint("tensor 'L['block_mask'].kv_num_blocks' stride mismatch at index 0", sig)
    assert table is not None and "BlockMask" in table, table
    code = runtime.guard_hint("the mask_mod or score_mod runs other code than the warmed one's", sig)
    assert code is not None and code.startswith("build the BlockMask from the recipe's mask function"), code
    assert runtime.guard_hint("___check_obj_id(G['something'], 1234)", sig) is None
