"""Issue 18 (work in progress): tier 2's mechanism on CPU torch: aot_compile of the canonical forward, its bytes,
loaded again in a fresh process with the tier-1 cache, bitwise equal and with no Dynamo frame."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernelpack import precompiled

SCRIPT = """
import json, sys, time, torch
from torch._dynamo.utils import counters
from kernelpack import precompiled
from kernelpack.canonical import arguments, make_inputs
from kernelpack.masks import block_mask_for
from kernelpack.recipe import load_recipe
config = load_recipe(sys.argv[1]).configs[0]
inputs = make_inputs(config, "cpu", "fwd")
args = arguments(config, inputs, block_mask_for(config, "cpu"))
with torch.no_grad():
    ref = torch.compile(torch.nn.attention.flex_attention.flex_attention, dynamic=False)(**args)
if sys.argv[2] == "save":
    fn = precompiled.compile_call(args, grad=False)
    open(sys.argv[3], "wb").write(precompiled.dumps(fn))
    torch.save(ref, sys.argv[3] + ".ref")
else:
    frames = counters["frames"]["ok"]
    t = time.perf_counter()
    fn = precompiled.loads(open(sys.argv[3], "rb").read())
    with torch.no_grad():
        out = fn(**args)
    print(json.dumps({"seconds": time.perf_counter() - t, "frames": counters["frames"]["ok"] - frames,
                      "equal": bool(torch.equal(out, torch.load(sys.argv[3] + ".ref")))}))
"""


@pytest.mark.skipif(precompiled.unavailable() is not None, reason="no aot_compile in this torch")
def test_a_precompiled_forward_loads_in_a_fresh_process_and_runs_without_dynamo(tmp_path: Path) -> None:
    recipe = Path(__file__).parent.parent / "recipes" / "smoke-cpu.toml"
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    root = str(Path(__file__).parent.parent)  # this checkout's kernelpack, whatever is installed
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": root}
    blob = tmp_path / "fn.bin"
    subprocess.run([sys.executable, str(script), str(recipe), "save", str(blob)], env=env, check=True, timeout=600)
    proc = subprocess.run(
        [sys.executable, str(script), str(recipe), "load", str(blob)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["equal"] and out["frames"] == 0, out
