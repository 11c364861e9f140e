"""A user's job: ``python train.py MODE [--artifact A --cache DIR]``. Runs forward passes at two lengths (the
transformers model: one) and prints one JSON line: what kernelpack's report says, when an artifact was activated.

MODE: block (user_model.Attention through kernelpack.flex_attention), own (the same block through the user's own
torch.compile(flex_attention)), transformers (a tiny Mistral with attn_implementation="kernelpack"), documents (a
mask over a tensor), script (a mask defined in this script: the builder cannot import it)."""

from __future__ import annotations

import argparse
import json

import torch
import user_model

import kernelpack
from kernelpack import runtime

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["block", "own", "transformers", "documents", "script"])
ap.add_argument("--artifact")
ap.add_argument("--cache")
args = ap.parse_args()
if args.mode == "transformers":
    from transformers import MistralConfig, MistralForCausalLM  # the model's code before activate()
if args.artifact:
    runtime.activate(args.artifact, cache_dir=args.cache)
torch.manual_seed(0)
with torch.no_grad():
    if args.mode in ("block", "own"):
        flex = kernelpack.flex_attention if args.mode == "block" else user_model.own_compiled_flex()
        block = user_model.Attention(flex)
        for n in (256, 512):
            block(torch.randn(1, n, 64))
    elif args.mode == "transformers":
        config = MistralConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=64,
            max_position_embeddings=512,
        )
        config._attn_implementation = "kernelpack"
        if not args.artifact:
            from kernelpack.integrations import transformers as hf

            hf.register()  # activate() does it when it runs
        model = MistralForCausalLM(config).eval()
        model(torch.randint(0, 128, (1, 256)), use_cache=False)
    elif args.mode == "script":
        from torch.nn.attention.flex_attention import create_block_mask

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        q = torch.randn(1, 2, 256, 16)
        mask = create_block_mask(causal, None, None, 256, 256, device="cpu")
        kernelpack.flex_attention(q, q.clone(), q.clone(), block_mask=mask)
    else:
        q = k = v = torch.randn(1, 2, 256, 16)
        doc_ids = torch.arange(256) // 100
        from torch.nn.attention.flex_attention import create_block_mask

        mask = create_block_mask(user_model.documents(doc_ids), None, None, 256, 256, device="cpu")
        kernelpack.flex_attention(q, k, v.clone(), block_mask=mask)
if args.artifact:
    rep = runtime.report()
    print(
        json.dumps(
            {
                "missed": len(rep.misses),
                "refused": [why for _, why in rep.refused],
                "paths": sorted({c["path"] for c in rep.to_dict()["compiles"]}),
                "summary": rep.summary(),
            }
        )
    )
