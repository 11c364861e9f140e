"""kernelpack.integrations.transformers: the recipe a model config gives and its refusals (no build), and families
that none of the other tests builds (Gemma3, Gemma2: one kv head, mixed layers, softcap) built and served end to
end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

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
    """Issue 34: recipe_for wrote TOML with f-strings: a model name with `"` wrote invalid TOML, with `"` and a
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


GEMMA3 = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, sliding_window=64, layer_types=["sliding_attention", "full_attention"],
    query_pre_attn_scalar=32, max_position_embeddings=512,
)  # fmt: skip
GEMMA2 = {**GEMMA3, "attn_logit_softcapping": 50.0}  # soft-capped logits: the score_mod closes over the cap

FAMILY_JOB = """
import json, sys, torch
import transformers  # the job's imports in their natural order: transformers, activate(), then the model's class
from kernelpack import runtime
from kernelpack.errors import KernelpackError
runtime.activate(sys.argv[1], cache_dir=sys.argv[2])
config_class, model_class, kwargs = json.loads(sys.argv[3])
model_class = getattr(transformers, model_class)  # its module registers the model's output classes as pytree nodes
config = getattr(transformers, config_class)(**kwargs)
torch.manual_seed(0)
model = model_class(config).eval()
ids = torch.randint(0, config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(1))
logits = {}
for attn in ("kernelpack", "eager"):  # eager: transformers' reference math, softcap included (SDPA has none)
    model.config._attn_implementation = attn
    try:
        with torch.no_grad():
            logits[attn] = model(ids, use_cache=False).logits
    except KernelpackError as e:
        print(json.dumps({"refused": str(e)}))
        sys.exit()
    if attn == "kernelpack":
        report = runtime.report()
        runtime.deactivate()
print(json.dumps({"refused": None, "vs_eager": float((logits["kernelpack"] - logits["eager"]).abs().max()),
                  "missed": len(report.misses), "tiers": sorted({s["tier"] for s in report.to_dict()["served"]}),
                  "calls": sum(s["calls"] for s in report.to_dict()["served"])}))
"""


# once: a build and 3 fresh model processes, 3 minutes on torch 2.11's leg of CI; the torch-internal half (a model
# class imported after activate()) is test_precompiled's, run on every torch, and the H200's GPU suite trains
# transformers models through kernelpack on 2.11
@pytest.mark.once
@pytest.mark.parametrize(
    "family, tiers",
    [
        (("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3), ("precompiled", "inductor-cache")),
        (("Gemma2Config", "Gemma2ForCausalLM", GEMMA2), ("precompiled",)),
    ],
    ids=["gemma3", "gemma2"],
)
def test_a_family_with_one_kv_head_and_mixed_layers_imported_after_activate_is_served(
    family: tuple[str, str, dict], tiers: tuple[str, ...], tmp_path: Path
) -> None:
    """Issue 35 on CPU: the recipe recipe_for writes for a Gemma3 text model with ONE kv head (k RoPE's contiguous
    output, v the transposed view: before the exact-strides layout every call was refused with "stride mismatch")
    and a sliding and a full layer (a config per mask: recipe_for refused mixed layers before), and for Gemma2 (the
    same, soft-capped: recipe_for refused softcap before), built, then a fresh process that imports the model's
    class after activate() (6 pytree node types registered: before kernelpack's guard filter every call was refused
    on their count). Both tiers serve every layer's call (Gemma2: tier 2), nothing is compiled after the warm-up,
    and the logits are transformers' own eager attention's."""
    import json

    import transformers
    from conftest import run_json

    from kernelpack.build import build_recipe

    config_class, _, kwargs = family
    recipe = tmp_path / "family.toml"
    config = getattr(transformers, config_class)(**kwargs)
    recipe.write_text(recipe_for(config, seq_lens=[256], dtype="float32", device="cpu", graphs=["fwd"]))
    built = build_recipe(recipe, tmp_path / "out", jobs=2)
    assert built.artifact is not None and not built.failed
    for tier in tiers:
        env = {"KERNELPACK_PRECOMPILED": "0"} if tier == "inductor-cache" else {}
        run = [
            sys.executable,
            "-c",
            FAMILY_JOB,
            str(built.artifact),
            str(tmp_path / f"cache-{tier}"),
            json.dumps(family),
        ]
        out = run_json(run, env=env)
        assert out["refused"] is None, (tier, out["refused"])
        assert out["missed"] == 0 and out["tiers"] == [tier] and out["calls"] == kwargs["num_hidden_layers"], out
        assert out["vs_eager"] < 1e-4, out
