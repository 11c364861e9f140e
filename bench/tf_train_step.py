"""A user's training job for `kernelpack record` on the GPU: the transformers causal LM of
bench/transformers_step.py (Mistral architecture: GQA 32/8, D=128, sliding window 1024, bf16) with
attn_implementation="kernelpack" and transformers' own reentrant gradient checkpointing, one training step per
length. Prints one JSON line: each length's step seconds and what torch compiled during the step.

    kernelpack record -o r.toml -- python bench/tf_train_step.py --lengths 4096,8192   # no artifact: recorded
    kernelpack build r.toml -o out
    python bench/tf_train_step.py --lengths 4096,8192 --artifact out/*.kpack          # replayed: 0 compiles
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers
from transformers_step import config

from kernelpack import evidence, runtime
from kernelpack.integrations import transformers as hf

ap = argparse.ArgumentParser()
ap.add_argument("--lengths", default="4096,8192")
ap.add_argument("--artifact")
ap.add_argument("--cache")
ap.add_argument("--tiny", action="store_true")
# gemma3: sliding and full layers, ONE kv head, head_dim 256, query_pre_attn_scalar; its k and v have other
# strides than a contiguous tensor on the size-1 head dim, which Dynamo guards
ap.add_argument("--family", choices=["mistral", "gemma3", "qwen3"], default="mistral")
# flex_attention: transformers' own compiled flex path, the native arms (cold: an empty TORCHINDUCTOR_CACHE_DIR;
# warm: the same dir again)
# sdpa: transformers' scaled_dot_product_attention, nothing to compile or load: the job's own floor (its attention
# is dense, so slower by the difference of one step)
ap.add_argument("--attn", choices=["kernelpack", "flex_attention", "sdpa"], default="kernelpack")
# --import-after: the model classes imported after activate(), as a job's imports may go; their modules register the
# models' output classes as pytree nodes, which Dynamo's guards counted before kernelpack dropped them
ap.add_argument("--import-after", action="store_true")
# the mega-cache arm (torch.compiler.save_cache_artifacts / load_cache_artifacts, torch's own portable cache):
# --mega-save writes it after the steps; --mega-load loads it before them, timed as this arm's activate_s
ap.add_argument("--mega-save")
ap.add_argument("--mega-load")
args = ap.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
if not args.import_after:
    from transformers import Gemma3ForCausalLM, MistralForCausalLM, Qwen3ForCausalLM
t0 = time.perf_counter()
if args.mega_load:
    with open(args.mega_load, "rb") as f:
        torch.compiler.load_cache_artifacts(f.read())
activation = None
if args.artifact:
    activation = runtime.activate(args.artifact, cache_dir=args.cache)
elif args.attn == "kernelpack":
    hf.register()
evidence.watch_compiles()
activate_s = time.perf_counter() - t0
nodes = len(torch.utils._pytree.SUPPORTED_NODES)
if args.import_after:
    from transformers import Gemma3ForCausalLM, MistralForCausalLM, Qwen3ForCausalLM
nodes_added = len(torch.utils._pytree.SUPPORTED_NODES) - nodes
if args.family == "gemma3":
    cfg = transformers.Gemma3TextConfig(
        vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=1024, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=256, max_position_embeddings=16384,
    )  # fmt: skip
    model_class: type = Gemma3ForCausalLM
elif args.family == "qwen3":  # alternating sliding-window and full layers (layer_types), GQA 8/2, q/k norms
    cfg = transformers.Qwen3Config(
        vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, sliding_window=1024, use_sliding_window=True,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=16384,
    )  # fmt: skip
    model_class = Qwen3ForCausalLM
else:
    cfg, model_class = config(args.tiny), MistralForCausalLM
cfg._attn_implementation = args.attn
torch.manual_seed(0)
with torch.device(device):
    model = model_class(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32).train()
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
mark = evidence.next_seq()
steps = []
ends = []  # seconds from the activate() line (t0) to the end of each step: model construction inside
for n in (int(x) for x in args.lengths.split(",")):
    ids = torch.randint(0, cfg.vocab_size, (1, n), device=device)
    start = time.perf_counter()
    model(ids, labels=ids, use_cache=False).loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    steps.append(time.perf_counter() - start)
    ends.append(time.perf_counter() - t0)
records = evidence.compile_records(mark)
if args.mega_save:
    blob = torch.compiler.save_cache_artifacts()
    assert blob is not None, "torch saved no cache artifacts"
    with open(args.mega_save, "wb") as f:
        f.write(blob[0])
# kernelpack's lazy loads (KERNELPACK_LOAD=lazy, the default since b25de8b) are torch compile records with cache hits
# only, tagged "kernelpack load": counted apart; misses count every record
compiles = [r for r in records if r.tag is None]
report = runtime.report() if args.artifact else None
print(
    json.dumps(
        {
            "artifact": args.artifact,
            "activate_s": activate_s,
            "step_s": steps,
            "compiles_in_steps": len(compiles),
            "kernelpack_loads_in_steps": len(records) - len(compiles),
            "misses_in_steps": sum(r.missed for r in records),
            "compiled_code": sorted({r.code.split(" (")[0] for r in compiles}),
            "report": report.summary() if report is not None else None,
            # the start's clock: from the activate() line to the end of the first step, model construction inside
            "start_to_first_step_s": ends[0],
            "start_to_each_step_s": ends,
            # the job's first calls (not the warm-up's): each a precompiled function's lazy load and first run
            "later_first_calls_s": [c.seconds for c in report.first_calls if not c.warmup] if report else [],
            # where the background start's seconds went: the install's phases (its files: hash, extract) and the
            # warm-up (imports come before it, in the start's thread)
            "install_phases": activation.install.timings if activation and activation.install else None,
            "install_files": activation.install.files if activation and activation.install else None,
            "install_bytes": activation.install.bytes_written if activation and activation.install else None,
            "warmup_s": report.warmup_seconds if report else None,
            # the background start's phases, each its end in seconds from the activate() line
            "start_timeline": {k: v - t0 for k, v in activation.warmup.timeline.items()}
            if activation and activation.warmup
            else None,
            "pytree_nodes_added_after_activate": nodes_added,
            "torch": torch.__version__,
        }
    )
)
