"""Time to first training step of an HF-style attention block (bench/hf_block.py) over every config of an artifact
built for it (recipes/dflash-drafter-bshd.toml), side by side in one run, each sample a fresh subprocess:

  (a) cold       the user's own torch.compile(flex_attention), empty TORCHINDUCTOR_CACHE_DIR
  (b) warm       the same, with the cache dir (a) filled: torch's native warm start
  (c) mega       the same, after torch.compiler.load_cache_artifacts() of the blob (a) saved, into an empty dir
  (d) kernelpack runtime.activate(artifact) into an empty dir (install + warm-up included), the block calling
                 kernelpack.flex_attention

A step is one forward + backward of the block per config, its BlockMask built by torch's create_block_mask from the
user's own mask. first_step = preparation + the first step of every config, synchronized; second_step = the next.
Import of torch and CUDA init are excluded for all four alike. Compiles are counted from torch's per-compile records
(kernelpack.evidence): in (d) the step must compile nothing.

    python bench/user_block.py --artifact out/dflash-drafter-bshd-....kpack --repeats 3 --out user_block.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def child(mode: str, cache_dir: str, artifact: str, blob: str, result: str) -> None:
    import hf_block
    import torch

    from kernelpack import evidence, runtime
    from kernelpack.artifact import read_manifest

    configs = [c.config for c in read_manifest(artifact).configs]
    device = "cuda:0" if configs[0].device == "cuda" else "cpu"
    train = all(c.backward for c in configs)
    if device != "cpu":
        torch.cuda.init()
        torch.zeros(1, device=device)
    evidence.install_hooks()
    evidence.watch_compiles()
    mark = evidence.next_seq()
    t0 = time.perf_counter()
    if mode == "kernelpack":
        runtime.activate(artifact, cache_dir=cache_dir)
        flex = runtime.flex_attention
    else:
        if mode == "mega":
            torch.compiler.load_cache_artifacts(Path(blob).read_bytes())
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention)
    prep = time.perf_counter() - t0
    step_mark = evidence.next_seq()

    def step() -> list[float]:
        seconds = []
        for c in configs:
            s = time.perf_counter()
            block = hf_block.Attention(c, flex, device)
            x = hf_block.hidden_states(c, device)
            mask = hf_block.block_mask(c, device)  # rebuilt every step, as the drafters do
            with torch.set_grad_enabled(train):
                out = block(x, mask)
            if train:
                out.float().square().mean().backward()
            if device != "cpu":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - s)
        return seconds

    first = step()
    second = step()
    compiles = evidence.compile_records(step_mark)
    out = {
        "mode": mode,
        "prep": prep,
        "first_step": prep + sum(first),
        "first_step_calls": first,
        "second_step": sum(second),
        "compiles_in_steps": len(compiles),
        "misses_in_steps": sum(r.missed for r in compiles),
        "fx_misses_in_steps": sum(r.fx_misses or 0 for r in compiles),
        "fx_hits_in_steps": sum(r.fx_hits or 0 for r in compiles),
        "compiles_in_prep": len(evidence.compile_records(mark)) - len(compiles),
        "torch": torch.__version__,
        "git": torch.version.git_version,
    }
    if mode == "kernelpack":
        out["report"] = runtime.report().summary()
    if mode == "cold":
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            Path(blob).write_bytes(saved[0])
    Path(result).write_text(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="user_block.json")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    import warm_start  # the same fresh-process protocol and table

    warm_start.step_table(
        warm_start.side_by_side(
            __file__, args.artifact, ["cold", "warm", "mega", "kernelpack"], args.repeats, args.timeout, args.out
        ),
        args.out,
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":  # warm_start's protocol: mode, cache, artifact, blob, result
        child(*sys.argv[2:7])
    else:
        main()
