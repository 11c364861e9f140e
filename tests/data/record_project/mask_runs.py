"""``python mask_runs.py ARTIFACT CACHE``: how often kernelpack runs the Python of the job's own mask while it serves
calls. The drafter's mask is rebuilt every step at a new context length (a closure int its dynamic graph keeps
symbolic), so anything kernelpack computes per mask object it computes every step: a served call should read the
mask's code and closure, never run it (torch's create_block_mask runs it, the compiled kernel does not). Prints one
JSON line: the mask's Python calls during create_block_mask and during the served flex calls, and the report's
refusals and compiles."""

from __future__ import annotations

import json
import sys

import drafter
import torch
from torch.nn.attention.flex_attention import create_block_mask

import kernelpack
from kernelpack import runtime

runtime.activate(sys.argv[1], cache_dir=sys.argv[2]).wait()
# every mask the drafter makes runs this one code object, whatever it closes over
code = drafter.anchored_mask(torch.zeros(1, 16, dtype=torch.long), torch.ones(1, 16), 1, 16, None).__code__
runs = [0]


def count(frame, event, arg):  # this thread's profiler hook: a call into the mask's code object is a run of it
    if event == "call" and frame.f_code is code:
        runs[0] += 1


built, served = 0, 0
for s in (300, 411, 529, 650):  # lengths the recorded job did not see (drafter_job.py's seed-0 draws differ)
    anchors, keep = torch.randint(0, s, (1, 16)), torch.ones(1, 16, dtype=torch.bool)
    # laid out as the drafter's projections are (bshd views): the layout is part of the call
    q = torch.randn(1, 256, 4, 16).transpose(1, 2)
    k, v = (torch.randn(1, s + 256, 2, 16).transpose(1, 2) for _ in range(2))
    for window in (128, None):
        fn = drafter.anchored_mask(anchors, keep, s, 16, window)
        runs[0] = 0
        sys.setprofile(count)
        mask = create_block_mask(fn, 1, None, 256, s + 256, device="cpu")
        built += runs[0]
        runs[0] = 0
        with torch.no_grad():
            kernelpack.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
            kernelpack.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)  # a checkpoint's recompute
        sys.setprofile(None)
        served += runs[0]
rep = runtime.report()
print(json.dumps({"built": built, "served": served, "refused": len(rep.refused), "compiled": len(rep.compiled)}))
