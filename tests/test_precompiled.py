"""Tier 2's mechanism on CPU torch: aot_compile of the canonical forward, its bytes,
loaded again in a fresh process with the tier-1 cache, bitwise equal and with no Dynamo frame."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_json

from kernelpack import precompiled
from kernelpack.manifest import PRECOMPILED_DIR

SCRIPT = """
import json, sys, threading, time, torch
from torch._dynamo.utils import counters
from kernelpack import precompiled
from kernelpack.manifest import PRECOMPILED_DIR
from kernelpack.canonical import arguments, make_inputs
from kernelpack.masks import block_mask_for
from kernelpack.recipe import load_recipe
torch.set_num_threads(2)  # the builder's count, whatever this machine has
config = load_recipe(sys.argv[1]).configs[0]
inputs = make_inputs(config, "cpu", "fwd")
args = arguments(config, inputs, block_mask_for(config, "cpu"))
with torch.no_grad():
    ref = torch.compile(torch.nn.attention.flex_attention.flex_attention, dynamic=False)(**args)
if sys.argv[2] == "save":
    fn = precompiled.compile_call(args, grad=False)
    open(sys.argv[3], "wb").write(precompiled.dumps(fn))
    torch.save(ref, sys.argv[3] + ".ref")
elif sys.argv[2] == "threads":  # a job with another CPU thread count (torchrun's OMP_NUM_THREADS=1)
    torch.set_num_threads(1)
    blob = open(sys.argv[3], "rb").read()
    kept = precompiled.Loaded(precompiled.loads(blob), "cpu")
    followed = precompiled.Loaded(precompiled.loads(blob), "cuda")
    with torch.no_grad():
        out = {"kept": kept.serves(args), "why": kept.guard_failure(args), "followed": followed.serves(args),
               "equal": bool(torch.equal(followed(args), torch.load(sys.argv[3] + ".ref")))}
        torch.set_num_threads(3)  # the job changes it after the load
        out["after_change"] = followed.serves(args)
        torch.set_num_threads(2)  # and back to the builder's
        out["back"] = followed.serves(args)
        # loaded at the builder's count: torch's own manager serves, and its saved guards are not unpickled again
        fresh = precompiled.Loaded(precompiled.loads(blob), "cuda")
        out["at_builder_count"] = fresh.serves(args) and fresh._state is None
        # loaded at the job's count (1, not the builder's 2): torch's own manager is built for it, from the one
        # unpickle of the load; the builder's count gets a manager from the same saved guards
        from torch._dynamo import package
        unpickled = []
        def counted(*a, _theirs=package.load_guards_state, **k):
            unpickled.append(1)
            return _theirs(*a, **k)
        package.load_guards_state = counted  # under kernelpack's wrapper, which from_bytes installs once
        torch.set_num_threads(1)
        at_job = precompiled.Loaded.from_bytes(blob, "cuda")
        own = at_job._fn._artifacts.guard_manager
        out["at_job_count"] = {"serves": at_job.serves(args), "own_checks": bool(own.check(at_job._f_locals(args))),
                               "managers": sorted(at_job._managers), "unpickled": len(unpickled)}
        torch.set_num_threads(2)
        out["at_job_count"].update(builder=at_job.serves(args), managers_after=sorted(at_job._managers),
                                   unpickled_after=len(unpickled))
        torch.set_num_threads(1)
        # any other load, after the wrapper: torch's own manager as saved (the builder's count), as before
        plain = precompiled.loads(blob)
        out["plain_load_fails_at_1"] = not plain.guard_check(**args)
        # the frame locals the guards read, bound without inspect (Loaded._f_locals): torch's own, object for object
        ours, theirs = followed._f_locals(args), followed._fn.prepare_f_locals(**args)
        out["binds_as_torch"] = followed._bind is not None and ours.keys() == theirs.keys() and all(
            ours[k] is theirs[k] for k in theirs)
        refused = []
        def thread(count):  # torch's thread count is per thread: each keeps its own, at once with the other
            torch.set_num_threads(count)
            with torch.no_grad():
                refused.extend(count for _ in range(200) if not followed.serves(args))
        workers = [threading.Thread(target=thread, args=(n,)) for n in (1, 3)]
        [t.start() for t in workers]
        [t.join() for t in workers]
        out["refused_in_threads"] = refused
        args["query"] = args["query"][:, :, :-1]  # another shape: the rest of the guards still refuse
        out["other_shape"] = followed.serves(args)
    print(json.dumps(out))
