"""CUDA end-to-end: build forward+backward on the GPU, verify zero misses, and show the counters can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import repack, run_json

from kernelpack import artifact as art
from kernelpack.build import build_recipe as build
from kernelpack.errors import VerifyError
from kernelpack.verify import verify_artifact as verify

pytestmark = pytest.mark.gpu
RECIPE = Path(__file__).parent / "data" / "gpu-small.toml"


@pytest.fixture(scope="module")
def gpu_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    result = build(RECIPE, tmp_path_factory.mktemp("gpu"), jobs=2)
    assert result.artifact is not None and not result.failed
    return result.artifact


def test_devices_that_are_not_visible_are_refused_up_front(tmp_path: Path) -> None:
    """--devices is checked against the visible GPUs before any worker starts."""
    import time

    import torch

    from kernelpack.cli import main

    missing = torch.cuda.device_count()
    start = time.perf_counter()
    assert main(["build", str(RECIPE), "-o", str(tmp_path / "out"), "--devices", f"0,{missing}"]) == 1
    assert time.perf_counter() - start < 10 and not (tmp_path / "out").exists()


def test_build_records_gpu_key_and_reference_errors(gpu_artifact: Path) -> None:
    import torch

    m = art.read_manifest(gpu_artifact).to_dict()
    assert m["build_key"]["device_type"] == "cuda"
    assert m["build_key"]["gpu_name"] == torch.cuda.get_device_name(0)
    assert m["build_key"]["torch_git"] == torch.version.git_version
    assert len(m["configs"]) == 2 and all(c["compile_seconds"] > 0 for c in m["configs"])
    assert all(0 < c["max_rel_error"] < 3e-2 for c in m["configs"])
    assert any(f["path"].startswith("triton/0/") for f in m["files"])


def test_verify_zero_misses_forward_and_backward(gpu_artifact: Path) -> None:
    report = verify(gpu_artifact, check=True)
    t = report.to_dict()["totals"]
    assert t["inductor.fxgraph_cache_miss"] == 0 and t["aot_autograd.autograd_cache_miss"] == 0
    assert t["triton_compiled"] == 0 and t["dense_calls"] == 0
    assert report.to_dict()["triton_detection"] != "not installed" and not report.to_dict()[
        "triton_detection"
    ].startswith("unavailable")
    # forward and backward graphs were both served from the cache
    assert t["inductor.fxgraph_cache_hit"] >= 2 * len(report.to_dict()["configs"])


def test_verify_fails_when_the_triton_kernels_are_missing(gpu_artifact: Path, tmp_path: Path) -> None:
    """Drop every Triton file and FX entry of the artifact: verify must see real compiles and fail."""
    broken = repack(
        gpu_artifact,
        tmp_path / "broken.kpack",
        tmp_path / "w",
        drop=lambda rel: rel.startswith(("triton/", "fxgraph/")),
    )
    with pytest.raises(VerifyError) as exc:
        verify(broken)
    assert "FX-graph cache misses" in str(exc.value) and "Triton kernels compiled" in str(exc.value)


def test_cold_compile_is_seen_by_the_triton_listener(tmp_path: Path) -> None:
    code = (
        "import json, torch; from kernelpack import evidence; evidence.install_hooks();"
        "from kernelpack.recipe import load_recipe; from kernelpack.workload import run_config;"
        f"c = load_recipe({str(RECIPE)!r}).configs[0]; s = evidence.snapshot(); run_config(c, 'cuda:0', check=False);"
        "print(json.dumps(evidence.delta(s, evidence.snapshot())))"
    )
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    d = run_json([sys.executable, "-c", code], env=env)
    assert d["triton_compiled"] > 0 and d["inductor.fxgraph_cache_miss"] >= 2


def test_threads_with_gradient_checkpointing_compile_nothing_and_never_hang(gpu_artifact: Path, tmp_path: Path) -> None:
    """The seeds' setting: 3 threads, each a block under checkpoint(), after activate(). On the gate of 58147ec the
    non-reentrant mode deadlocked (a first call's make_fx waited for the autograd engine thread, which ran another
    thread's recompute waiting at the gate); each run is a fresh process bounded by 120 s."""
    for r in _checkpoint_runs(gpu_artifact, ("nonreentrant", "reentrant", "both"), tmp_path):
        # the warm-up loads and calls one precompiled function; the others load at their first call, some on the
        # autograd engine's thread in a reentrant recompute (KERNELPACK_LOAD=lazy): each signature once, none
        # compiled. Reentrant checkpointing calls both graphs of every config (its forward runs under no_grad);
        # without it only fwd+bwd is called, so the warm-up's plus those
        sigs = r["first_call_signatures"]
        assert r["warmup_calls"] >= 1 and len(set(sigs)) == len(sigs) and r["first_compiled"] == [], r
        graphs = [g for _, g in r["first_call_graphs"]]
        warm_fwd = sum(w and g == "fwd" for w, g in r["first_call_graphs"])
        assert graphs.count("fwd+bwd") == r["configs"], r
        assert graphs.count("fwd") == (warm_fwd if r["mode"] == "nonreentrant" else r["configs"]), r


def _checkpoint_runs(
    artifact: Path, modes: tuple[str, ...], tmp_path: Path, block: str = "canonical", random_steps: int = 0
) -> list[dict]:
    """One run per mode of bench/checkpoint_threads.py (3 threads, a fresh process each bounded by 120 s), each
    checked to have completed with no error, no refusal, and nothing compiled or traced during the steps."""
    out = tmp_path / "ckpt.json"
    script = Path(__file__).parent.parent / "bench" / "checkpoint_threads.py"
    args = ["--modes", ",".join(modes), "--runs", "1", "--threads", "3", "--timeout", "120", "--block", block]
    args += ["--random-steps", str(random_steps)]
    subprocess.run(
        [sys.executable, str(script), "--artifact", str(artifact), *args, "--out", str(out)], check=True, timeout=600
    )
    runs = json.loads(out.read_text())["runs"]
    checked = []
    for mode in modes:
        (r,) = runs[mode]
        assert "timeout" not in r and "crash" not in r, json.dumps(r)
        assert r["errors"] == [] and r["alive"] == 0 and r["refused"] == [], json.dumps(r)
        # nothing compiled or traced during the steps: every call was the warm-up's graph
        assert r["compiled_during_steps"] == [] and r["dynamo_frames_compiled"] == 0, json.dumps(r)
        checked.append(r)
    return checked


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.skipif("_gpus() < 2", reason="needs 2 GPUs")
def test_multi_device_build_covers_every_index(tmp_path: Path) -> None:
    """One process driving several GPUs: every config compiled per device index, and each index hits."""
    devices = list(range(_gpus()))
    result = build(RECIPE, tmp_path, jobs=4, devices=devices)
    assert result.artifact is not None and not result.failed
    m = art.read_manifest(result.artifact).to_dict()
    assert m["devices"] == devices and all(c["devices"] == devices for c in m["configs"])
    assert {f["path"].split("/")[1] for f in m["files"] if f["path"].startswith("triton/")} == {str(d) for d in devices}
    report = verify(result.artifact)
    assert len(report.to_dict()["configs"]) == len(devices) * len(m["configs"])
    assert (
        report.to_dict()["totals"]["inductor.fxgraph_cache_miss"] == 0
        and report.to_dict()["totals"]["triton_compiled"] == 0
    )
    # tier 2 per device index: a function per (config, graph, index), each proven by verify
    graphs = sum(len(c["params"]["graphs"]) for c in m["configs"])
    assert report.to_dict()["precompiled"] == graphs * len(devices), report.to_dict()["configs"]


THREADS_OVER_GPUS_JOB = """
import json, sys, threading, torch
from torch._dynamo.utils import counters
import kernelpack
from kernelpack import runtime
from kernelpack.artifact import read_manifest
from kernelpack.canonical import call, grad_output, make_inputs
from kernelpack.masks import block_mask_for
runtime.activate(sys.argv[1], cache_dir=sys.argv[2])
frames = counters["frames"]["ok"]
errors = []
def drafter(index):
    try:
        device = f"cuda:{index}"
        for built in read_manifest(sys.argv[1]).configs:
            c = built.config
            for graph in c.graphs:
                inputs = make_inputs(c, device, graph)
                dout = grad_output(inputs[0]) if graph == "fwd+bwd" else None
                call(kernelpack.flex_attention, c, graph, inputs, block_mask_for(c, device), dout)
        torch.cuda.synchronize(index)
    except Exception as e:
        errors.append(f"{index}: {type(e).__name__}: {e}")
threads = [threading.Thread(target=drafter, args=(i,)) for i in range(torch.cuda.device_count())]
[t.start() for t in threads]
[t.join() for t in threads]
rep = runtime.report().to_dict()
print(json.dumps({"errors": errors, "frames": counters["frames"]["ok"] - frames,
                  "served": [[s["graph"], s["tier"]] for s in rep["served"]], "tier1": rep["inductor_cache_tier"]}))
"""

TORCHRUN_TIER_JOB = """
import json, os, sys, time
from kernelpack import runtime
runtime.pin_local_gpu()  # this rank's GPU becomes cuda:0: the single-GPU artifact's keys and functions apply
import torch
from torch._dynamo.utils import counters
import kernelpack
from kernelpack.artifact import read_manifest
from kernelpack.canonical import call, grad_output, make_inputs
from kernelpack.masks import block_mask_for
rank = int(os.environ["LOCAL_RANK"])
torch.zeros(1, device="cuda")
start = time.perf_counter()
runtime.activate(sys.argv[1], cache_dir=os.path.join(sys.argv[2], f"rank{rank}"))
frames = counters["frames"]["ok"]
for built in read_manifest(sys.argv[1]).configs:
    c = built.config
    for graph in c.graphs:
        inputs = make_inputs(c, "cuda:0", graph)
        dout = grad_output(inputs[0]) if graph == "fwd+bwd" else None
        call(kernelpack.flex_attention, c, graph, inputs, block_mask_for(c, "cuda:0"), dout)
torch.cuda.synchronize()
rep = runtime.report().to_dict()
out = {"rank": rank, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "ttfs": time.perf_counter() - start,
       "frames": counters["frames"]["ok"] - frames, "tiers": sorted({s["tier"] for s in rep["served"]}),
       "precompiled": rep["precompiled"]}
open(os.path.join(sys.argv[3], f"rank{rank}.json"), "w").write(json.dumps(out))
"""


@pytest.mark.skipif("_gpus() < 2", reason="needs 2 GPUs")
def test_tier_2_serves_every_device_index_and_every_pinned_rank(gpu_artifact: Path, tmp_path: Path) -> None:
    """One process with a thread per GPU, on an artifact built with --devices 0..N-1: every
    index's calls are served by its own precompiled function, with no Dynamo frame. Then torchrun with one pinned
    rank per GPU, on the single-GPU artifact: every rank (each sees cuda:0) is served by tier 2."""
    devices = list(range(_gpus()))
    multi = build(RECIPE, tmp_path / "multi", jobs=4, devices=devices).artifact
    assert multi is not None
    job = tmp_path / "threads.py"
    job.write_text(THREADS_OVER_GPUS_JOB)
    out = run_json([sys.executable, str(job), str(multi), str(tmp_path / "c")])
    assert out["errors"] == [] and out["frames"] == 0 and out["tier1"] == [], out
    assert {t for _, t in out["served"]} == {"precompiled"}, out
    assert {d for d in devices if any(f"cuda:{d} " in g for g, _ in out["served"])} == set(devices), out
    job = tmp_path / "rank.py"
    job.write_text(TORCHRUN_TIER_JOB)
    results = tmp_path / "ranks"
    results.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={len(devices)}"]
    proc = subprocess.run(
        [*cmd, str(job), str(gpu_artifact), str(tmp_path / "node"), str(results)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((results / f"rank{r}.json").read_text()) for r in devices]
    graphs = sum(len(c.config.graphs) for c in art.read_manifest(gpu_artifact).configs)
    for r in ranks:
        assert r["frames"] == 0 and r["tiers"] == ["precompiled"] and r["precompiled"] == graphs, ranks
    assert sorted(r["visible"] for r in ranks) == [str(d) for d in devices], ranks


@pytest.mark.skipif("_gpus() < 2", reason="needs 2 GPUs")
def test_a_transformers_model_trains_under_torchrun_on_every_pinned_rank(tmp_path: Path) -> None:
    """bench/torchrun_train.py's transformers model (a tiny Mistral, lengths 256 and 512) trains
    under torchrun, one rank per GPU. With pin_local_gpu() every rank's first steps compile nothing and tier 2 serves
    them; without it, rank 0 (cuda:0) is served and every other rank is refused, in strict and in non-strict mode,
    the error naming the device index as the only difference and pin_local_gpu() as the fix."""
    pytest.importorskip("transformers")
    bench = Path(__file__).parent.parent / "bench"
    recipe = tmp_path / "tiny.toml"
    write = [sys.executable, str(bench / "transformers_step.py"), "--write-recipe", str(recipe), "--tiny"]
    subprocess.run([*write, "--lengths", "256,512"], capture_output=True, timeout=300, check=True)
    built = build(recipe, tmp_path / "out", jobs=2)
    assert built.artifact is not None and not built.failed
    out = tmp_path / "torchrun.json"
    cmd = [sys.executable, str(bench / "torchrun_train.py"), "--artifact", str(built.artifact), "--nproc", str(_gpus())]
    cmd += ["--modes", "pinned,unpinned-strict,unpinned", "--steps", "2", "--timeout", "600", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=2400, check=False)  # 3 jobs of <= 600 s
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = {r["mode"]: sorted(r["ranks"], key=lambda k: k["rank"]) for r in json.loads(out.read_text())["results"]}
    pinned = ranks["pinned"]
    assert len(pinned) == len(ranks["unpinned-strict"]) == len(ranks["unpinned"]) == _gpus(), proc.stdout[-3000:]
    for k in pinned:
        assert k["ok"] and k["compiles_in_steps"] == 0 and k["tiers"] == ["precompiled"], k
    assert sorted(k["cuda_visible_devices"] for k in pinned) == [str(d) for d in range(_gpus())], pinned
    for mode, error in (("unpinned-strict", "NotPrecompiledError"), ("unpinned", "NotWarmedError")):
        first, *others = ranks[mode]
        assert first["ok"] and first["compiles_in_steps"] == 0, first
        for k in others:
            assert not k["ok"] and k["error"].startswith(error), k
            assert f"device_index 0 vs {k['rank']}" in k["error"] and "pin_local_gpu()" in k["error"], k["error"]


HF_RECIPE = Path(__file__).parent / "data" / "gpu-hf.toml"


def test_an_hf_style_training_block_is_served_in_threads_with_checkpointing(tmp_path: Path) -> None:
    """On CUDA: a recipe with the call transformers makes (bshd layout, identity score_mod closure, scale,
    lse through return_aux, GQA) builds with the lse checked against the float64 reference; then bench/hf_block.py's
    block (Linear projections, .view().transpose(1, 2), the user's own mask through torch's create_block_mask, its
    own score_mod closure) trains in 3 threads, with and without checkpointing, and compiles nothing."""
    built = build(HF_RECIPE, tmp_path / "out", jobs=2)
    assert built.artifact is not None and not built.failed
    (outcome,) = built.outcomes
    assert {"fwd:lse", "fwd+bwd:lse", "fwd+bwd:dq"} <= set(outcome.errors), outcome.errors
    assert all(0 <= e < 3e-2 for e in outcome.errors.values()), outcome.errors
    _checkpoint_runs(built.artifact, ("none", "nonreentrant", "reentrant"), tmp_path, block="hf")


def test_a_transformers_model_trains_through_kernelpack_and_in_checkpointed_threads(tmp_path: Path) -> None:
    """On CUDA: the recipe of a tiny Mistral config (sliding window, GQA 4/2), forward and forward +
    backward, built; a training step with attn_implementation="kernelpack" in a fresh process compiles nothing,
    equals transformers' own flex path (loss, every gradient, the attention output and the lse it asks for on CUDA);
    then 3 threads, each its own model, train with transformers' gradient checkpointing (reentrant and not) and
    compile nothing."""
    pytest.importorskip("transformers")
    from runtime_scenarios import TINY_MISTRAL
    from test_runtime import scenario
    from transformers import MistralConfig

    from kernelpack.integrations.transformers import recipe_for

    recipe = tmp_path / "mistral.toml"
    text = recipe_for(
        MistralConfig(**TINY_MISTRAL), seq_lens=[256], dtype="bfloat16", device="cuda", graphs=["fwd", "fwd+bwd"]
    )
    recipe.write_text(text)
    built = build(recipe, tmp_path / "out", jobs=2)
    assert built.artifact is not None and not built.failed, text
    out = scenario("transformers_training", built.artifact, tmp_path)
    assert out["compiled_in_step"] == [] and out["missed"] == 0 and out["refused"] == [], out
    # kernelpack's own only (the warm-up's, and a precompiled function's load at its first call): no mask-builder
    # graph, no compile of the model's own
    assert "kernelpack warm-up" in out["paths"] and set(out["paths"]) <= {"kernelpack warm-up", "kernelpack load"}, out
    assert out["query_stride"] == [256 * 64, 16, 64, 1], out  # transformers' transposed view reached kernelpack
    assert out["lse"] == ["torch.bfloat16", [1, 4, 256]] and out["lse_rel"] < 2e-2, out
    loss, ref_loss = out["loss"]
    assert abs(loss - ref_loss) < 1e-2 * abs(ref_loss) and out["grads"], out
    assert out["out_rel"] < 2e-2 and out["grad_rel"] < 5e-2, out
    _checkpoint_runs(built.artifact, ("none", "reentrant", "nonreentrant"), tmp_path, block="tf")


def test_a_recorded_transformers_training_step_replays_with_no_compile(tmp_path: Path) -> None:
    """On CUDA: `kernelpack record` of a user's training step (a tiny Mistral, attn_implementation=
    "kernelpack", transformers' reentrant gradient checkpointing: the forward under no_grad and its recompute with
    grad), built with no hand edit, replayed in a fresh process: the step compiles nothing."""
    pytest.importorskip("transformers")
    bench = Path(__file__).parent.parent / "bench"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(bench), os.environ.get("PYTHONPATH", "")]))
    recipe = tmp_path / "recorded.toml"
    job = [sys.executable, str(bench / "tf_train_step.py"), "--tiny", "--lengths", "256,512"]
    cli = [sys.executable, "-m", "kernelpack.cli"]
    subprocess.run([*cli, "record", "-o", str(recipe), "--", *job], env=env, check=True, timeout=600)
    text = recipe.read_text()
    # two lengths, both multiples of 256: one table of buckets, with both graphs
    assert text.count("[[calls]]") == 1 and "multiple = 256" in text, text
    assert text.count('graphs = ["fwd", "fwd+bwd"]') == 1, text
    built = build(recipe, tmp_path / "out", jobs=2)
    assert built.artifact is not None and not built.failed
    replay = [*job, "--artifact", str(built.artifact), "--cache", str(tmp_path / "cache")]
    result = run_json(replay, env=env)
    assert result["compiles_in_steps"] == 0 and result["misses_in_steps"] == 0, result


