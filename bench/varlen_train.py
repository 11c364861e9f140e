"""A training loop whose batch length changes every step: the transformers causal LM of
bench/transformers_step.py (Mistral architecture: GQA 32/8, D=128, sliding window 1024, bf16, 2 layers), one batch
of a random length in [--min, --max] per step (the same seeded lengths in every arm), forward + backward.

Arms (one fresh process each; the driver, bench/h200.sh varlen-bg, runs them side by side):
  kernelpack  runtime.activate(artifact), attn_implementation="kernelpack". A bucketed artifact: each batch padded at
              the end to runtime.padded_length(n), labels -100 on the padding (causal: no real token sees it). A
              dynamic one: the batch as it is.
  cold        attn_implementation="flex_attention" (transformers' own torch.compile), the cache dir empty: what a job
              pays without kernelpack (each new length a new graph); capped by --steps / --time-limit.

The clock starts after `import torch`, transformers and CUDA init; it covers activate() (install + warm-up), building
the model, and each step (synchronized). Prints one JSON line.

    python bench/varlen_train.py --write-recipe r.toml --multiple 512     # buckets; without --multiple: dynamic
    kernelpack build r.toml -o out --jobs 8
    python bench/varlen_train.py --artifact out/*.kpack --steps 50
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import random
import signal
import statistics
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--artifact")
ap.add_argument("--mode", choices=("kernelpack", "cold"), default="kernelpack")
ap.add_argument("--steps", type=int, default=50)
ap.add_argument("--min", type=int, default=1024)
ap.add_argument("--max", type=int, default=16384)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--time-limit", type=float, default=1e9, help="stop after the step that passes this many seconds")
ap.add_argument("--dump-every", type=float, help="dump every thread's stack to stderr every S seconds (a stuck step)")
ap.add_argument("--write-recipe", help="write the recipe of this model for the range, then exit")
ap.add_argument("--multiple", type=int, help="with --write-recipe: buckets of this multiple (else one dynamic graph)")
ap.add_argument("--graphs", default="fwd+bwd")
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--device", default="cuda")
ap.add_argument("--forward-only", action="store_true", help="no backward (compiled flex has none on CPU)")
args = ap.parse_args()

import torch  # noqa: E402
from transformers import MistralForCausalLM  # noqa: E402  the model's code before activate()
from transformers_step import config  # noqa: E402

from kernelpack import evidence, runtime  # noqa: E402
from kernelpack.integrations import transformers as hf  # noqa: E402

cfg = config(args.tiny)
if args.write_recipe:
    lengths = {"min": args.min, "max": args.max, **({"multiple": args.multiple} if args.multiple else {})}
    kind = f"b{args.multiple}" if args.multiple else "dyn"
    text = hf.recipe_for(
        cfg,
        seq_lens=lengths,
        device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        graphs=args.graphs.split(","),
        name=f"mistral-varlen-{kind}",
    )
    with open(args.write_recipe, "w") as f:
        f.write(text)
    print(text)
    sys.exit(0)

device = args.device
if device == "cuda":
    torch.cuda.init()
evidence.install_hooks()
evidence.watch_compiles()
t0 = time.perf_counter()
padded = False
if args.mode == "kernelpack":
    activation = runtime.activate(args.artifact)
    padded = all(c.config.q_range is None for c in activation.manifest.configs)  # buckets: pad to them
activate_s = time.perf_counter() - t0
cfg._attn_implementation = "kernelpack" if args.mode == "kernelpack" else "flex_attention"
if args.mode == "kernelpack":
    hf.register()
torch.manual_seed(0)
with torch.device(device):
    model = MistralForCausalLM(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32).train()
model_s = time.perf_counter() - t0 - activate_s
rng = random.Random(args.seed)
mark = evidence.next_seq()
steps = []
interrupted = None  # the seconds a step had run when SIGTERM (e.g. `timeout`) stopped it


def _stop(signum: int, frame: object) -> None:
    faulthandler.dump_traceback(all_threads=True)  # where the step was when it was stopped (stderr)
    raise KeyboardInterrupt


# A cold arm can spend minutes in one step's compiles: `timeout` sends SIGTERM, and the summary still prints, with
# the step it stopped (each finished step is also printed to stderr as it ends).
signal.signal(signal.SIGTERM, _stop)
if args.dump_every:  # a C-level watchdog: it dumps even while the main thread is inside a long C call
    faulthandler.dump_traceback_later(args.dump_every, repeat=True)
for _ in range(args.steps):
    n = rng.randint(args.min, args.max)
    length = runtime.padded_length(n) if padded else n
    ids = torch.randint(0, cfg.vocab_size, (1, length), device=device)
    labels = ids.clone()
    labels[:, n:] = -100  # the padding: no loss; causal attention keeps it out of the real tokens
    before = evidence.next_seq()
    start = time.perf_counter()
    try:
        if args.forward_only:
            with torch.no_grad():
                model(ids, labels=labels, use_cache=False)
        else:
            model(ids, labels=labels, use_cache=False).loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
    except KeyboardInterrupt:
        interrupted = {"n": n, "len": length, "s": round(time.perf_counter() - start, 1)}
        break
    seconds = time.perf_counter() - start
    records = evidence.compile_records(before)
    misses = sum(r.missed for r in records)
    # kernelpack's lazy loads (tagged "kernelpack load": cache hits only) are not the job's compiles
    compiled = sum(r.tag is None for r in records)
    steps.append({"n": n, "len": length, "s": round(seconds, 4), "compiles": compiled, "misses": misses})
    print(json.dumps(steps[-1]), file=sys.stderr, flush=True)
    if time.perf_counter() - t0 > args.time_limit:
        break
records = evidence.compile_records(mark)
steady = [s["s"] for s in steps[1:]]
print(
    json.dumps(
        {
            "mode": args.mode,
            "artifact": args.artifact,
            "padded": padded,
            "activate_s": round(activate_s, 3),
            "model_s": round(model_s, 3),
            "first_step_s": steps[0]["s"] if steps else None,
            "to_first_step_done_s": round(activate_s + model_s + steps[0]["s"], 3) if steps else None,
            "steady_median_s": round(statistics.median(steady), 4) if steady else None,
            "steps_run": len(steps),
            "interrupted_step": interrupted,
            "compiles_in_steps": sum(r.tag is None for r in records),
            "kernelpack_loads_in_steps": sum(r.tag is not None for r in records),
            "misses_in_steps": sum(r.missed for r in records),
            "tokens": sum(s["n"] for s in steps),
            "padded_tokens": sum(s["len"] - s["n"] for s in steps),
            "report": runtime.report().summary() if args.mode == "kernelpack" else None,
            "served": runtime.report().to_dict()["served"] if args.mode == "kernelpack" else None,
            "steps": steps,
            "torch": torch.__version__,
        }
    )
)