else:
    frames = counters["frames"]["ok"]
    t = time.perf_counter()
    fn = precompiled.loads(open(sys.argv[3], "rb").read())
    with torch.no_grad():
        out = fn(**args)
    print(json.dumps({"seconds": time.perf_counter() - t, "frames": counters["frames"]["ok"] - frames,
                      "equal": bool(torch.equal(out, torch.load(sys.argv[3] + ".ref")))}))
"""


@pytest.mark.skipif(precompiled.unavailable() is not None, reason="no aot_compile in this torch")
def test_a_precompiled_forward_loads_in_a_fresh_process_and_runs_without_dynamo(tmp_path: Path) -> None:
    recipe = Path(__file__).parent.parent / "recipes" / "smoke-cpu.toml"
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    root = str(Path(__file__).parent.parent)  # this checkout's kernelpack, whatever is installed
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": root}
    blob = tmp_path / "fn.bin"

    def run(mode: str) -> dict:
        return run_json([sys.executable, str(script), str(recipe), mode, str(blob)], env=env)

    save = [sys.executable, str(script), str(recipe), "save", str(blob)]
    subprocess.run(save, env={**os.environ, **env}, check=True, timeout=600)
    out = run("load")
    assert out["equal"] and out["frames"] == 0, out
    # torchrun's workers run with OMP_NUM_THREADS=1, a builder with its core count. A CUDA function follows
    # the job's thread count (its kernels do not depend on it); a CPU one keeps torch's guard on it
    out = run("threads")
    assert not out["kept"] and "num_threads" in out["why"], out
    assert out["followed"] and out["equal"] and out["after_change"] and out["back"] and out["binds_as_torch"], out
    assert out["at_builder_count"], out
    at_job = out["at_job_count"]
    assert at_job["serves"] and at_job["own_checks"] and at_job["managers"] == [1], out
    assert at_job["unpickled"] == 1 and at_job["unpickled_after"] == 1, out  # one unpickle: the load's own
    assert at_job["builder"] and at_job["managers_after"] == [1, 2], out
    assert out["plain_load_fails_at_1"], out
    assert out["refused_in_threads"] == [], out
    assert not out["other_shape"], out


# ------------------------------------------------------------------------------------------------ the runtime

JOB = """
import json, sys, threading, torch
from torch._dynamo.utils import counters
import kernelpack
from kernelpack import masks, runtime
from kernelpack.errors import KernelpackError
runtime.activate(sys.argv[1], cache_dir=sys.argv[2]).wait()  # the frames counted below are the job's, not the start's

def own_window(w):  # the user's own mask: what masks.sliding_window(w) computes, another function
    def mine(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < w)
    return mine

def other_code(w):  # the same closure layout, other code: torch's guards (no identity guards) would let it through
    def every_other(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < w) & (kv_idx % 2 == 0)
    return every_other

gen = torch.Generator().manual_seed(0)
def qkv():
    return tuple(torch.randn(1, 2, 256, 64, generator=gen) for _ in range(3))

def call(mask, inputs):
    return kernelpack.flex_attention(*inputs, block_mask=masks.block_mask(mask, 256, 256, "cpu"))

frames = counters["frames"]["ok"]
outputs = {}
inputs = qkv()
for w in (64, 128):
    outputs[f"builtin-{w}"] = call(masks.sliding_window(w), inputs)