@pytest.mark.parametrize("kind", ["dynamic", "buckets"])
def test_a_transformers_model_trains_at_random_lengths_with_no_compile(kind: str, tmp_path: Path) -> None:
    """On CUDA: a tiny Mistral's recipe over lengths 200..1000, as one dynamic graph or as buckets of 256;
    verify (for the dynamic one, 20 random lengths in a fresh process); then a fresh process trains 12 steps at
    random lengths (padded to the buckets for the bucketed one) and compiles nothing, and 3 threads with reentrant
    gradient checkpointing at random lengths compile nothing."""
    pytest.importorskip("transformers")
    bench = Path(__file__).parent.parent / "bench"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(bench), os.environ.get("PYTHONPATH", "")]))
    recipe = tmp_path / "varlen.toml"
    script = [sys.executable, str(bench / "varlen_train.py"), "--tiny", "--min", "200", "--max", "1000"]
    extra = ["--multiple", "256"] if kind == "buckets" else []
    subprocess.run([*script, "--write-recipe", str(recipe), "--graphs", "fwd,fwd+bwd", *extra], env=env, check=True)
    built = build(recipe, tmp_path / "out", jobs=2)
    assert built.artifact is not None and not built.failed
    report = verify(built.artifact).to_dict()
    if kind == "dynamic":
        assert len(report["configs"]) == 1 and len(report["configs"][0]["lengths"]) >= 20, report
    else:
        assert len(report["configs"]) == 4, report  # 256, 512, 768, 1024
    run = [*script, "--artifact", str(built.artifact), "--steps", "12"]
    result = run_json(run, env=env)
    assert result["compiles_in_steps"] == 0 and result["misses_in_steps"] == 0, result
    assert result["padded"] == (kind == "buckets"), result
    lengths = {s["len"] for s in result["steps"]}
    assert len(lengths) > 3 and (kind == "dynamic") == any(n % 256 for n in lengths), result
    assert {s["dynamic"] for s in result["served"]} == {kind == "dynamic"}, result
    (ckpt,) = _checkpoint_runs(built.artifact, ("reentrant",), tmp_path, block="tf", random_steps=3)
    assert len(set(ckpt["lengths"])) > 3, ckpt


