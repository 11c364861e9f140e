"""A mask is keyed as torch keys it. One walker answers "is this the same function?"
(:mod:`kernelpack.functions`); the closure values a dynamic graph keeps symbolic (a DFlash-shaped mask's context
length) enter its key by type, as Dynamo's own guards say; tensors it closes over are inputs (by shape and dtype);
record writes one config per graph-selecting variant with the lengths as a dynamic range; the job is served at every
context length with nothing compiled; a refusal names the one field that differs. CPU, real torch.compile."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import run_json

from kernelpack import canonical, closures, functions
from kernelpack.cli import main
from kernelpack.errors import KernelpackError, RecordError
from kernelpack.recipe import parse_recipe, tomllib
from kernelpack.recipe_writer import Lengths
from kernelpack.record import recording
from kernelpack.signature import mask_key, mask_keys

PROJECT = Path(__file__).parent / "data" / "record_project"
sys.path.insert(0, str(PROJECT))
import drafter  # noqa: E402  (the user's module, importable as the builder will import it)


def _mask(context: int, window: int | None = 128, blocks: int = 16, dtype: Any = None) -> Any:
    import torch

    anchors = torch.randint(0, context, (1, blocks))
    return drafter.anchored_mask(anchors, torch.ones(1, blocks, dtype=dtype or torch.bool), context, 16, window)


# ------------------------------------------------------------------------------------------------ one walker


def test_one_tree_names_every_value_by_path_and_by_dynamos_source() -> None:
    nodes = {n.path: n for n in functions.tree(_mask(300)).walk()}
    assert {p: n.kind for p, n in nodes.items()} == {
        "": "function",
        "anchors": "tensor",
        "block": "scalar",
        "blocks": "scalar",
        "context": "scalar",
        "keep": "tensor",
        "window": "scalar",
    }
    # closure cells in co_freevars order (alphabetical), as Dynamo names them below the function
    assert nodes["context"].source == ".__closure__[3].cell_contents"
    composed = _composed(lambda b, h, q, kv: q >= kv, 7)
    paths = [n.path for n in functions.tree(composed).walk()]
    assert paths == ["", "inner", "parts", "parts[0]", "parts[1]", "parts[1].w"], paths


def _composed(first: Any, w: int) -> Any:
    def window(b, h, q, kv):
        return q - kv < w

    parts = (first, window)

    def both(b, h, q, kv):
        return parts[0](b, h, q, kv) & parts[1](b, h, q, kv) & inner

    inner = True
    return both


def test_a_key_holds_code_and_values_and_free_values_by_type_only() -> None:
    import torch

    a, b = _mask(300), _mask(700)  # other context, other anchor values
    assert mask_key(a) != mask_key(b)  # a static graph is keyed by every value
    free = ("context", "anchors.shape[1]", "keep.shape[1]")
    assert mask_key(a, free) == mask_key(b, free)  # the anchors' values never enter: they are data
    assert mask_key(a, free) != mask_key(_mask(300, window=None), free)  # None vs int selects code
    assert mask_key(a, free) != mask_key(_mask(300, dtype=torch.int32), free)  # a tensor's dtype enters
    assert mask_key(a, ("context",)) != mask_key(_mask(300, blocks=8), ("context",))  # its shape too, unless free
    assert mask_key(a, (*free, "blocks")) == mask_key(_mask(300, blocks=8), (*free, "blocks"))
    assert functions.same(a, b, values=False) and not functions.same(a, b, values=True)
    assert functions.differences(a, _mask(300, window=None)) == [("window", "128", "None")]
    assert functions.differences(a, _composed(lambda *x: x, 1))[0][0] == "code"


def test_one_walk_keys_a_mask_for_every_free_set_and_gives_its_code_shape() -> None:
    """What a served call computes of a mask it has not seen (a DFlash mask is rebuilt every step): its key by every
    value and by each free set from one walk, equal to one walk per set; and the one value that says whether it runs
    a warmed function's code."""
    a = _mask(300)
    frees = [(), ("context",), ("context", "anchors.shape[1]", "keep.shape[1]"), ("anchors.shape",), ("window",)]
    assert functions.each_key(a, frees) == [functions.key(a, f) for f in frees]
    assert len(set(functions.each_key(a, frees))) == len(frees)  # each set names other values free
    composed = _composed(lambda b, h, q, kv: q >= kv, 7)
    assert functions.each_key(composed, [(), ("parts[1].w",)]) == [
        functions.key(composed),
        functions.key(composed, ("parts[1].w",)),
    ]
    # a closure value whose name starts like a tensor's dimension ("inner.shape_y") is its own path
    nested = _nested_shape_name()
    assert [p for p in (n.path for n in functions.tree(nested).walk())] == ["", "inner", "inner.shape_y"]
    nested_frees = [(), ("inner.shape_y",)]
    assert functions.each_key(nested, nested_frees) == [functions.key(nested, f) for f in nested_frees]
    assert functions.key(nested) != functions.key(nested, ("inner.shape_y",))
    # mask_keys: the same keys, and remembered per function object
    assert mask_keys(a, frees) == [mask_key(a, f) for f in frees]
    # the code shape: the same code with other values (another length, None for an int) is the same shape ...
    assert functions.code_shape(a) == functions.code_shape(_mask(700)) == functions.code_shape(_mask(9, window=None))
    assert functions.same(a, _mask(700), values=False)
    first = lambda b, h, q, kv: q >= kv  # noqa: E731
    assert functions.code_shape(_composed(first, 7)) == functions.code_shape(_composed(first, 9))
    # ... other code is not: another function in the tree, another object it calls, another tree
    assert functions.code_shape(_composed(first, 7)) != functions.code_shape(_composed(lambda b, h, q, kv: q >= kv, 7))
    assert not functions.same(_composed(first, 7), _composed(lambda b, h, q, kv: q >= kv, 7), values=False)
    assert functions.code_shape(_calls(max)) != functions.code_shape(_calls(min))
    assert functions.code_shape(_calls(max)) == functions.code_shape(_calls(max))
    assert functions.code_shape(a) == functions.code_shape(_mask(300, blocks=8))  # a tensor's shape: its guards'
    assert functions.code_shape(a) != functions.code_shape(composed)


