"""What a served call costs beside its kernel: the DFlash-shaped drafter (tests/data/record_project/drafter.py) at
its CPU size, one thread, forward only, a new context length (and so a new mask function) every step, through
kernelpack.flex_attention or torch's own compiled flex_attention (warm: the first 5 steps are not timed).

    cd tests/data/record_project && PYTHONPATH=. kernelpack record -o /tmp/d.toml -- python drafter_job.py --threads 2
    kernelpack build /tmp/d.toml -o /tmp/d
    python bench/dispatch_overhead.py /tmp/d/drafter-*.kpack kernelpack|torch [STEPS] [--profile]

Prints the mean step and the mean flex call in ms (``--profile``: what kernelpack's serving calls, by cProfile).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "data" / "record_project"))
import drafter
import torch

import kernelpack
from kernelpack import runtime


def main() -> None:
    artifact, mode = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3].isdigit() else 60
    if mode == "kernelpack":
        runtime.activate(artifact, cache_dir=tempfile.mkdtemp(prefix="kp-overhead-")).wait()
        flex = kernelpack.flex_attention
    else:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention)
    spent = [0.0, 0]

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = flex(*args, **kwargs)
        spent[0] += time.perf_counter() - t
        spent[1] += 1
        return out

    model = drafter.Drafter(64, 4, 2, 16, 128, timed)
    rng = random.Random(0)

    def step() -> None:
        s = rng.randint(240, 700)
        anchors, keep = torch.randint(0, s, (1, 16)), torch.rand(1, 16) > 0.1
        with torch.no_grad():
            model(torch.randn(1, 256, 64), torch.randn(1, s, 64), anchors, keep)

    for _ in range(5):
        step()
    spent[:] = [0.0, 0]
    profile = cProfile.Profile() if "--profile" in sys.argv else None
    start = time.perf_counter()
    if profile:
        profile.enable()
    for _ in range(steps):
        step()
    if profile:
        profile.disable()
    total = time.perf_counter() - start
    print(f"{mode}: step {total / steps * 1e3:.2f} ms, flex call {spent[0] / spent[1] * 1e3:.3f} ms ({spent[1]} calls)")
    if profile:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_callees("_serve")
        print(text.getvalue())


if __name__ == "__main__":
    main()
