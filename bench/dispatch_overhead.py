"""What a served call costs beside its kernel: the DFlash-shaped drafter (tests/data/record_project/drafter.py) at
its CPU size, one thread, forward only, a new context length (and so a new mask function) every step, through
kernelpack.flex_attention or torch's own compiled flex_attention (warm: the first 5 steps are not timed).

    cd tests/data/record_project && PYTHONPATH=. kernelpack record -o /tmp/d.toml -- python drafter_job.py --threads 2
    kernelpack build /tmp/d.toml -o /tmp/d
    python bench/dispatch_overhead.py /tmp/d/drafter-*.kpack kernelpack|torch [STEPS] [--profile]

Prints the mean step and the mean flex call in ms (``--profile``: what kernelpack's serving calls, by cProfile;
``--parts``: the median time of each part of a served call, unprofiled, timed by wrapping each part: the served
call beside the loaded function's own call is kernelpack's cost).
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

# the parts of a served call (kernelpack.runtime.serving.serve) that --parts times, as (module, attribute); a part
# an older checkout lacks is skipped
PARTS = [
    ("kernelpack.runtime.serving", "serve"),
    ("kernelpack.runtime.dispatch", "_serve"),  # a checkout before the serving chain
    ("kernelpack.runtime.calls", "resolve_call"),
    ("kernelpack.runtime.calls", "normalized"),
    ("kernelpack.runtime.dispatch", "resolve_call"),
    ("kernelpack.runtime.dispatch", "call_signature"),  # before resolve_call
    ("kernelpack.runtime.serving", "precompiled_function"),
    ("kernelpack.runtime.dispatch", "precompiled_function"),
    ("kernelpack.runtime.serving", "runs_warmed_code"),
    ("kernelpack.runtime.dispatch", "runs_warmed_code"),
    ("kernelpack.runtime.serving", "wait_for_foreign_fx_trace"),
    ("kernelpack.runtime.dispatch", "wait_for_foreign_fx_trace"),
    ("kernelpack.runtime.serving", "_count_served"),
    ("kernelpack.runtime.dispatch", "_count_served"),
    ("kernelpack.runtime.calls", "mask_keys"),
    ("kernelpack.runtime.session", "mask_keys"),
    ("kernelpack.runtime.calls", "signature_of"),
    ("kernelpack.runtime.session", "signature_of"),
    ("kernelpack._torch.aot:Loaded", "serves"),
    ("kernelpack._torch.aot:Loaded", "__call__"),
]


def time_parts() -> dict[str, list[float]]:
    """Wrap each of PARTS that this checkout has with a timer; the seconds of each call, by part."""
    import importlib

    spent: dict[str, list[float]] = {}

    def wrap(owner: object, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: object, **kwargs: object) -> object:
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent.setdefault(label, []).append(time.perf_counter() - t)

        setattr(owner, name, timed)

    for where, name in PARTS:
        module, _, cls = where.partition(":")
        try:
            imported = importlib.import_module(module)
        except ImportError:  # a module this checkout does not have
            continue
        owner = getattr(imported, cls) if cls else imported
        if hasattr(owner, name):
            wrap(owner, name, f"{cls or module.rsplit('.', 1)[-1]}.{name}")
    return spent


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
    parts = time_parts() if "--parts" in sys.argv and mode == "kernelpack" else None
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
    if parts is not None:
        import statistics

        for label, seconds in sorted(parts.items(), key=lambda kv: -statistics.median(kv[1])):
            print(f"  {label:32s} median {statistics.median(seconds) * 1e6:8.1f} us  ({len(seconds)} calls)")
    if profile:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_callees("_serve")
        print(text.getvalue())


if __name__ == "__main__":
    main()