def _nested_shape_name() -> Any:
    shape_y = 3

    def inner(b, h, q, kv):
        return q - kv < shape_y

    def outer(b, h, q, kv):
        return inner(b, h, q, kv)

    return outer


def _calls(op: Any) -> Any:
    def mask(b, h, q, kv):
        return op(q, kv) >= 0

    return mask


# ------------------------------------------------------------------------------------------------ Dynamo's guards


def test_dynamos_guards_say_which_closure_values_a_dynamic_graph_keeps_free() -> None:
    """Traced by Dynamo itself (the eager backend: the guards are Dynamo's, whatever compiles the graph): the
    context and the window are symbolic (type guards only), a None is pinned, a tensor's batch dim of 1 is pinned
    and its anchor count dim is free; a flag in Python control flow is free too (a relation guard, which Dynamo
    runs at every call). In a fresh process: after the runtime's tests in one process, torch 2.11's Dynamo
    segfaulted in FakeTensorMode on this trace (CI, .ci/other-torch)."""
    out = run_json([sys.executable, __file__, "guards_free_values"])
    expected = ["anchors.shape[1]", "block", "blocks", "context", "keep.shape[1]"]
    assert out == {"64": sorted([*expected, "window"]), "None": expected}, out


def _guards_free_values() -> dict[str, list[str]]:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from kernelpack._torch.dynamo import cache_entries, entry_guards, free_values

    compiled = torch.compile(flex_attention, dynamic=True, backend="eager")
    out = {}
    for window in (64, None):
        mask = _mask(256, window=window, blocks=8)
        bm = create_block_mask(mask, 1, None, 128, 384, device="cpu")
        q, kv = torch.randn(1, 2, 128, 16), torch.randn(1, 2, 384, 16)
        compiled(q, kv, kv.clone(), block_mask=bm)
        entry = cache_entries(flex_attention.__code__)[0]
        values = {
            n.path: (n.source, "tensor" if n.kind == "tensor" else "scalar")
            for n in functions.tree(mask).walk()
            if n.kind in ("scalar", "tensor", "none")
        }
        out[str(window)] = sorted(free_values(entry_guards(entry), "L['block_mask'].mask_mod", values))
    return out


# ------------------------------------------------------------------------------------------------ expressions


