"""kernelpack.integrations.transformers: the recipe a model config gives and its refusals (no build), against the
calls each family of the model matrix (tests/families.py) really makes; and the matrix recorded, built and replayed
end to end."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import tomllib

pytest.importorskip("transformers")

import families
from transformers import MistralConfig

from kernelpack.errors import KernelpackError
from kernelpack.integrations.transformers import recipe_for
from kernelpack.recipe import parse_recipe

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 64}


def configs(text: str) -> list:
    return list(parse_recipe(tomllib.loads(text), path="r.toml").configs)


def test_the_recipe_declares_the_call_transformers_makes() -> None:
    (c,) = configs(recipe_for(MistralConfig(**BASE), seq_lens=[512], device="cuda", graphs=["fwd+bwd"]))
    assert (c.q_heads, c.kv_heads, c.head_dim, c.q_len, c.window) == (4, 2, 16, 512, 64)
    assert c.layout == "bshd" and c.scale == 16**-0.5 and c.enable_gqa and c.return_aux == "lse"
    assert c.mask == "kernelpack.integrations.transformers:sliding_window_mask" and c.dtype == "bfloat16"
    cached = configs(recipe_for(MistralConfig(**BASE), seq_lens=[512], device="cuda", use_cache=True))[0]
    assert cached.layout == "q=bshd k=bhsd v=bhsd"  # the KV cache concatenates k and v into contiguous tensors
    (cpu,) = configs(recipe_for(MistralConfig(**BASE), seq_lens=[512], dtype="float32", device="cpu", graphs=["fwd"]))
    assert cpu.return_aux == "none" and not cpu.return_lse  # transformers asks for no lse on CPU


def test_head_counts_that_are_not_a_power_of_two_repeat_kv_as_transformers_does() -> None:
    config = MistralConfig(**{**BASE, "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 96})
    (c,) = configs(recipe_for(config, seq_lens=[256], device="cuda"))
    assert (c.q_heads, c.kv_heads, c.enable_gqa) == (6, 6, False)
    assert c.layout == "q=bshd k=bhsd v=bhsd"  # repeat_kv's copies are contiguous


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 2), (4, 1), (1, 1), (8, 1)])
@pytest.mark.parametrize("use_cache", [False, True])
def test_the_declared_layout_is_the_one_the_model_passes_one_kv_head_included(
    q_heads: int, kv_heads: int, use_cache: bool
) -> None:
    """The layout recipe_for declares is the signature's reading (exact strides) of the q, k, v the model really
    passes to its attention function: one kv head (multi-query attention) gives k RoPE's contiguous output and v the
    transposed view, whose strides differ only on the size-1 head dim; no compile (a capturing attention function in
    place of flex_attention_forward, which repeats k and v itself for head counts that are not a power of two)."""
    import torch
    from transformers import AttentionInterface, MistralForCausalLM

    from kernelpack.signature import layout_of

    seen: list[str] = []

    def capture(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(layout_of(query, key, value))
        return torch.zeros_like(query).transpose(1, 2), None

    AttentionInterface.register("kernelpack-test-capture", capture)
    over = {"num_attention_heads": q_heads, "num_key_value_heads": kv_heads, "hidden_size": 16 * q_heads}
    config = MistralConfig(**{**BASE, **over, "num_hidden_layers": 1, "vocab_size": 32, "intermediate_size": 32})
    (c,) = configs(
        recipe_for(config, seq_lens=[64], dtype="float32", device="cpu", graphs=["fwd"], use_cache=use_cache)
    )
    config._attn_implementation = "kernelpack-test-capture"
    with torch.no_grad():
        MistralForCausalLM(config).eval()(torch.randint(0, 32, (1, 64)), use_cache=use_cache)
    assert seen == [c.layout], (seen, c.layout)


def test_the_layers_decide_the_mask_and_the_batch_its_dims() -> None:
    full = MistralConfig(**BASE)
    full.layer_types = ["full_attention"] * full.num_hidden_layers  # sliding_window set, but no layer slides
    (c,) = configs(recipe_for(full, seq_lens=[256], device="cuda"))
    assert c.mask == "kernelpack.integrations.transformers:causal_mask"
    (b,) = configs(recipe_for(MistralConfig(**BASE), seq_lens=[256], device="cuda", batch=2))
    assert b.mask_dims == "per-batch"  # transformers builds one block table per batch element


def test_no_window_is_the_causal_mask() -> None:
    (c,) = configs(recipe_for(MistralConfig(**{**BASE, "sliding_window": None}), seq_lens=[256], device="cuda"))
    assert c.mask == "kernelpack.integrations.transformers:causal_mask" and c.window is None


@pytest.mark.parametrize(
    "over, fragment",
    [
        ({"layer_types": ["chunked_attention", "full_attention"]}, "'chunked_attention'"),
        ({"layer_types": ["linear_attention", "full_attention"]}, "'linear_attention'"),
    ],
)
def test_what_a_recipe_cannot_declare_yet_is_refused(over: dict, fragment: str) -> None:
    config = MistralConfig(**BASE)
    for k, v in over.items():
        setattr(config, k, v)
    with pytest.raises(KernelpackError, match=fragment) as exc:
        recipe_for(config, seq_lens=[256])
    assert exc.value.hint


def test_a_model_that_mixes_sliding_and_full_layers_gets_a_config_per_mask_and_length() -> None:
    """Gemma2/3's pattern (and Mistral's or Qwen2's layer_types): both masks, each at each length, every other field
    the same; the layer types alone decide (a sliding_window with only full layers is the causal mask)."""
    config = MistralConfig(**BASE)
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    mixed = configs(recipe_for(config, seq_lens=[256, 512]))
    assert sorted((c.mask, c.window, c.q_len) for c in mixed) == [
        ("kernelpack.integrations.transformers:causal_mask", None, 256),
        ("kernelpack.integrations.transformers:causal_mask", None, 512),
        ("kernelpack.integrations.transformers:sliding_window_mask", 64, 256),
        ("kernelpack.integrations.transformers:sliding_window_mask", 64, 512),
    ]
    (one,) = configs(recipe_for(MistralConfig(**BASE), seq_lens=[256]))  # [matrix] form, one mask
    for c in mixed:
        differs = {f for f in ("mask", "window", "q_len", "kv_len", "id") if getattr(c, f) != getattr(one, f)}
        assert {k: v for k, v in c.to_dict().items() if k not in differs} == {
            k: v for k, v in one.to_dict().items() if k not in differs
        }, c
    ranged = configs(recipe_for(config, seq_lens={"min": 256, "max": 1024}))
    assert len(ranged) == 2 and all(c.dynamic and c.q_range == (256, 1024) for c in ranged), ranged
    config.layer_types = ["full_attention"] * 2
    assert [c.mask for c in configs(recipe_for(config, seq_lens=[256]))] == [
        "kernelpack.integrations.transformers:causal_mask"
    ]


def test_recipe_for_writes_toml_no_config_value_can_break() -> None:
    """recipe_for wrote TOML with f-strings: a model name with `"` wrote invalid TOML, with `"` and a
    newline it injected keys. It goes through the one TOML writer record uses, and is read back before it returns."""
    from kernelpack.errors import RecipeError

    hostile = MistralConfig(**BASE)
    hostile.model_type = 'mistral"\ndevice = "cpu"\n[compile]\nmode = "max-autotune'
    text = recipe_for(hostile, seq_lens=[512], device="cuda", name="m")
    data = tomllib.loads(text)
    assert data["device"] == "cuda" and "compile" not in data and data["name"] == "m"
    with pytest.raises(RecipeError, match="name: must be letters"):
        recipe_for(MistralConfig(**BASE), seq_lens=[512], device="cuda", name='a"b')
    with pytest.raises(RecipeError, match="name: must be letters"):
        recipe_for(hostile, seq_lens=[512], device="cuda")  # the default name comes from model_type


# the head counts a family's config may take: its own, a count that is not a power of two (transformers repeats k and
# v: contiguous copies), and such a count without GQA (repeat_kv by 1 returns k and v as they are)
HEADS = {"own": {}, "6/2": {"num_attention_heads": 6, "num_key_value_heads": 2}, "6/6": {"num_attention_heads": 6}}


def _with_heads(family: families.Family, heads: dict) -> families.Family:
    if not heads:
        return family
    d = family.kwargs.get("head_dim", 16)
    kwargs = {**family.kwargs, "hidden_size": heads["num_attention_heads"] * d}
    kwargs["num_attention_heads"] = heads["num_attention_heads"]
    if "num_key_value_heads" in family.kwargs:  # a family with GQA (GPT-NeoX has none)
        kwargs["num_key_value_heads"] = heads.get("num_key_value_heads", heads["num_attention_heads"])
    return dataclasses.replace(family, kwargs=kwargs)


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("name", [f.name for f in families.FAMILIES if f.inputs == "plain" and "cpu" in f.devices])
def test_recipe_for_declares_the_calls_each_family_makes(name: str, heads: str, tmp_path: Path) -> None:
    """For each family (and other head counts), the recipe recipe_for writes from the config stands
    for the very calls the model makes, as kernelpack.recording writes them from a real forward: layouts by exact
    strides (one kv head, Phi-3's and GPT-NeoX's fused projections, repeat_kv's copies), masks per layer type,
    scale, softcap, by what each computes. No compile (recording skips the calls)."""
    import torch

    import kernelpack
    from kernelpack.integrations import transformers as hf

    family = _with_heads(families.BY_NAME[name], HEADS[heads])
    config = family.make_config()
    config._attn_implementation = "kernelpack"
    hf.register()
    torch.manual_seed(0)
    model = getattr(__import__("transformers"), family.model)(config).eval()
    recorded = tmp_path / "recorded.toml"
    with kernelpack.recording(recorded), torch.no_grad():
        model(**families.inputs(family, 128, "cpu"), use_cache=False)
    written = recipe_for(config, seq_lens=[128], dtype="float32", device="cpu", graphs=["fwd"])
    ours, theirs = families.signatures(written), families.signatures(recorded.read_text())
    assert ours == theirs, ([s.describe() for s in ours - theirs], [s.describe() for s in theirs - ours])


def test_a_family_with_attention_sinks_is_refused_on_cpu_by_name() -> None:
    """GPT-OSS applies its sinks with flex's lse, which flex returns on CUDA only: recipe_for says so for CPU (and
    transformers refuses the model there), and writes the lse for CUDA."""
    config = families.BY_NAME["gpt-oss"].make_config()
    with pytest.raises(KernelpackError, match=r"gpt_oss has attention sinks.*no lse on CPU"):
        recipe_for(config, seq_lens=[128], dtype="float32", device="cpu", graphs=["fwd"])
    assert {c.return_aux for c in configs(recipe_for(config, seq_lens=[128]))} == {"lse"}


def test_docs_transformers_md_lists_the_families_the_tests_run() -> None:
    """docs/transformers.md is generated from tests/families.py's list (python tests/families.py --doc)."""
    doc = Path(__file__).parent.parent / "docs" / "transformers.md"
    assert doc.read_text() == families.doc(), "regenerate: python tests/families.py --doc > docs/transformers.md"