outputs["own-64"] = call(own_window(64), inputs)
try:
    call(other_code(64), inputs)
    other = "served"
except KernelpackError as e:
    other = type(e).__name__
impostor = other_code(64)  # tagged as the built-in: the signature trusts the tag, kernelpack's code check does not
impostor.kernelpack_mask = "sliding_window(64)"
try:
    call(impostor, inputs)
    tagged = "served"
except KernelpackError as e:
    tagged = f"{type(e).__name__}: {e}"
batches = [qkv() for _ in range(8)]
serial = [call(masks.sliding_window(64), b) for b in batches]
threaded = [None] * len(batches)
def worker(i):
    for _ in range(5):
        threaded[i] = call(own_window(64) if i % 2 else masks.sliding_window(64), batches[i])
threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(batches))]
for t in threads: t.start()
for t in threads: t.join()
torch.save(outputs, sys.argv[3])
report = runtime.report().to_dict()
print(json.dumps({
    "frames": counters["frames"]["ok"] - frames,
    "other_code": other,
    "tagged_other_code": tagged,
    "threads_equal": all(torch.equal(a, b) for a, b in zip(serial, threaded)),
    "served": [(s["graph"], s["tier"], s["calls"]) for s in report["served"]],
    "inductor_cache_tier": report["inductor_cache_tier"],
    "first_calls": [(c["call"], c["tier"], c["compiled"]) for c in report["first_calls"]],
    "refused": [r["why"] for r in report["refused"]],
}))
"""


def _job(artifact: Path, cache: Path, out: Path, **env: str) -> dict:
    root = str(Path(__file__).parent.parent)
    return run_json([sys.executable, "-c", JOB, str(artifact), str(cache), str(out)], env={"PYTHONPATH": root, **env})


def _tiers(result: dict) -> dict[str, str]:
    return {graph: tier for graph, tier, _ in result["served"]}


@pytest.mark.skipif(precompiled.unavailable() is not None, reason="no aot_compile in this torch")
def test_covered_calls_are_served_by_precompiled_functions_without_dynamo(smoke_artifact: Path, tmp_path: Path) -> None:
    """A fresh process: activate() loads every graph's precompiled function; kernelpack.flex_attention serves both
    configs, the user's own mask of the same graph and 8 threads at once through them with no Dynamo frame, with
    tier 1's outputs bit for bit (KERNELPACK_PRECOMPILED=0); a mask with the same closure layout but other code,
    which torch's own guards would let through, is refused: untagged by its signature, tagged as the built-in by
    kernelpack's code check."""
    import torch

    tier2 = _job(smoke_artifact, tmp_path / "c2", tmp_path / "o2.pt")
    tier1 = _job(smoke_artifact, tmp_path / "c1", tmp_path / "o1.pt", KERNELPACK_PRECOMPILED="0")
    # 2 configs, the user's own mask, then 8 threads x 5 calls on top of 8 serial ones
    assert sum(calls for _, _, calls in tier2["served"]) == 2 + 1 + 8 + 40, tier2
    assert set(_tiers(tier2).values()) == {"precompiled"} and len(tier2["served"]) == 2, tier2
    assert [t for _, t, _ in tier2["first_calls"]] == ["precompiled", "precompiled"], tier2
    assert tier2["frames"] == 0 and tier2["inductor_cache_tier"] == [] and tier2["threads_equal"], tier2
    assert tier2["other_code"] == "NotPrecompiledError", tier2
    assert tier2["tagged_other_code"].startswith("NotWarmedError") and "runs other code" in tier2["tagged_other_code"]
    assert set(_tiers(tier1).values()) == {"inductor-cache"}, tier1
    assert {x["why"] for x in tier1["inductor_cache_tier"]} == {"KERNELPACK_PRECOMPILED=0"}, tier1
    ours, theirs = torch.load(tmp_path / "o2.pt"), torch.load(tmp_path / "o1.pt")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