def test_dimension_expressions_evaluate_and_an_unreadable_one_is_named() -> None:
    dims = {"batch": 2, "q_heads": 4, "kv_heads": 2, "q_len": 8192, "kv_len": 11000, "head_dim": 128}
    assert closures.evaluate("kv_len - q_len", dims) == 2808 and closures.evaluate("q_len // 16", dims) == 512
    assert closures.dim_expressions(512, dims)[0] == "q_len // 16"  # lengths before head counts
    assert closures.dim_expressions(2808, dims) == ["kv_len - q_len"]
    for bad in ("kv_len - q_len - 1", "seq_len", "q_len ** 2", "__import__('os')"):
        with pytest.raises(KernelpackError, match="is not one kernelpack reads"):
            closures.evaluate(bad, dims)
    ref = {
        "function": "drafter:anchored_mask.<locals>.draft_mask",
        "closure": {
            "anchors": {"tensor": {"shape": ["batch", "q_len // 16"], "dtype": "int64"}},
            "keep": {"tensor": {"shape": ["batch", "q_len // 16"], "dtype": "bool"}},
            "context": {"dim": "kv_len - q_len"},
            "block": 16,
            "blocks": {"example": 512, "seen": [512, 512]},
            "window": {"none": True},
        },
    }

    class Point:
        batch, q_heads, kv_heads, q_len, kv_len, head_dim = 2, 4, 2, 8192, 11000, 128

    fn = closures.rebuild(ref, dims=Point())
    values = {n.path: n.value for n in functions.tree(fn).walk() if n.path}
    assert values["context"] == 2808 and values["blocks"] == 512 and values["window"] is None
    assert tuple(values["anchors"].shape) == (2, 512) and not values["anchors"].any() and values["keep"].all()
    assert closures.varying(ref) == {
        "anchors.shape[0]": "batch",
        "anchors.shape[1]": "q_len // 16",
        "keep.shape[0]": "batch",
        "keep.shape[1]": "q_len // 16",
        "context": "kv_len - q_len",
        "blocks": "example",
    }
    with pytest.raises(KernelpackError, match="needs the call's dimensions"):
        closures.rebuild(ref)


# ------------------------------------------------------------------------------------------------ record


def _run_drafter(steps: int, seed: int, window: int = 128) -> None:
    """The drafter's forward passes as the job makes them (kernelpack.flex_attention), one thread."""
    import random

    import torch

    import kernelpack

    rng = random.Random(seed)
    model = drafter.Drafter(64, 4, 2, 16, window, kernelpack.flex_attention)
    with torch.no_grad():
        for _ in range(steps):
            s = rng.randint(200, 700)
            model(torch.randn(1, 256, 64), torch.randn(1, s, 64), torch.randint(0, s, (1, 16)), torch.ones(1, 16) > 0)


