"""SpecForge's own DFlash training model on the CPU: ``python specforge_job.py [--threads N] [--steps N] [--seed N]
[--artifact A --cache DIR]``. Needs SpecForge 0.2.0 (``pip install --no-deps specforge==0.2.0``) and transformers.

Each thread builds a tiny DFlash draft model as SpecForge's trainer does (``build_dflash_draft``: a Qwen3Config naming
``DFlashDraftModel``, ``config._attn_implementation = "flex_attention"``, ``AutoDraftModel.from_config``) and wraps it
in SpecForge's ``OnlineDFlashModel`` (``attention_backend="flex_attention"``), with a random lm_head and embedding
standing in for the target model's. Every step runs that model's forward under ``torch.no_grad()`` (compiled flex has
no backward on the CPU) at a new random context length: SpecForge samples the anchors, builds its DFlash BlockMasks
with ``create_dflash_block_mask`` (one sliding, one full) and its attention calls
``ALL_ATTENTION_FUNCTIONS["flex_attention"]``. None of SpecForge's code is changed.

The job adds kernelpack's two lines: it routes that name through kernelpack (``register(takeover=True)``, also
while ``kernelpack record`` runs it, so that record sees every call, not only the ones Dynamo compiles) and, with
``--artifact``, activates the artifact. ``--as-shipped``: neither, transformers' own ``torch.compile(flex_attention)``
as SpecForge ships it. It prints one JSON line, with the fields of drafter_job.py."""

from __future__ import annotations

import argparse
import random
import threading
import time

import torch
from job_report import print_report
from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
from specforge.modeling.auto import AutoDraftModel
from torch import nn
from transformers import Qwen3Config

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--artifact")
ap.add_argument("--cache")
ap.add_argument("--as-shipped", action="store_true", help="transformers' own flex_attention, no kernelpack")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--context", default="200:700", help="MIN:MAX of the random context length")
ap.add_argument("--size", default="64,4,2,16,16,16,128", help="hidden,heads,kv_heads,head_dim,anchors,block,window")
args = ap.parse_args()
hidden, heads, kv_heads, head_dim, anchors, block, window = map(int, args.size.split(","))
lo, hi = map(int, args.context.split(":"))
vocab, target_layers = 256, 8
start = time.perf_counter()
activation = None
if not args.as_shipped:  # the two lines a SpecForge job adds (after importing the model's code)
    from kernelpack import runtime
    from kernelpack.integrations.transformers import register

    register(takeover=True)  # SpecForge keeps attn_implementation="flex_attention": serve that name
    if args.artifact:
        activation = runtime.activate(args.artifact, cache_dir=args.cache)
activated = time.perf_counter() - start
frames_before = torch._dynamo.utils.counters["frames"]["ok"]


def draft_config() -> Qwen3Config:
    """A tiny DFlash draft config, as a draft-config JSON would give it: one sliding layer, one full layer."""
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        use_sliding_window=True,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"],
        architectures=["DFlashDraftModel"],
    )
    config.block_size = block
    config.num_target_layers = target_layers
    config._attn_implementation = "flex_attention"  # specforge.algorithms.model_providers.build_dflash_draft
    return config


rng = random.Random(args.seed)
contexts = [[rng.randint(lo, hi) for _ in range(args.steps)] for _ in range(args.threads)]
first_step_done: list[float] = []
step_seconds: list[float] = []  # every step after each thread's first
errors: list[str] = []


def run(i: int) -> None:
    try:
        torch.manual_seed(i)
        draft = AutoDraftModel.from_config(draft_config(), torch_dtype=torch.float32)
        model = OnlineDFlashModel(
            draft_model=draft,
            target_lm_head=nn.Linear(hidden, vocab, bias=False),
            target_embed_tokens=nn.Embedding(vocab, hidden),
            mask_token_id=vocab - 1,
            block_size=block,
            attention_backend="flex_attention",
            num_anchors=anchors,
        ).eval()
        features = len(draft.target_layer_ids) * hidden
        for step, s in enumerate(contexts[i]):
            began = time.perf_counter()
            input_ids = torch.randint(0, vocab - 1, (1, s))
            target_hidden = torch.randn(1, s, features)
            loss_mask = torch.ones(1, s)
            with torch.no_grad():
                loss, _, _ = model(input_ids=input_ids, hidden_states=target_hidden, loss_mask=loss_mask)
            if not torch.isfinite(loss):
                raise RuntimeError(f"loss {loss.item()} at context {s}")
            if step == 0:
                first_step_done.append(time.perf_counter() - start)
            else:
                step_seconds.append(time.perf_counter() - began)
    except Exception as e:  # reported, not raised: the job's line says what failed
        errors.append(f"thread {i}: {type(e).__name__}: {e}"[:2000])


threads = [threading.Thread(target=run, args=(i,)) for i in range(args.threads)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print_report(
    threads=args.threads,
    contexts=contexts,
    errors=errors,
    first_step_done=first_step_done,
    step_seconds=step_seconds,
    activated=activated,
    frames_before=frames_before,
    activation=activation,
)