# once: a record, a build of 10 configs and 2 fresh processes, about 3 minutes: the main suite's torch only. The
# torch-internal halves run on every torch: the model class imported after activate() in test_precompiled, the
# layouts here (no build); the H200's GPU suite runs the matrix with backward on 2.11. slow: the README's test
# command keeps record -> build -> replay of a transformers model in test_recording and attn_implementation
# "kernelpack" in test_runtime
@pytest.mark.once
@pytest.mark.slow
def test_every_family_records_builds_and_replays_with_no_compile(tmp_path: Path) -> None:
    """On CPU: `kernelpack record` of one forward of every family (tests/families.py: Llama,
    Mistral, Qwen2, Qwen3 with mixed layers, Gemma2's softcap, Gemma3's one kv head and head_dim 256, Phi-3's and
    GPT-NeoX's fused projections, packed sequences, a padded batch of 2), `kernelpack build` with no hand edit, then
    fresh processes, both tiers, that call activate() before importing the models' classes: every family's step
    compiles nothing, no call is refused or missed, and the logits are transformers' eager attention's (1e-5)."""
    import subprocess

    from conftest import run_json

    from kernelpack.build import build_recipe

    script = str(Path(families.__file__))
    recipe = tmp_path / "families.toml"
    cli = [sys.executable, "-m", "kernelpack.cli"]
    subprocess.run([*cli, "record", "-o", str(recipe), "--", sys.executable, script], check=True, timeout=600)
    built = build_recipe(recipe, tmp_path / "out", jobs=2)
    assert built.artifact is not None and not built.failed
    names = [f.name for f in families.FAMILIES if "cpu" in f.devices]
    for tier in ("precompiled", "inductor-cache"):
        env = {"KERNELPACK_PRECOMPILED": "0"} if tier == "inductor-cache" else {}
        out = run_json(
            [sys.executable, script, "--artifact", str(built.artifact), "--cache", str(tmp_path / tier)], env=env
        )
        assert list(out["families"]) == names, out
        for name, result in out["families"].items():
            assert result["refused"] is None, (tier, name, result)
            assert result["compiles"] == 0 and result["misses"] == 0, (tier, name, result)
            assert result["max_abs_error"] < 1e-5, (tier, name, result)
        assert out["misses"] == 0 and out["refused"] == 0, out
        assert {s["tier"] for s in out["served"]} == {tier}, out


