"""First training step of a transformers causal LM (Mistral architecture: sliding window, GQA) at several lengths,
side by side in one run, each sample a fresh subprocess (bench/warm_start.py's protocol):

  (a) cold       attn_implementation="flex_attention" (transformers' own torch.compile), empty cache dir
  (b) warm       the same, with the cache dir (a) filled: torch's native warm start
  (c) mega       the same, after torch.compiler.load_cache_artifacts() of the blob (a) saved, into an empty dir
  (d) kernelpack runtime.activate(artifact) (install + warm-up included), attn_implementation="kernelpack"; the
                precompiled tier serves the calls it covers
  (e) tier1     the same with KERNELPACK_PRECOMPILED=0: the inductor cache serves every call
  (f) background runtime.activate(artifact, warmup="background") BEFORE the model is built, so that loading the
                precompiled functions overlaps model construction; its clock therefore
                includes model construction: compare its first_step with another arm's model_s + first_step

A step is forward + backward of the model on one batch of each length, in order. first_step = preparation + every
length's step, synchronized; the model is built (on the GPU) before the clock starts, for every arm but background.
Compiles are counted from torch's per-compile records (kernelpack.evidence), transformers' compiled mask builder
included.
The artifact comes from the recipe this script writes (--write-recipe) with kernelpack.integrations.transformers.

    python bench/transformers_step.py --write-recipe r.toml --lengths 4096,8192
    kernelpack build r.toml -o out
    python bench/transformers_step.py --artifact out/*.kpack --lengths 4096,8192 --repeats 3 --out t.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

MODEL = {  # the attention of the DFlash drafter's target: GQA 32/8, D=128; a small MLP and vocabulary
    "vocab_size": 1024,
    "hidden_size": 4096,
    "intermediate_size": 4096,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "sliding_window": 1024,
    "max_position_embeddings": 32768,
}
TINY = {
    **MODEL,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": 64,
}


def config(tiny: bool) -> Any:
    from transformers import MistralConfig

    return MistralConfig(**(TINY if tiny else MODEL))


def child(mode: str, cache_dir: str, artifact: str, blob: str, result: str) -> None:
    import torch
    from transformers import MistralForCausalLM

    from kernelpack import evidence, runtime
    from kernelpack.artifact import read_manifest

    manifest = read_manifest(artifact)
    cuda = manifest.build_key.device_type == "cuda"
    device = "cuda:0" if cuda else "cpu"
    lengths = sorted({c.config.q_len for c in manifest.configs})
    train = all(c.config.backward for c in manifest.configs)
    tiny = manifest.configs[0].config.q_heads == TINY["num_attention_heads"]
    if cuda:
        torch.cuda.init()
    evidence.install_hooks()
    evidence.watch_compiles()
    cfg = config(tiny)
    ours = mode in ("kernelpack", "tier1", "background")  # tier1: KERNELPACK_PRECOMPILED=0 (warm_start.run_child)
    cfg._attn_implementation = "kernelpack" if ours else "flex_attention"
    if ours:  # the name must be known when the model is built; activate() below does it too
        from kernelpack.integrations import transformers as hf

        hf.register()
    mark = evidence.next_seq()
    t0 = time.perf_counter()
    if mode == "background":  # the warm-up runs while the model is built; the first guarded call waits for it
        runtime.activate(artifact, cache_dir=cache_dir, warmup="background")
    torch.manual_seed(0)
    t_model = time.perf_counter()
    with torch.device(device):
        model = MistralForCausalLM(cfg).to(getattr(torch, manifest.configs[0].config.dtype)).train(train)
    model_s = time.perf_counter() - t_model
    batches = [torch.randint(0, cfg.vocab_size, (1, n), device=device) for n in lengths]
    if mode != "background":
        t0 = time.perf_counter()
    if mode in ("kernelpack", "tier1"):
        runtime.activate(artifact, cache_dir=cache_dir)  # transformers is imported: registers "kernelpack"
    elif mode == "mega":
        torch.compiler.load_cache_artifacts(Path(blob).read_bytes())
    prep = time.perf_counter() - t0
    step_mark = evidence.next_seq()

    def step() -> list[float]:
        seconds = []
        for ids in batches:
            s = time.perf_counter()
            with torch.set_grad_enabled(train):
                out = model(ids, labels=ids if train else None, use_cache=False)
            if train:
                out.loss.backward()
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - s)
        return seconds

    first = step()
    second = step()
    # a background warm-up still loading when the steps run records its loads then: tagged by kernelpack, not steps
    warmup = [r for r in evidence.compile_records(step_mark) if r.tag is not None]
    compiles = [r for r in evidence.compile_records(step_mark) if r.tag is None]
    out = {
        "mode": mode,
        "lengths": lengths,
        "model_s": model_s,
        "prep": prep,
        "first_step": prep + sum(first),
        "first_step_by_length": first,
        "second_step": sum(second),
        "compiles_in_steps": len(compiles),
        "misses_in_steps": sum(r.missed for r in compiles),
        "fx_misses_in_steps": sum(r.fx_misses or 0 for r in compiles),
        "fx_hits_in_steps": sum(r.fx_hits or 0 for r in compiles),
        "compiled_code": sorted({r.code.split(" (")[0] for r in compiles}),
        "compiles_in_prep": len(evidence.compile_records(mark)) - len(compiles) - len(warmup),
        "warmup_records_in_steps": len(warmup),
        "torch": torch.__version__,
        "git": torch.version.git_version,
    }
    if ours:
        out["report"] = runtime.report().summary()
        out["tiers"] = sorted({s["tier"] for s in runtime.report().to_dict()["served"]})
    if mode == "cold":
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            Path(blob).write_bytes(saved[0])
    Path(result).write_text(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact")
    ap.add_argument("--write-recipe", help="write the model's recipe (kernelpack.integrations.transformers.recipe_for)")
    ap.add_argument("--lengths", default="4096,8192")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU dry runs; forward only on CPU)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold-repeats", type=int, default=None, help="cold runs in the first N repeats (default: all)")
    ap.add_argument("--modes", default="cold,warm,mega,kernelpack,tier1,background")
    ap.add_argument("--out", default="transformers_step.json")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    if args.write_recipe:
        from kernelpack.integrations.transformers import recipe_for

        graphs = ["fwd"] if args.device == "cpu" else ["fwd", "fwd+bwd"]
        dtype = "float32" if args.device == "cpu" else "bfloat16"
        text = recipe_for(
            config(args.tiny),
            seq_lens=[int(n) for n in args.lengths.split(",")],
            dtype=dtype,
            device=args.device,
            graphs=graphs,
            name="mistral-bench",
        )
        Path(args.write_recipe).write_text(text)
        print(text)
        return
    import warm_start  # the same fresh-process protocol and table

    warm_start.step_table(
        warm_start.side_by_side(
            __file__, args.artifact, args.modes.split(","), args.repeats, args.timeout, args.out, args.cold_repeats
        ),
        args.out,
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":  # warm_start's protocol: mode, cache, artifact, blob, result
        child(*sys.argv[2:7])
    else:
        main()
