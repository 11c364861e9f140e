"""``kernelpack verify``: prove that an artifact makes the first call of every config compile nothing.

In a fresh subprocess (:mod:`kernelpack._worker`) with an empty cache dir: install the artifact, then run every
(config, device) of its manifest in shuffled order through the canonical entry points (every graph as built)
and read torch's own counters (:mod:`kernelpack.evidence`). Passes only if, summed over all configs, there were no
FX-graph or AOTAutograd cache misses, no Triton or C++ kernel was compiled, flex_attention's dense path never ran,
and every mask_mod is the one the builder recorded.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _worker, evidence, precompiled
from . import artifact as art
from .compiled import marking
from .errors import VerifyError
from .installer import install_artifact
from .workload import (
    TOLERANCE,
    PrecompiledResult,
    check_errors,
    compare_precompiled,
    range_lengths,
    run_config,
    run_precompiled,
)


@dataclass(frozen=True, slots=True)
class VerifyReport:
    data: dict[str, Any]  # the worker's JSON report: per-config counters and time-to-first-call


class VerifyProgress:
    """Progress callbacks, no-ops here; the CLI renders them. Called in the caller's thread while the fresh process
    works: ``start`` once installed, ``config_done`` per (config, device) with its entry of the report."""

    def start(self, total: int) -> None: ...

    def config_done(self, config: dict[str, Any]) -> None: ...


def verify_artifact(
    artifact: str | os.PathLike[str],
    *,
    seed: int | None = None,
    check: bool = False,
    timeout: float = 3600.0,
    lengths: int = 20,
    progress: VerifyProgress | None = None,
) -> VerifyReport:
    """Raises :class:`VerifyError` when any config compiled something; returns the report otherwise. A dynamic range
    config is also called at both ends of its ranges and at ``lengths`` random lengths in them (not multiples of 128),
    in the same fresh process: none of these calls may trace or compile."""
    path = str(artifact)
    # fail fast, before starting torch, on a missing, truncated or corrupt file: with the artifact's own error and
    # hint, instead of the fresh process's failure ("rebuild with this torch build")
    art.check_members(path)
    seed = random.randrange(2**31) if seed is None else seed
    with tempfile.TemporaryDirectory(prefix="kernelpack-verify-") as tmp:
        # In-process compilation, so that Triton's listener and the C++ wrapper see every compile.
        env = _worker.fresh_cache_env(Path(tmp, "cache"), TORCHINDUCTOR_COMPILE_THREADS="1")
        outcome = _worker.run(
            "kernelpack.verify",
            {"artifact": os.path.abspath(path), "seed": seed, "check": check, "lengths": lengths},
            workdir=Path(tmp, "worker"),
            env=env,
            timeout=timeout,
            on_event=None if progress is None else lambda e: _deliver(progress, e),
        )
    if outcome.value is None:
        tail = f"\n{outcome.log_tail}" if outcome.log_tail else ""
        raise VerifyError(f"{path}: verification failed: {outcome.error}{tail}")
    data = outcome.value
    failures = [c for c in data["configs"] if c["reasons"]]
    if failures:
        lines = [f"{path}: {len(failures)} of {len(data['configs'])} config(s) compiled on their first call:"]
        lines += [f"- {c['describe']}: {', '.join(c['reasons'])}" for c in failures]
        raise VerifyError("\n".join(lines), failed=[c["id"] for c in failures], data=data)
    return VerifyReport(data)


def _deliver(progress: VerifyProgress, event: dict[str, Any]) -> None:
    if event["event"] == "start":
        progress.start(event["total"])
    elif event["event"] == "config_done":
        progress.config_done(event["config"])


def _verify_in_worker(payload: dict[str, Any]) -> dict[str, Any]:
    """The worker: install into the empty TORCHINDUCTOR_CACHE_DIR the parent made, then every pair's first call."""
    import torch

    path, seed, check = payload["artifact"], int(payload["seed"]), bool(payload["check"])
    n_lengths = int(payload.get("lengths", 20))
    evidence.install_hooks()
    report: dict[str, Any] = {
        "artifact": path,
        "seed": seed,
        "configs": [],
        "torch": {"version": torch.__version__, "git": torch.version.git_version},
        "triton_detection": evidence.triton_detection,
    }
    result = install_artifact(path)
    report["install_seconds"] = result.seconds
    report["installed_files"] = result.written
    pairs = result.manifest.pairs()
    random.Random(seed).shuffle(pairs)
    _worker.emit({"event": "start", "total": len(pairs)})
    tier2_off = precompiled.unavailable()
    for built, index in pairs:
        config = built.config
        device = "cpu" if config.device == "cpu" else f"cuda:{index}"
        # Tier 2 first, in this fresh process: loading and calling a precompiled function must trace and compile
        # nothing, and give tier 1's outputs
        tier2: list[tuple[PrecompiledResult, Any]] = []
        lengths = range_lengths(config, n_lengths, seed)
        entries = {graph: built.precompiled_for(index, graph) for graph in config.graphs}
        for graph, entry in entries.items():
            if entry is not None and tier2_off is None:
                path = str(Path(result.cache_dir, entry.path))
                tier2.append(run_precompiled(config, device, path, entry.sha256, graph, lengths))
        before = evidence.snapshot()
        with marking(built.marks):  # nothing is active here: the first call traces with the builder's marks
            call = run_config(config, device, check=check, lengths=lengths, free=built.mask_free)
        d = evidence.delta(before, evidence.snapshot())
        reasons = evidence.compiled_anything(d)
        tiers: dict[str, dict[str, Any]] = {}
        for graph, entry in entries.items():
            why = tier2_off if entry is not None else built.not_precompiled or "no precompiled function"
            tiers[graph] = {"tier": "inductor-cache", "why": why}
        for r, outputs in tier2:
            if not r.error:
                r = compare_precompiled(config, device, r, outputs)
            problems = [f"failed: {r.error}"] if r.error else []
            if evidence.compiled_anything(r.counters) or r.counters.get("frames.ok", 0):
                problems.append(f"traced or compiled on load ({', '.join(evidence.compiled_anything(r.counters))})")
            if r.equal is False and r.rel_error > TOLERANCE[config.dtype]:
                problems.append(f"its outputs differ from tier 1's (rel. error {r.rel_error:.2e})")
            reasons += [f"precompiled {r.graph}: {p}" for p in problems]
            tiers[r.graph] = {
                "tier": "precompiled" if not problems else "inductor-cache",
                "seconds": r.seconds,
                "equal": r.equal,
                "rel_error": r.rel_error,
                **({"why": "; ".join(problems)} if problems else {}),
            }
        retraced = call.lengths_counters.get("frames.ok", 0)
        if retraced:
            reasons.append(f"Dynamo traced {retraced} more graph(s) at other lengths of its range")
        if call.mask_key != built.mask_key:
            reasons.append(f"mask_mod computes {call.mask_key!r} here, {built.mask_key!r} in the builder")
        if call.score_key != built.score_key:
            reasons.append(f"score_mod computes {call.score_key!r} here, {built.score_key!r} in the builder")
        if check and (msg := check_errors(config, call.errors)):
            reasons.append(msg)
        report["configs"].append(
            {
                "id": config.id,
                "device": device,
                "describe": config.describe() + ("" if config.device == "cpu" else f" on {device}"),
                "seconds": call.seconds,
                "errors": call.errors,
                "counters": d,
                "lengths": [list(x) for x in call.lengths],
                "tiers": tiers,
                "reasons": reasons,
            }
        )
        _worker.emit({"event": "config_done", "config": report["configs"][-1]})
    report["totals"] = {k: sum(c["counters"][k] for c in report["configs"]) for k in evidence.snapshot()}
    report["precompiled"] = sum(t["tier"] == "precompiled" for c in report["configs"] for t in c["tiers"].values())
    report["first_step_seconds"] = sum(c["seconds"] for c in report["configs"])
    return report


if __name__ == "__main__":
    sys.exit(_worker.child_main(_verify_in_worker, sys.argv[1:]))