FAMILY_PARTS = {
    "a": "llama,mistral,qwen2,qwen3-mixed,gemma2",
    "b": "gemma3,phi3,gpt-neox,gpt-oss,llama-packed,llama-padded",
}


@pytest.mark.parametrize("part", list(FAMILY_PARTS))
def test_every_family_trains_through_kernelpack_with_no_compile(part: str, tmp_path: Path) -> None:
    """On CUDA: a training step (forward + backward, bf16, length 256) of every family of
    tests/families.py (GPT-OSS's attention sinks included), recorded with `kernelpack record`, built with no hand
    edit, replayed in a fresh process that calls activate() before importing the models' classes: nothing compiles
    in any family's step, nothing is refused or missed, and the logits and loss are transformers' own compiled
    flex_attention's (2e-2 max abs error on the logits)."""
    pytest.importorskip("transformers")
    import families

    script = [sys.executable, families.__file__, "--device", "cuda", "--train", "--length", "256"]
    script += ["--families", FAMILY_PARTS[part]]
    recipe = tmp_path / "families.toml"
    cli = [sys.executable, "-m", "kernelpack.cli"]
    subprocess.run([*cli, "record", "-o", str(recipe), "--", *script], check=True, timeout=600)
    built = build(recipe, tmp_path / "out", jobs=2)
    assert built.artifact is not None and not built.failed
    out = run_json([*script, "--artifact", str(built.artifact), "--cache", str(tmp_path / "cache")])
    assert list(out["families"]) == FAMILY_PARTS[part].split(","), out
    for name, result in out["families"].items():
        assert result["refused"] is None and result["compiles"] == 0 and result["misses"] == 0, (name, result)
        assert result["max_abs_error"] < 2e-2, (name, result)
        loss, ref = result["loss"]
        assert abs(loss - ref) < 1e-2 * abs(ref), (name, result)
    assert out["misses"] == 0 and out["refused"] == 0, out


