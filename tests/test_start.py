"""A job's start grows with what it calls, not with what the artifact ships. activate() of a 16-bucket
artifact costs what a 2-bucket one of the same call costs, from the activate() line to the end of its background
start: one precompiled function is loaded and called in the warm-up (what every load imports is paid there), the
others load at their signature's first call."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
from conftest import SMOKE, run_json

from kernelpack import precompiled
from kernelpack.artifact import merge
from kernelpack.build import build_recipe

ACTIVATE = """
import json, sys, tempfile, time, torch
from kernelpack import runtime
torch.set_num_threads(2)  # the builder's count
with tempfile.TemporaryDirectory() as cache:  # a fresh node: the install is part of it
    t = time.perf_counter()
    activation = runtime.activate(sys.argv[1], cache_dir=cache)
    returned = time.perf_counter() - t
    activation.wait()  # the whole start: the background start's install, imports and warm-up too
    seconds = time.perf_counter() - t
    install = activation.install
    print(json.dumps({"seconds": seconds, "returned": returned, "loaded": len(activation.warmup.precompiled),
                      "lazy": len(activation.warmup.lazy), "signatures": len(activation.covered),
                      "files": install.written, "bytes": install.bytes_written, "artifact_files": install.files}))
"""


def _recipe(tmp_path: Path, lengths: list[int]) -> Path:
    text = SMOKE.read_text()
    text = text.replace('name = "smoke-cpu"', f'name = "start-{len(lengths)}"')
    text = text.replace("windows = [64, 128]", "windows = [64]")
    path = tmp_path / f"start-{len(lengths)}.toml"
    path.write_text(text.replace("seq_len = [256]", f"seq_len = {lengths}"))
    return path


# manual: 16 configs compile, 575 s of CI's 90 minutes beside the other stream (2026-12-02), a tenth of its budget.
# CI keeps what makes it so: test_precompiled's lazy loads (activate() loads one function, the rest at their first
# call). Run it with `python -m pytest -m manual tests/test_start.py` (about 4 minutes on 2 cores).
@pytest.mark.manual
@pytest.mark.skipif(precompiled.unavailable() is not None, reason="no aot_compile in this torch")
def test_activate_of_16_buckets_costs_what_2_buckets_cost(tmp_path: Path) -> None:
    """Medians of 3 fresh processes each, alternated (6 more each if the first medians are past the bound: the CI
    machine runs another test stream beside this one): within 1.1x. Before lazy loads, 5.18 s vs 3.88 s (1.33x);
    with KERNELPACK_LOAD=eager on this machine 6.39 s vs 5.59 s (1.14x)."""
    # The 16 buckets built as CI builds them, in 8 shards of 2 (kernelpack merge): one shard is the 2-bucket artifact
    # of the same call, so 16 configs compile rather than 18 (CI's clock: each costs ~25 s beside the other stream).
    recipe = _recipe(tmp_path, [256 + 64 * i for i in range(16)])
    shards = []
    for i in range(1, 9):
        built = build_recipe(recipe, tmp_path / "shards", jobs=2, shard=(i, 8))
        assert built.artifact is not None and not built.failed
        shards.append(built.artifact)
    merged, _ = merge(shards, tmp_path / "merged")
    artifacts = {2: shards[0], 16: merged}
    runs: dict[int, list[dict]] = {2: [], 16: []}

    def sample(times: int) -> float:
        for _ in range(times):
            for n in (2, 16):
                runs[n].append(run_json([sys.executable, "-c", ACTIVATE, str(artifacts[n])]))
        return statistics.median(r["seconds"] for r in runs[16]) / statistics.median(r["seconds"] for r in runs[2])

    ratio = sample(3)
    if ratio > 1.1:
        ratio = sample(6)
    # what makes it so, whatever the clock says: one function loaded, the others waiting for their first call
    assert all((r["signatures"], r["loaded"], r["lazy"]) == (16, 1, 15) for r in runs[16]), runs[16]
    assert all((r["signatures"], r["loaded"], r["lazy"]) == (2, 1, 1) for r in runs[2]), runs[2]
    # and one installed the files of the signature it loaded, not the artifact's: as many as the 2-bucket start
    # wrote (the one bucket's own, and those every bucket's worker wrote), of 8 times as many in the artifact
    files = {n: {(r["files"], r["bytes"]) for r in rs} for n, rs in runs.items()}
    assert len(files[16]) == 1 and files[16] == files[2], files
    assert runs[16][0]["artifact_files"] > 4 * runs[16][0]["files"], runs[16][0]
    assert ratio <= 1.1, {n: [round(r["seconds"], 2) for r in rs] for n, rs in runs.items()}