LATE_IMPORT = """
import json, sys, torch
import transformers  # a job's first import
import kernelpack
from kernelpack import masks, runtime
from kernelpack.errors import KernelpackError
runtime.activate(sys.argv[1], cache_dir=sys.argv[2])
nodes = [len(torch.utils._pytree.SUPPORTED_NODES)]
from transformers import Gemma3ForCausalLM  # the model's class after activate(): its output classes are pytree nodes
nodes.append(len(torch.utils._pytree.SUPPORTED_NODES))
q, k, v = (torch.randn(1, 2, 256, 64) for _ in range(3))
try:
    for w in (64, 128):
        kernelpack.flex_attention(q, k, v, block_mask=masks.block_mask(masks.sliding_window(w), 256, 256, "cpu"))
    result = "served"
except KernelpackError as e:
    result = str(e)
report = runtime.report().to_dict()
print(json.dumps({"nodes": nodes, "result": result, "tiers": sorted({s["tier"] for s in report["served"]}),
                  "compiles": [r["path"] for r in report["compiles"]]}))
"""


@pytest.mark.skipif(precompiled.unavailable() is not None, reason="no aot_compile in this torch")
@pytest.mark.parametrize("tier", ["precompiled", "inductor-cache"])
def test_a_model_class_imported_after_activate_leaves_both_tiers_serving(
    tier: str, smoke_artifact: Path, tmp_path: Path
) -> None:
    """A job's imports in their natural order: transformers, activate(), then the model's class, whose module
    registers its output classes as pytree nodes. Dynamo guards a traced graph on the registry's length, and a
    precompiled function kept the builder's: both tiers refused every call (torch 2.13, Gemma3). kernelpack's graphs
    drop those guards (kernelpack._torch.dynamo.guard_filter): both serve, compiling nothing after the warm-up."""
    env = {"PYTHONPATH": str(Path(__file__).parent.parent)}
    if tier == "inductor-cache":
        env["KERNELPACK_PRECOMPILED"] = "0"
    out = run_json([sys.executable, "-c", LATE_IMPORT, str(smoke_artifact), str(tmp_path / "cache")], env=env)
    assert out["nodes"][1] > out["nodes"][0], out  # the import did register node types
    assert out["result"] == "served" and out["tiers"] == [tier], out
    assert set(out["compiles"]) <= {"kernelpack warm-up", "kernelpack load"}, out


@pytest.mark.skipif(precompiled.unavailable() is not None, reason="no aot_compile in this torch")
def test_a_precompiled_function_that_fails_to_load_falls_back_to_the_inductor_cache(
    smoke_artifact: Path, tmp_path: Path
) -> None:
    """One installed function swapped for other bytes of the same size after the install (what a planted file or a
    rebuilt artifact's function at the same path would be): activate() refuses to unpickle it, saying its sha256 is
    not the manifest's; the inductor cache serves that config (warmed in its place, nothing compiled), the other
    stays precompiled, and the outputs are unchanged."""
    import torch

    cache = tmp_path / "cache"
    first = _job(smoke_artifact, cache, tmp_path / "o1.pt")
    (damaged, *_) = sorted((cache / PRECOMPILED_DIR).glob("*.bin"))
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: the install marker's size check passes
    damaged.write_bytes(bytes(data))
    second = _job(smoke_artifact, cache, tmp_path / "o2.pt")
    (why,) = second["inductor_cache_tier"]
    assert "failed to load or run: PrecompiledMismatch" in why["why"] and "not the manifest's" in why["why"], second
    assert sorted(_tiers(second).values()) == ["inductor-cache", "precompiled"], second
    assert why["call"] in _tiers(second) and _tiers(second)[why["call"]] == "inductor-cache", second
    assert all(not compiled for _, _, compiled in second["first_calls"]), second
    assert second["frames"] == 0 and second["other_code"] == "NotPrecompiledError", second
    ours, theirs = torch.load(tmp_path / "o2.pt"), torch.load(tmp_path / "o1.pt")
    assert all(torch.equal(ours[k], theirs[k]) for k in ours) and first["threads_equal"] and second["threads_equal"]