def test_a_drafters_anchor_mask_is_served_by_one_dynamic_graph_at_every_length(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA: the DFlash-style mask over per-step anchors (tests/data/lengths_project) as one dynamic
    graph over 256..1024 (on CPU torch 2.13 this graph fails to compile: tests/data/lengths-anchors.toml); a fresh
    process calls 10 lengths, each with its own anchors: nothing compiles, the outputs are the job's."""
    from test_lengths import ANCHOR_JOB

    data = Path(__file__).parent / "data"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(data / "lengths_project"), os.environ.get("PYTHONPATH", "")]))
    recipe = tmp_path / "anchors.toml"
    text = (data / "lengths-anchors.toml").read_text().replace('device = "cpu"', 'device = "cuda"')
    recipe.write_text(text.replace(", multiple = 256 }", " }") + "\n[compile]\ndynamic = true\n")
    built = build(recipe, tmp_path / "out", jobs=1)
    assert built.artifact is not None and not built.failed
    job = tmp_path / "job.py"
    job.write_text(ANCHOR_JOB)
    cmd = [sys.executable, str(job), str(built.artifact), str(tmp_path / "cache"), "cuda"]
    out = run_json(cmd)
    assert len(set(out["lengths"])) >= 8 and out["compiles"] == 0 and out["missed"] == 0, out
    assert out["max_error"] < 1e-2, out  # float32 inputs, TF32 matmuls
    (served,) = out["served"]
    assert served["dynamic"] and served["calls"] == 10, out


