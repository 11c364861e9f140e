"""The one JSON line drafter_job.py and specforge_job.py print at the end: what the steps saw and, with an artifact,
what kernelpack's report says (misses, refusals, compiles, dense calls, the warm-up and which tiers served)."""

from __future__ import annotations

import json
from typing import Any

import torch


def print_report(
    *,
    threads: int,
    contexts: list[list[int]],
    errors: list[str],
    first_step_done: list[float],
    step_seconds: list[float],
    activated: float,
    frames_before: int,
    activation: Any,
    start: float | None = None,
) -> None:
    steady = sorted(step_seconds)
    out: dict[str, Any] = {
        "contexts": contexts,
        "errors": errors,
        "first_step_seconds": max(first_step_done, default=None) if len(first_step_done) == threads else None,
        "activate_seconds": activated,
        "steady_step_seconds": steady[len(steady) // 2] if steady else None,
        "frames_compiled": torch._dynamo.utils.counters["frames"]["ok"] - frames_before,
    }
    if activation is not None:
        from kernelpack import runtime

        rep = runtime.report()
        d = rep.to_dict()
        out.update(
            missed=len(rep.misses),
            refused=[why for _, why in rep.refused],
            compiled=len(rep.compiled),
            dense=len(d["dense"]),
            warmup_seconds=d["warmup_seconds"],
            install_seconds=getattr(activation.install, "seconds", None),
            warm_calls=[(c["tier"], round(c["seconds"], 2)) for c in d["first_calls"] if c["warmup"]],
            # the job's own first calls: each a precompiled function's lazy load and first run (target: <= 0.05 s)
            later_first_calls=[round(c["seconds"], 4) for c in d["first_calls"] if not c["warmup"]],
            install_phases={k: round(v, 3) for k, v in getattr(activation.install, "timings", {}).items()},
            start_error=d["start_error"],
            served=sorted({s["tier"] for s in d["served"]}),
        )
        warm = activation.warmup
        if start is not None and warm is not None and warm.timeline:
            # the background start's phases, each its end in seconds from the clock's start (the activate() line)
            out["start_timeline"] = {k: round(v - start, 3) for k, v in warm.timeline.items()}
    print(json.dumps(out))
