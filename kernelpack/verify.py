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
from pathlib import Path
from typing import Any

from . import _worker, evidence, precompiled
from . import artifact as art
from .compiled import marking
from .errors import VerifyError
from .installer import install_artifact
from .records import GraphTier, VerifiedConfig, VerifyReport
from .workload import (
    TOLERANCE,
    PrecompiledResult,
    check_errors,
    compare_precompiled,
    range_lengths,
    run_config,
    run_precompiled,
)


class VerifyProgress:
    """Progress callbacks, no-ops here; the CLI renders them. Called in the caller's thread while the fresh process
    works: ``start`` once installed, ``config_done`` per (config, device) with its entry of the report."""

    def start(self, total: int) -> None: ...

    def config_done(self, config: VerifiedConfig) -> None: ...


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
    report = VerifyReport.from_dict(outcome.value)
    failures = report.failures
    if failures:
        lines = [f"{path}: {len(failures)} of {len(report.configs)} config(s) compiled on their first call:"]
        lines += [f"- {c.describe}: {', '.join(c.reasons)}" for c in failures]
        raise VerifyError("\n".join(lines), failed=[c.id for c in failures], report=report)
    return report


def _deliver(progress: VerifyProgress, event: dict[str, Any]) -> None:
    if event["event"] == "start":
        progress.start(event["total"])
    elif event["event"] == "config_done":
        progress.config_done(VerifiedConfig.from_dict(event["config"]))


def _verify_in_worker(payload: dict[str, Any]) -> dict[str, Any]:
    """The worker: install into the empty TORCHINDUCTOR_CACHE_DIR the parent made, then every pair's first call."""
    import torch

    path, seed, check = payload["artifact"], int(payload["seed"]), bool(payload["check"])
    n_lengths = int(payload.get("lengths", 20))
    evidence.install_hooks()
    artifact = path
    result = install_artifact(path)
    verified: list[VerifiedConfig] = []
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
        tiers: dict[str, GraphTier] = {}
        for graph, entry in entries.items():
            why = tier2_off if entry is not None else built.not_precompiled or "no precompiled function"
            tiers[graph] = GraphTier("inductor-cache", why or "")
        for r, outputs in tier2:
            if not r.error:
                r = compare_precompiled(config, device, r, outputs)
            problems = [f"failed: {r.error}"] if r.error else []
            if evidence.compiled_anything(r.counters) or r.counters.get("frames.ok", 0):
                problems.append(f"traced or compiled on load ({', '.join(evidence.compiled_anything(r.counters))})")
            if r.equal is False and r.rel_error > TOLERANCE[config.dtype]:
                problems.append(f"its outputs differ from tier 1's (rel. error {r.rel_error:.2e})")
            reasons += [f"precompiled {r.graph}: {p}" for p in problems]
            tier = "precompiled" if not problems else "inductor-cache"
            tiers[r.graph] = GraphTier(tier, "; ".join(problems), r.seconds, r.equal, r.rel_error)
        retraced = call.lengths_counters.get("frames.ok", 0)
        if retraced:
            reasons.append(f"Dynamo traced {retraced} more graph(s) at other lengths of its range")
        if call.mask_key != built.mask_key:
            reasons.append(f"mask_mod computes {call.mask_key!r} here, {built.mask_key!r} in the builder")
        if call.score_key != built.score_key:
            reasons.append(f"score_mod computes {call.score_key!r} here, {built.score_key!r} in the builder")
        if check and (msg := check_errors(config, call.errors)):
            reasons.append(msg)
        verified.append(
            VerifiedConfig(
                id=config.id,
                device=device,
                describe=config.describe() + ("" if config.device == "cpu" else f" on {device}"),
                seconds=call.seconds,
                errors=dict(call.errors),
                counters=d,
                lengths=tuple((q, kv) for q, kv in call.lengths),
                tiers=tiers,
                reasons=tuple(reasons),
            )
        )
        _worker.emit({"event": "config_done", "config": verified[-1].to_dict()})
    return VerifyReport(
        artifact=artifact,
        seed=seed,
        configs=tuple(verified),
        torch_version=torch.__version__,
        torch_git=torch.version.git_version or "",
        triton_detection=evidence.triton_detection,
        install_seconds=result.seconds,
        installed_files=result.written,
    ).to_dict()


if __name__ == "__main__":
    sys.exit(_worker.child_main(_verify_in_worker, sys.argv[1:]))