TIER_JOB = """
import json, sys, torch
from torch._dynamo.utils import counters
import kernelpack
from kernelpack import runtime
from kernelpack.artifact import read_manifest
from kernelpack.canonical import call, grad_output, make_inputs
from kernelpack.masks import block_mask_for
runtime.activate(sys.argv[1], cache_dir=sys.argv[2])
frames = counters["frames"]["ok"]
outs = {}
for built in read_manifest(sys.argv[1]).configs:
    c = built.config
    for graph in c.graphs:
        inputs = make_inputs(c, "cuda:0", graph)
        dout = grad_output(inputs[0]) if graph == "fwd+bwd" else None
        out, grads, _ = call(kernelpack.flex_attention, c, graph, inputs, block_mask_for(c, "cuda:0"), dout)
        outs[f"{c.id}-{graph}"] = [out, *grads]
torch.cuda.synchronize()
torch.save(outs, sys.argv[3])
rep = runtime.report().to_dict()
print(json.dumps({"frames": counters["frames"]["ok"] - frames, "tiers": sorted({s["tier"] for s in rep["served"]}),
                  "precompiled": rep["precompiled"], "tier1": rep["inductor_cache_tier"]}))
"""


def test_training_calls_are_served_by_precompiled_functions_bit_for_bit(gpu_artifact: Path, tmp_path: Path) -> None:
    """On CUDA: verify proves every graph is served by its precompiled function with tier 1's outputs; a
    fresh process after activate() makes every config's forward and backward through kernelpack.flex_attention with
    no Dynamo frame, served by tier 2, its outputs and gradients bitwise equal to tier 1's
    (KERNELPACK_PRECOMPILED=0)."""
    import torch

    from kernelpack import precompiled

    if precompiled.unavailable():
        pytest.skip(precompiled.unavailable())
    graphs = sum(len(c.config.graphs) for c in art.read_manifest(gpu_artifact).configs)
    report = verify(gpu_artifact).to_dict()
    assert report["precompiled"] == graphs, report["configs"]
    assert all(t["equal"] for c in report["configs"] for t in c["tiers"].values()), report["configs"]
    runs = {}
    for tier, env in (("2", {}), ("1", {"KERNELPACK_PRECOMPILED": "0"})):
        cmd = [sys.executable, "-c", TIER_JOB, str(gpu_artifact), str(tmp_path / f"c{tier}"), str(tmp_path / tier)]
        runs[tier] = run_json(cmd, env=env)
    assert runs["2"]["frames"] == 0 and runs["2"]["tiers"] == ["precompiled"], runs
    assert runs["2"]["precompiled"] == graphs and runs["2"]["tier1"] == [], runs
    assert runs["1"]["tiers"] == ["inductor-cache"] and runs["1"]["precompiled"] == 0, runs
    ours, theirs = torch.load(tmp_path / "2"), torch.load(tmp_path / "1")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(a, b) for k in ours for a, b in zip(ours[k], theirs[k], strict=True))


