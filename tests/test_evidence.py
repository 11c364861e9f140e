"""The counters kernelpack proves things with, exercised on real torch behaviour (CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import run_json

CODE = """
import json, sys, torch
from kernelpack import evidence
evidence.install_hooks(refuse_dense=sys.argv[1] == 'refuse')
from torch.nn.attention.flex_attention import flex_attention
from kernelpack.masks import sliding_window, block_mask
import kernelpack, kernelpack.errors
q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
bm = block_mask(sliding_window(32), 128, 128, 'cpu')
out = {}
s = evidence.snapshot()
try:
    flex_attention(q, k, v, block_mask=bm)  # not compiled: the dense math path
except kernelpack.errors.DenseFallbackError as e:
    out['refused'] = str(e)
out['eager'] = evidence.delta(s, evidence.snapshot())
s = evidence.snapshot()
kernelpack.flex_attention(q, k, v, block_mask=bm)
out['compiled'] = evidence.delta(s, evidence.snapshot())
print(json.dumps(out))
"""


def run(tmp_path: Path, mode: str) -> dict:
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    return run_json([sys.executable, "-c", CODE, mode], env=env)


def test_dense_path_and_cold_compile_are_seen_then_a_warm_start_is_clean(tmp_path: Path) -> None:
    from kernelpack.evidence import compiled_anything

    cold = run(tmp_path, "count")
    assert cold["eager"]["dense_calls"] == 1 and cold["eager"]["dense_bytes"] == 1 * 2 * 128 * 128 * 4
    assert cold["compiled"]["dense_calls"] == 0  # tracing runs the dense impl on fake tensors: not counted
    assert cold["compiled"]["inductor.fxgraph_cache_miss"] == 1 and cold["compiled"]["cpp_compiled"] > 0
    assert compiled_anything(cold["compiled"])
    warm = run(tmp_path, "count")
    assert warm["compiled"]["inductor.fxgraph_cache_hit"] == 1 and compiled_anything(warm["compiled"]) == []


def test_refuse_dense_raises_with_the_score_memory(tmp_path: Path) -> None:
    out = run(tmp_path, "refuse")
    assert "dense math path" in out["refused"] and "of float32 scores" in out["refused"]


NO_ACTIVATE = """
import json, torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from kernelpack.runtime import report
q, k, v = (torch.randn(1, 1, 128, 16) for _ in range(3))  # one buffer for all three: not on 2.11's CPU template
mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 128, 128, device="cpu")
torch.compile(flex_attention)(q, k, v, block_mask=mask)  # no activate(): kernelpack watched nothing of this
print(json.dumps({"summary": report().summary(), "unseen": report().unseen}))
"""


def test_the_report_never_says_0_for_a_process_that_compiled(tmp_path: Path) -> None:
    """report() said "0 of 0 compiles missed" for a process that compiled before kernelpack watched (the
    README's first example at an uncovered shape). It says what torch counted and it has no record of."""
    out = run_json([sys.executable, "-c", NO_ACTIVATE], env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "c")})
    assert out["unseen"] and "FX-graph cache misses that have no record here" in out["unseen"][0], out
    assert "[not seen here: torch counted " in out["summary"], out["summary"]