# the families whose calls differ in what a dynamic graph must keep symbolic: Gemma3's two layer kinds (one kv head,
# head_dim 256), Phi-3's fused projection (a strided view), packed documents and a padded batch (masks over tensors
# whose size follows the length)
DYNAMIC_FAMILIES = ("gemma3", "phi3", "llama-packed", "llama-padded")


# once: a record, a build of 5 dynamic configs and 3 fresh processes, about 2 minutes. slow: the README's test
# command keeps a recorded range served at lengths never recorded (test_lengths, test_dynamic_masks' drafter job)
@pytest.mark.once
@pytest.mark.slow
def test_families_recorded_at_one_length_with_lengths_are_served_at_another(tmp_path: Path) -> None:
    """One recorded step with `kernelpack record --lengths 129:1024` yields an artifact for the job's
    every length: replayed at a length never recorded (384), in a fresh process that activates before importing the
    models, each family compiles nothing, is never refused, and computes eager attention's logits (1e-5). A length
    past the range is refused naming the covered range and the fix."""
    import subprocess

    from conftest import run_json

    from kernelpack.build import build_recipe

    script = str(Path(families.__file__))
    recipe = tmp_path / "families.toml"
    record = [sys.executable, "-m", "kernelpack.cli", "record", "-o", str(recipe), "--lengths", "129:1024", "--"]
    subprocess.run(
        [*record, sys.executable, script, "--length", "256", "--families", ",".join(DYNAMIC_FAMILIES)],
        check=True,
        timeout=600,
    )
    written = tomllib.loads(recipe.read_text())["calls"]
    assert {str(c.get("seq_len")) for c in written} == {"{'min': 129, 'max': 1024}"} and all(
        c["dynamic"] for c in written
    )
    built = build_recipe(recipe, tmp_path / "out", jobs=2)
    assert built.artifact is not None and not built.failed
    replay = [sys.executable, script, "--artifact", str(built.artifact), "--cache", str(tmp_path / "cache")]
    out = run_json([*replay, "--length", "384", "--families", ",".join(DYNAMIC_FAMILIES)])
    assert list(out["families"]) == list(DYNAMIC_FAMILIES), out
    for name, result in out["families"].items():
        assert result["refused"] is None, (name, result)
        assert result["compiles"] == 0 and result["misses"] == 0, (name, result)
        assert result["max_abs_error"] < 1e-5, (name, result)
    assert out["misses"] == 0 and out["refused"] == 0, out
    past = run_json([*replay, "--length", "1100", "--families", "llama-padded"])["families"]["llama-padded"]["refused"]
    assert past is not None and past.startswith("NotPrecompiledError"), past
    assert "q_len 1100 (covered: 129..1024)" in past and "kernelpack record --lengths MIN:MAX" in past, past