def test_the_drafter_job_trains_in_threads_at_every_context_length_with_no_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA: the DFlash-shaped drafter job (tests/data/record_project/drafter_job.py), training with
    reentrant checkpointing, recorded with no option (the fwd and fwd+bwd graphs of the sliding and the full mask),
    built, then trained by 3 threads at context lengths it never recorded: nothing compiles, misses, is refused or
    runs dense, and every graph is served."""
    from kernelpack.cli import main

    project = Path(__file__).parent / "data" / "record_project"
    monkeypatch.chdir(project)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(project), os.environ.get("PYTHONPATH", "")]))
    size = ["--device", "cuda", "--train", "--size", "256,8,2,64,64,16,256", "--context", "300:1500"]
    job = [sys.executable, "drafter_job.py", *size]
    recipe = tmp_path / "drafter.toml"
    assert main(["record", "-o", str(recipe), "--", *job, "--threads", "2", "--steps", "3"]) == 0
    text = recipe.read_text()
    assert text.count("[[calls]]") == 2 and text.count('graphs = ["fwd", "fwd+bwd"]') == 2, text
    built = build(recipe, tmp_path / "out", jobs=2)
    assert built.artifact is not None and not built.failed
    run = [*job, "--artifact", str(built.artifact), "--cache", str(tmp_path / "cache")]
    out = run_json([*run, "--threads", "3", "--steps", "6", "--seed", "5"])
    assert (out["errors"], out["missed"], out["refused"], out["compiled"], out["dense"]) == ([], 0, [], 0, 0), out
    assert out["frames_compiled"] == 0 and out["served"], out


ROWS_SAFE = r"""
import json, sys
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from kernelpack.masks import first_tile_gaps, sliding_window