WINDOW = 64


def test_a_function_that_reads_a_global_value_is_left_to_tier_1() -> None:
    """torch drops guards on globals from a saved function: a mask reading WINDOW would keep the builder's value.
    Modules, functions and builtins are not values; closures are followed, and_masks' tuple too."""
    import torch
    from torch.nn.attention.flex_attention import and_masks

    from kernelpack import masks

    def reads_window(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return q_idx - kv_idx < WINDOW

    def uses_torch(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return torch.where(q_idx >= kv_idx, True, False)

    assert precompiled.reads_globals(reads_window) == "WINDOW=64"
    assert precompiled.reads_globals(and_masks(uses_torch, reads_window)) == "WINDOW=64"
    assert precompiled.reads_globals(masks.padded(and_masks(uses_torch, reads_window), 3)) == "WINDOW=64"
    assert precompiled.reads_globals(uses_torch) is None
    assert precompiled.reads_globals(masks.padded(masks.sliding_window(64), 10)) is None


@pytest.mark.skipif(precompiled.unavailable() is not None, reason="no aot_compile in this torch")
def test_verify_proves_which_tier_serves_each_graph(smoke_artifact: Path, tmp_path: Path) -> None:
    """verify loads and calls every precompiled function first in its fresh process: both smoke configs are served
    by tier 2 with tier 1's outputs bit for bit; an artifact whose function is damaged (hashed as damaged, so it
    installs) fails verify, naming the config's failed load."""
    from kernelpack import artifact as art
    from kernelpack import manifest as mf
    from kernelpack.errors import VerifyError
    from kernelpack.verify import verify_artifact

    data = verify_artifact(smoke_artifact).to_dict()
    assert data["precompiled"] == 2, data["configs"]
    assert all(t["tier"] == "precompiled" and t["equal"] for c in data["configs"] for t in c["tiers"].values())
    tree = tmp_path / "tree"
    manifest = art.unpack(smoke_artifact, tree).to_dict()
    (victim, *_) = sorted((tree / PRECOMPILED_DIR).glob("*.bin"))
    # damaged, and named and listed as what it now is: a consistent artifact whose function cannot load
    blob = victim.read_bytes()[:100]
    sha = hashlib.sha256(blob).hexdigest()
    victim.unlink()
    renamed = victim.with_name(victim.name.rsplit("-", 1)[0] + f"-{sha[:32]}.bin")
    renamed.write_bytes(blob)
    for c in manifest["configs"]:
        for entry in c.get("precompiled", []):
            if entry["path"].endswith(victim.name):
                entry.update(path=f"{PRECOMPILED_DIR}/{renamed.name}", sha256=sha)
    files = art.scan_tree(tree)
    manifest["files"] = [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in art.hash_files(files)]
    manifest.pop("parts")  # a renamed file: the packer makes the parts
    damaged = tmp_path / "damaged.kpack"
    art.pack(damaged, mf.Manifest.from_dict(manifest, source=str(damaged)), files)
    with pytest.raises(VerifyError, match="1 of 2 config") as e:
        verify_artifact(damaged)
    assert e.value.failed == [victim.name.split("-")[0]] and "precompiled fwd: failed: " in str(e.value), e.value


REBUILT_MASK = """
def factory(config):
    def rebuilt_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < {window})

    return rebuilt_mask
"""

REBUILT_RECIPE = """
name = "rebuilt"
device = "cpu"
mask = "rebuilt_mask:factory"

[matrix]
q_heads = 1
kv_heads = 1
seq_len = [128]
head_dim = 16
dtypes = ["float32"]
graphs = ["fwd"]
"""

REBUILT_JOB = """
import json, sys, torch
from kernelpack import runtime
from kernelpack.recipe import load_recipe
from kernelpack.masks import block_mask_for
from kernelpack.canonical import make_inputs
from kernelpack.workload import reference_attention
import kernelpack
activation = runtime.activate(sys.argv[1], cache_dir=sys.argv[2])
config = activation.install.manifest.configs[0].config
bm = block_mask_for(config, "cpu")  # the job's mask: the factory's code on disk now
q, k, v = make_inputs(config, "cpu", "fwd")
out = kernelpack.flex_attention(q, k, v, block_mask=bm)
ref = reference_attention(config, q, k, v, None)[0].float()  # the mask's math, without flex
served = sorted({s["tier"] for s in runtime.report().to_dict()["served"]})
print(json.dumps({"id": config.id, "error": float((out - ref).abs().max()), "served": served}))
"""


@pytest.mark.skipif(precompiled.unavailable() is not None, reason="no aot_compile in this torch")
def test_a_built_function_is_named_by_the_hash_of_its_bytes(smoke_artifact: Path, tmp_path: Path) -> None:
    """What keeps a rebuilt artifact's function off an older build's path (the slow test below proves it with a
    rebuild): in a built artifact, every precompiled function's path ends in its bytes' sha256, and the file there
    hashes to it."""
    from kernelpack import artifact as art

    manifest = art.unpack(smoke_artifact, tmp_path / "tree")
    functions = [(c, p) for c in manifest.configs for p in c.precompiled]
    assert functions, "the smoke artifact holds no precompiled function"
    for c, p in functions:
        assert p.path == precompiled.file_name(c.id, p.device, p.graph, p.sha256), p.path
        assert p.path.endswith(f"-{p.sha256[:32]}.bin"), p.path  # the content, not only the config, names it
        assert hashlib.sha256((tmp_path / "tree" / p.path).read_bytes()).hexdigest() == p.sha256, p.path


# once: file names by content are kernelpack's. slow: two builds and two jobs, about 40 s; the README's test command
# keeps the naming itself (the test above)
@pytest.mark.once
@pytest.mark.slow
@pytest.mark.skipif(precompiled.unavailable() is not None, reason="no aot_compile in this torch")
def test_a_rebuilt_artifact_in_a_shared_cache_dir_runs_its_own_mask_not_the_previous_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recipe whose mask factory changed, rebuilt and installed into the cache dir the first build was
    installed into (torch's default cache dir is one per user). The config id is the same (it names the factory,
    not its code); its precompiled function is named by its content, so it is installed beside the old one instead
    of being kept out by it, and the job computes the new mask. Against the old naming the job got the old mask
    (max error 1.6 against the new reference)."""
    from kernelpack.build import build_recipe

    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.syspath_prepend(str(project))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(project), str(Path(__file__).parent.parent)]))
    recipe = tmp_path / "rebuilt.toml"
    recipe.write_text(REBUILT_RECIPE)
    artifacts = []
    for window in (8, 64):
        (project / "rebuilt_mask.py").write_text(REBUILT_MASK.format(window=window))
        built = build_recipe(recipe, tmp_path / f"out-{window}", jobs=1)
        assert built.artifact is not None and not built.failed
        artifacts.append(built.artifact)
    cache = tmp_path / "cache"
    (project / "rebuilt_mask.py").write_text(REBUILT_MASK.format(window=8))
    old = run_json([sys.executable, "-c", REBUILT_JOB, str(artifacts[0]), str(cache)])
    (project / "rebuilt_mask.py").write_text(REBUILT_MASK.format(window=64))
    new = run_json([sys.executable, "-c", REBUILT_JOB, str(artifacts[1]), str(cache)])
    assert old["id"] == new["id"], (old, new)  # one config id, two mask codes: the case that collided
    assert old["served"] == new["served"] == ["precompiled"], (old, new)
    assert old["error"] < 1e-5 and new["error"] < 1e-5, (old, new)


LAZY = """
import json, sys, threading, torch
from torch._dynamo.utils import counters
import kernelpack
from kernelpack import masks, runtime
torch.set_num_threads(2)
gen = torch.Generator().manual_seed(0)
inputs = tuple(torch.randn(1, 2, 256, 64, generator=gen) for _ in range(3))
from torch.nn.attention.flex_attention import flex_attention
eager = {w: flex_attention(  # the reference, before activate() refuses it
    *inputs, block_mask=masks.block_mask(masks.sliding_window(w), 256, 256, "cpu")) for w in (64, 128)}
activation = runtime.activate(sys.argv[1], cache_dir=sys.argv[2])
at_activate = [(c.tier, c.warmup) for c in runtime.report().first_calls]
swapped = None
if sys.argv[3] == "swap":  # a function not loaded yet, swapped for other bytes after activate(), before its first call
    sig, built = next(iter(activation.warmup.lazy.items()))
    swapped = built.config.window
    # its files installed (as another worker of the node may have done), then its function swapped on disk
    activation.installing.ensure(kernelpack.manifest.owner(built.id, sig.device_index or 0))
    path = activation.install.cache_dir + "/" + built.precompiled_for(sig.device_index or 0, sig.graph).path
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
frames = counters["frames"]["ok"]
results = {}
def call(i, w):
    try:
        out = kernelpack.flex_attention(*inputs, block_mask=masks.block_mask(masks.sliding_window(w), 256, 256, "cpu"))
        results[f"{i}-{w}"] = out
    except Exception as e:
        results[f"{i}-{w}"] = f"{type(e).__name__}: {e}"
threads = [threading.Thread(target=call, args=(i, w)) for i in range(3) for w in (64, 128)]  # first calls at once
for t in threads: t.start()
for t in threads: t.join()
report = runtime.report().to_dict()
print(json.dumps({
    "at_activate": at_activate,
    "swapped": swapped,
    "frames": counters["frames"]["ok"] - frames,
    "results": {k: v if isinstance(v, str) else bool(torch.allclose(v, eager[int(k.split("-")[1])], atol=1e-5))
                for k, v in results.items()},
    "first_calls": [(c["tier"], c["warmup"], c["thread"]) for c in report["first_calls"]],
    "served": sorted((s["tier"], s["calls"]) for s in report["served"]),
}))
"""


@pytest.mark.skipif(precompiled.unavailable() is not None, reason="no aot_compile in this torch")
def test_lazily_loaded_functions_load_at_their_first_call_in_any_thread_and_are_hashed_first(
    smoke_artifact: Path, tmp_path: Path
) -> None:
    """KERNELPACK_LOAD=lazy: activate() loads one of the two configs' functions; the other loads at its
    first call, made by 3 threads at once: each call served by tier 2 with eager flex's outputs, one load, no Dynamo
    frame. A function swapped in the cache after activate() and before its first call is refused at that call,
    naming its sha256 (the pinned install's guarantee holds for lazy loads): never unpickled, never a compile."""
    root = str(Path(__file__).parent.parent)
    env = {"PYTHONPATH": root, "KERNELPACK_LOAD": "lazy"}
    run = [sys.executable, "-c", LAZY, str(smoke_artifact), str(tmp_path / "cache")]
    good = run_json([*run, "-"], env=env)
    assert good["at_activate"] == [["precompiled", True]], good
    assert good["frames"] == 0 and set(good["results"].values()) == {True}, good
    (later,) = [c for c in good["first_calls"] if not c[1]]
    assert later[0] == "precompiled" and later[2] != "MainThread", good  # loaded in one of the job's threads
    assert good["served"] == [["precompiled", 3], ["precompiled", 3]], good
    bad = run_json([*run[:-1], str(tmp_path / "fresh"), "swap"], env=env)
    refused = {k: v for k, v in bad["results"].items() if v is not True}
    assert sorted(refused) == [f"{i}-{bad['swapped']}" for i in range(3)] and bad["frames"] == 0, bad
    for why in refused.values():
        assert "NotWarmedError" in why and "PrecompiledMismatch" in why and "not the manifest's" in why, why