def test_record_writes_one_dynamic_config_per_variant_with_the_closure_in_the_calls_dimensions(tmp_path: Path) -> None:
    with recording(tmp_path / "r.toml"):
        _run_drafter(steps=3, seed=1)
    text = (tmp_path / "r.toml").read_text()
    recipe = parse_recipe(tomllib.loads(text))
    assert len(recipe.configs) == 2, text  # the sliding and the full layer: a None window is other code
    for c in recipe.configs:
        closure = json.loads(c.mask_closure or "{}")["closure"]
        assert closure["context"] == {"dim": "kv_len - q_len"}, text
        assert closure["anchors"] == {"tensor": {"dtype": "int64", "shape": ["batch", "q_len // 16"]}}
        assert c.dynamic and c.q_range == (256, 256)  # q_len did not vary: fixed
        seen = [int(x) for x in text.split("kv_len ")[1].split(":")[0].split("..")]
        assert c.kv_range == (seen[0] // 2, seen[1] * 2)  # widened: half the smallest, twice the largest
        # the graph's marks: what differs between the ends of the range (the context, the kv length and its block
        # counts); the query length, the heads, the anchors' count and the block size stay static
        marks = canonical.marks(c, "cpu")
        assert {"block_mask.mask_mod.context", "key.shape[2]", "block_mask.kv_indices.shape[3]"} <= set(marks), marks
        assert not [m for m in marks if m.startswith("query") or "anchors" in m or m.endswith((".block", "blocks"))]
    windows = [json.loads(c.mask_closure or "{}")["closure"]["window"] for c in recipe.configs]
    assert sorted(map(json.dumps, windows)) == ["128", '{"none": true}']
    # static buckets cannot serve it: a call padded to a bucket keeps its own context, not the bucket's
    with pytest.raises(RecordError, match=r"cannot serve the call .*its mask closes over context, which follow"):
        with recording(tmp_path / "b.toml", lengths="256:1024:256"):
            _run_drafter(steps=3, seed=1)
    assert not (tmp_path / "b.toml").exists()
    with recording(tmp_path / "w.toml", lengths="300:5000"):
        _run_drafter(steps=3, seed=1)
    assert {c.kv_range for c in parse_recipe(tomllib.loads((tmp_path / "w.toml").read_text())).configs} == {(300, 5000)}


@pytest.mark.parametrize("text", ["1024", "1024:x", "0:10", "10:5", "1:2:3:4"])
def test_a_lengths_option_that_is_not_min_max_multiple_is_refused_before_the_job(text: str) -> None:
    with pytest.raises(RecordError, match="--lengths"):
        Lengths.parse(text)


# ------------------------------------------------------------------------------------------------ CPU template


def test_a_mask_over_symbolic_closure_ints_compiles_on_cpu_and_computes_what_eager_does() -> None:
    """Inductor's CPU flex template renames its split sizes with a plain string replace that also hits a closure
    int's symbol (kernelpack._torch.inductor.fix_cpu_flex_split_names): this mask failed in gcc, and the second
    one computed a wrong mask silently. Through kernelpack's dynamic entry both compile once and match eager flex.
    In a fresh process, as the guards test above."""
    out = run_json([sys.executable, __file__, "symbolic_closure_ints"])
    for case in out:
        assert max(case["errors"]) < 1e-5, out
        # one graph for the three lengths: the closure value is symbolic, so the template's rename was exercised
        assert case["new_entries"] == 1, out


def _symbolic_closure_ints() -> list[dict[str, Any]]:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from kernelpack import compiled as kp_compiled
    from kernelpack.runtime import guarded

    compiled = guarded(dynamic=True)
    # what kernelpack.canonical.marks gives a config of these calls: the kv length, its block counts, the closure's
    blocks = ["kv_indices.shape[3]", "full_kv_indices.shape[3]", "q_num_blocks.shape[2]", "q_indices.shape[2]"]
    blocks += ["full_q_num_blocks.shape[2]", "full_q_indices.shape[2]", "seq_lengths[1]"]
    marks = ("key.shape[2]", "value.shape[2]", *(f"block_mask.{b}" for b in blocks))

    def collision(T: Any, a1: Any, a2: Any, a3: Any) -> Any:
        def mask(b, h, q, kv):
            return a1(a2(a3(kv < T.shape[1] * 20))) & (q >= 0)

        return mask

    cases = [
        (lambda s: _mask(s, blocks=8), ("block_mask.mask_mod.context",)),
        (lambda s: collision(torch.zeros(1, s // 32), *[lambda x: x] * 3), ("block_mask.mask_mod.T.shape[1]",)),
    ]
    out = []
    for make, closure in cases:
        before = len(kp_compiled.dynamo_entries("default", True))
        errors = []
        for s in (256, 384, 320):
            torch.manual_seed(s)
            bm = create_block_mask(make(s), 1, None, 128, s + 128, device="cpu")
            q, k, v = torch.randn(1, 2, 128, 16), torch.randn(1, 2, s + 128, 16), torch.randn(1, 2, s + 128, 16)
            with kp_compiled.marking((*marks, *closure)):
                error = (compiled(q, k, v, block_mask=bm) - flex_attention(q, k, v, block_mask=bm)).abs().max()
            errors.append(float(error))
        out.append({"errors": errors, "new_entries": len(kp_compiled.dynamo_entries("default", True)) - before})
    return out


# ------------------------------------------------------------------------------------------------ the job


def _specforge() -> Any:
    try:
        from specforge.algorithms.common import dflash_family_model
    except Exception:  # not installed (pip install --no-deps specforge==0.2.0), or it does not import here
        return None
    return dflash_family_model


@pytest.mark.parametrize(
    "mask",
    [
        "own",
        # slow: the same job as "own" with SpecForge's mask function; the README's test command keeps "own"
        pytest.param(
            "specforge",
            marks=[
                pytest.mark.skipif(_specforge() is None, reason="specforge 0.2.0 is not installed"),
                pytest.mark.slow,
            ],
        ),
    ],
)
def test_the_drafter_job_is_recorded_built_and_served_at_every_context_length(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mask: str
) -> None:
    """The DFlash-shaped job as its trainer writes it, unchanged: recorded (2 threads, 3 steps) with no option, built
    with no hand edit, then run in fresh processes with 3 threads at context lengths it never recorded: nothing
    compiled, missed, refused or dense. A context beyond the range is refused naming kv_len, the covered range and
    the fix, not the mask. ``specforge``: the same job with SpecForge 0.2.0's own ``create_dflash_block_mask``."""
    import os

    monkeypatch.chdir(PROJECT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PROJECT), os.environ.get("PYTHONPATH", "")]))
    recipe = tmp_path / "drafter.toml"
    job = [sys.executable, "drafter_job.py", "--threads", "2", "--steps", "3", "--mask", mask]
    assert main(["record", "-o", str(recipe), "--", *job]) == 0
    assert recipe.read_text().count("[[calls]]") == 2
    assert main(["build", str(recipe), "-o", str(tmp_path / "out"), "--jobs", "2"]) == 0
    (artifact,) = (tmp_path / "out").glob("*.kpack")
    run = [
        sys.executable,
        "drafter_job.py",
        "--mask",
        mask,
        "--artifact",
        str(artifact),
        "--cache",
        str(tmp_path / "c"),
    ]
    out = run_json([*run, "--threads", "3", "--steps", "4", "--seed", "7"])
    rng = random.Random(0)  # the recorded run's contexts, as drafter_job.py draws them (--seed 0, 2 threads, 3 steps)
    recorded = {rng.randint(200, 700) for _ in range(2 * 3)}
    assert not recorded & {s for steps in out["contexts"] for s in steps}, "replay at lengths never recorded"
    assert (out["errors"], out["missed"], out["refused"], out["compiled"], out["dense"]) == ([], 0, [], 0, 0), out
    beyond = run_json([*run, "--steps", "1", "--context", "1900:1900"])
    (error,) = beyond["errors"]
    assert "differs in: kv_len '" in error and "vs 2156)" in error and "mask" not in error.split("differs in:")[1]
    assert "widen the range (kernelpack record --lengths MIN:MAX" in error
    if mask == "own":  # a served call reads the mask's code and closure; it never runs the mask (no per-step recording)
        runs = run_json([sys.executable, "mask_runs.py", str(artifact), str(tmp_path / "c2")])
        assert runs["built"] > 0 and (runs["served"], runs["refused"], runs["compiled"]) == (0, 0, 0), runs


# slow: a record, a build and 3 threads of SpecForge's model, about a minute; the README's test command keeps the
# drafter job in this shape ("own") and takeover through transformers (test_runtime)
@pytest.mark.slow
@pytest.mark.skipif(_specforge() is None, reason="specforge 0.2.0 is not installed")
def test_specforges_own_dflash_model_is_recorded_built_and_served_with_takeover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SpecForge 0.2.0's own code, unchanged (record_project/specforge_job.py: its DFlashDraftModel in its
    OnlineDFlashModel, its anchors, its create_dflash_block_mask, its attention through transformers'
    "flex_attention"), with the job's two kernelpack lines (register(takeover=True); activate): recorded with no
    option into one dynamic config per mask variant, built, and served in 3 threads at context lengths it never
    recorded with nothing compiled, missed, refused or dense. Forward only (CPU)."""
    import os

    monkeypatch.chdir(PROJECT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PROJECT), os.environ.get("PYTHONPATH", "")]))
    recipe = tmp_path / "specforge.toml"
    assert main(["record", "-o", str(recipe), "--", sys.executable, "specforge_job.py", "--threads", "2"]) == 0
    text = recipe.read_text()
    assert text.count("[[calls]]") == 2 and "create_dflash_block_mask" in text and "kv_len = { min" in text, text
    assert main(["build", str(recipe), "-o", str(tmp_path / "out"), "--jobs", "2"]) == 0
    (artifact,) = (tmp_path / "out").glob("*.kpack")
    job = [sys.executable, "specforge_job.py", "--artifact", str(artifact), "--cache", str(tmp_path / "c")]
    out = run_json([*job, "--threads", "3", "--steps", "3", "--seed", "7"])
    assert (out["errors"], out["missed"], out["refused"], out["compiled"], out["dense"]) == ([], 0, [], 0, 0), out
    assert out["frames_compiled"] == 0 and out["served"] == ["precompiled"], out


if __name__ == "__main__":
    scenarios = {"guards_free_values": _guards_free_values, "symbolic_closure_ints": _symbolic_closure_ints}
    print(json.dumps(scenarios[sys.argv[1]]()))