out = {}
flex = torch.compile(flex_attention)
for window, block_n in [(200, 32), (200, 64), (4096, 32), (300, 64)]:
    n = 1024
    mask = sliding_window(window)
    bm = create_block_mask(mask, None, None, n, n, device="cuda")
    q, k, v = (torch.randn(1, 2, n, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    options = {"ROWS_GUARANTEED_SAFE": True, "BLOCK_M": 64, "BLOCK_N": block_n}
    o = flex(q, k, v, block_mask=bm, kernel_options=options)
    nan_rows = sorted(set(torch.isnan(o).any(-1).nonzero()[:, 2].tolist()))
    safe = flex(q, k, v, block_mask=bm)  # flex's default: the guard kept
    gaps = sorted({g["row"] for g in first_tile_gaps(bm, block_n, limit=None)})
    out[f"{window}/{block_n}"] = {"nan_rows": nan_rows, "gaps": gaps, "default_nan": bool(torch.isnan(safe).any())}
print(json.dumps(out))
"""


def test_rows_guaranteed_safe_turns_exactly_the_rows_first_tile_gaps_finds_into_nan(tmp_path: Path) -> None:
    """Against flex's real Triton kernel: with ROWS_GUARANTEED_SAFE and a fixed BLOCK_N, the rows the
    compiled forward returns as NaN are the rows first_tile_gaps(bm, BLOCK_N) names: none for a window wider than the
    sequence (causal), some for sliding windows, and fewer with a wider tile. flex's default is never NaN. The build
    refuses such a config by that check (tests/test_workload.py), before compiling."""
    out = run_json([sys.executable, "-c", ROWS_SAFE], timeout=900)
    for case, r in out.items():
        assert r["nan_rows"] == r["gaps"], (case, r["nan_rows"][:8], r["gaps"][:8])
        assert not r["default_nan"], case
    assert not out["4096/32"]["gaps"] and out["200/32"]["gaps"] and out["300/64"]["gaps"], out
    assert set(out["200/64"]["gaps"]) < set(out["200/32"]["gaps"]), out
