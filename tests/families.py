"""The transformers model matrix: tiny random-weight models of transformers' own classes, each a family's
attention as its code calls flex, run as a user's job would run them through kernelpack.

    kernelpack record -o r.toml -- python tests/families.py              # the calls of every family, recorded
    kernelpack build r.toml -o out
    python tests/families.py --artifact out/*.kpack --cache c           # replayed: activate() first, then the models

Prints one JSON line: for each family, the compiles and misses of its kernelpack step, whether it was refused, and
its outputs' max abs error against transformers' own attention (on CPU its eager math, on CUDA its compiled
flex_attention). ``python tests/families.py --doc`` prints docs/transformers.md (test_integrations checks the file).

A family is a config, not a checkpoint: hidden models of other sizes and layouts are the point of building for the
family. The list below is what the tests run; a family that kernelpack cannot serve is in REFUSED, with the error
recipe_for gives for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
import time
from typing import Any

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
MIXED = ["sliding_attention", "full_attention"]


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config: str  # transformers' config class
    model: str  # its causal LM class
    kwargs: dict[str, Any]
    what: str  # what of the family's attention this exercises (docs/transformers.md)
    inputs: str = "plain"  # plain | packed (position_ids that restart) | padded (a batch of 2, left padding)
    devices: tuple[str, ...] = ("cpu", "cuda")

    def make_config(self) -> Any:
        import transformers

        return getattr(transformers, self.config)(**self.kwargs)


FAMILIES = [
    Family("llama", "LlamaConfig", "LlamaForCausalLM", TINY, "causal, GQA 4/2"),
    Family("mistral", "MistralConfig", "MistralForCausalLM", {**TINY, "sliding_window": 64}, "sliding window"),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", TINY, "causal, GQA, q/k/v biases"),
    Family(
        "qwen3-mixed",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {**TINY, "head_dim": 16, "sliding_window": 64, "use_sliding_window": True, "layer_types": MIXED},
        "sliding and full layers (`layer_types`), q/k norms",
    ),
    Family(
        "gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            **TINY,
            "head_dim": 32,
            "sliding_window": 64,
            "layer_types": MIXED,
            "query_pre_attn_scalar": 32,
            "attn_logit_softcapping": 50.0,
        },
        "logit soft-capping (a score_mod), sliding and full layers, `query_pre_attn_scalar`",
    ),
    Family(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            **TINY,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "sliding_window": 64,
            "layer_types": MIXED,
            "query_pre_attn_scalar": 256,
        },
        "ONE kv head (multi-query), head_dim 256, sliding and full layers, `query_pre_attn_scalar`",
    ),
    Family("phi3", "Phi3Config", "Phi3ForCausalLM", TINY, "fused qkv projection (v a slice of its rows), causal"),
    Family(
        "gpt-neox",
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {**{k: v for k, v in TINY.items() if k != "num_key_value_heads"}, "rotary_pct": 0.25},  # no GQA
        "fused qkv interleaved per head (v a strided slice), partial rotary",
    ),
    Family(
        "gpt-oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            **TINY,
            "head_dim": 16,
            "intermediate_size": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 64,
            "layer_types": MIXED,
        },
        "attention sinks (`s_aux`: the lse renormalized after the call), MoE, sliding and full layers",
        devices=("cuda",),  # transformers refuses sinks with flex on CPU (no lse there)
    ),
    Family(
        "llama-packed",
        "LlamaConfig",
        "LlamaForCausalLM",
        TINY,
        "packed sequences: position_ids that restart, a document mask over a tensor",
        inputs="packed",
    ),
    Family(
        "llama-padded",
        "LlamaConfig",
        "LlamaForCausalLM",
        TINY,
        "a batch of 2 with left padding: a padding mask over the attention_mask tensor",
        inputs="padded",
    ),
]
BY_NAME = {f.name: f for f in FAMILIES}


def inputs(family: Family, length: int, device: str) -> dict[str, Any]:
    """The step's inputs: ids, and the position_ids or attention_mask of packed and padded batches."""
    import torch

    g = torch.Generator().manual_seed(1)
    batch = 2 if family.inputs == "padded" else 1
    ids = torch.randint(3, TINY["vocab_size"], (batch, length), generator=g)
    out: dict[str, Any] = {"input_ids": ids}
    if family.inputs == "packed":  # three documents of one row
        cut = [length // 4, length // 2, length - length // 4 - length // 2]
        out["position_ids"] = torch.cat([torch.arange(n) for n in cut])[None]
    if family.inputs == "padded":  # row 1 left-padded by a quarter of the length
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[1, : length // 4] = 0
        out["attention_mask"] = mask
    return {k: v.to(device) for k, v in out.items()}


def valid(batch: dict[str, Any]) -> Any:
    """The positions whose logits mean something (a padded position's attention has no key: flex gives 0, eager a
    mean)."""
    mask = batch.get("attention_mask")
    return None if mask is None else mask.bool()


def step(model: Any, batch: dict[str, Any], train: bool) -> tuple[Any, Any]:
    import torch

    if not train:
        with torch.no_grad():
            return model(**batch, use_cache=False).logits, None
    ids = batch["input_ids"]
    out = model(**batch, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers  # the job's imports in their natural order: transformers, activate(), then the model classes

    from kernelpack import evidence, runtime
    from kernelpack.errors import KernelpackError
    from kernelpack.integrations import transformers as hf

    device = args.device
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    families = [BY_NAME[n] for n in args.families.split(",")] if args.families else FAMILIES
    families = [f for f in families if device in f.devices]
    t0 = time.perf_counter()
    if args.artifact:
        runtime.activate(args.artifact, cache_dir=args.cache)
    else:
        hf.register()  # recorded: kernelpack record observes the integration's calls
    evidence.watch_compiles()
    activate_s = time.perf_counter() - t0
    results: dict[str, Any] = {}
    models: dict[str, Any] = {}
    for family in families:
        model_class = getattr(transformers, family.model)  # its module registers pytree nodes: after activate()
        config = family.make_config()
        config._attn_implementation = "kernelpack"
        torch.manual_seed(0)
        with torch.device(device):
            model = model_class(config).to(dtype)
        model.train(args.train)
        batch = inputs(family, args.length, device)
        mark = evidence.next_seq()
        entry: dict[str, Any] = {"refused": None}
        try:
            logits, loss = step(model, batch, args.train)
        except KernelpackError as e:
            entry["refused"] = f"{type(e).__name__}: {e}"
            logits = loss = None
        records = evidence.compile_records(mark)
        entry["compiles"] = sum(r.tag is None for r in records)  # kernelpack's own lazy loads are tagged
        entry["misses"] = sum(r.missed for r in records)
        results[family.name] = entry
        models[family.name] = (model, batch, logits, loss)
    out: dict[str, Any] = {"activate_s": activate_s, "families": results, "torch": torch.__version__}
    if not args.artifact:
        return out
    report = runtime.report()
    out["misses"] = len(report.misses)
    out["refused"] = len(report.refused)
    out["served"] = [{"tier": s["tier"], "calls": s["calls"]} for s in report.to_dict()["served"]]
    runtime.deactivate()
    # the reference: transformers' own attention on the same model and inputs (on CUDA its compiled flex_attention,
    # whose compiles are not the job's; on CPU its eager math, as compiling flex on CPU costs a build's time again)
    reference = "eager" if device == "cpu" else "flex_attention"
    for name, (model, batch, logits, loss) in models.items():
        if logits is None:
            continue
        model.config._attn_implementation = reference
        model.zero_grad(set_to_none=True)
        ref_logits, ref_loss = step(model, batch, args.train)
        keep = valid(batch)
        diff = (logits.float() - ref_logits.float()).abs()
        results[name]["max_abs_error"] = float(diff[keep].max() if keep is not None else diff.max())
        if loss is not None:
            results[name]["loss"] = [float(loss), float(ref_loss)]
    out["reference"] = reference
    return out


def signatures(recipe: str) -> set[Any]:
    """The calls a recipe's configs stand for, by what selects a graph: call parameters, what the mask and the
    score_mod compute (:func:`kernelpack.signature.mask_key`, as the builder keys them), graphs. Two recipes with
    the same set serve the same calls (no compile)."""
    import tomllib

    from kernelpack.masks import block_mask_for, score_mod_for
    from kernelpack.recipe import parse_recipe
    from kernelpack.signature import mask_key, score_mod_key

    out = set()
    for c in parse_recipe(tomllib.loads(recipe), path="recipe").configs:
        score = score_mod_key(score_mod_for(c))
        for g in c.graphs:
            out.add(c.signature(None, g, mask_key(block_mask_for(c, "cpu").mask_mod), score))
    return out


def doc() -> str:
    """docs/transformers.md: the covered families, from FAMILIES."""
    lines = [
        "# transformers families through kernelpack",
        "",
        "<!-- generated by `python tests/families.py --doc > docs/transformers.md`; test_integrations checks it -->",
        "",
        *textwrap.wrap(
            "Each family is a tiny random-weight model of transformers' own classes with "
            '`attn_implementation="kernelpack"`, run by the tests as a job would: `kernelpack record` of a step, '
            "`kernelpack build`, then a fresh process that calls `runtime.activate()` before importing the model's "
            "class. Every family's step compiles nothing, is not refused, and matches transformers' own attention "
            "(CPU, float32, forward: eager, max abs error 1e-5; CUDA, bfloat16, forward and backward: transformers' "
            "compiled `flex_attention`, 2e-2). `recipe_for(config)` writes a recipe that stands for the same calls "
            "(tests/test_integrations.py). Source: tests/families.py.",
            width=116,
        ),
        "",
        "| family | config | what it exercises | devices |",
        "|---|---|---|---|",
    ]
    for f in FAMILIES:
        lines.append(f"| {f.name} | `{f.config}` | {f.what} | {', '.join(f.devices)} |")
    lines += [
        "",
        "Not covered: layer types other than sliding and full attention (chunked attention, Llama 4; linear attention,",
        "Qwen3-Next): `recipe_for` refuses them by name, record the job instead. Attention sinks on CPU: transformers",
        "refuses them with flex there (the lse is CUDA-only).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact")
    ap.add_argument("--cache")
    ap.add_argument("--families", default="", help="comma-separated names (default: every family of the device)")
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--train", action="store_true", help="forward and backward (CUDA)")
    ap.add_argument("--doc", action="store_true")
    args = ap.parse_args()
    if args.doc:
        sys.stdout.write(doc())
        return
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
