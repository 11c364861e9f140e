"""What bench/torchrun_first_step.py and bench/torchrun_train.py share: one ``torchrun --standalone`` job per (mode,
repeat), each rank writing ``rank<r>.json`` into a results dir, the node cache per job chosen by the mode, and the
per-rank medians over the repeats.

Caches: ``cold`` starts from an empty dir; the first cold job's cache is kept, and every ``warm`` job starts from a
copy of it (torch's native warm start: the entries the cold job wrote, for every rank's device index). Every other
mode starts from an empty dir (kernelpack installs the artifact into it).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def run_jobs(
    script: str,
    modes: list[str],
    repeats: int,
    nproc: int,
    worker_args: list[str],
    timeout: float,
    repeats_for: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Every mode ``repeats`` times (``repeats_for``: another count for some modes), in rounds: the modes in order
    inside each round, as bench/warm_start.py pairs its arms. ``cold`` must come before ``warm``, whose cache is a
    copy of the first cold job's."""
    counts = {m: (repeats_for or {}).get(m, repeats) for m in modes}
    work = Path(tempfile.mkdtemp(prefix="kp-torchrun-"))
    first_cold: Path | None = None
    results = []
    try:
        for repeat in range(max(counts.values(), default=0)):
            for mode in (m for m in modes if repeat < counts[m]):
                cache = work / f"{mode}-{repeat}"
                if mode == "warm":
                    if first_cold is None:
                        raise SystemExit("warm needs a cold job before it: list cold before warm in --modes")
                    shutil.copytree(first_cold, cache)
                results.append({**_job(script, mode, nproc, worker_args, timeout, cache), "repeat": repeat})
                if mode == "cold" and first_cold is None:
                    first_cold = cache
                else:
                    shutil.rmtree(cache, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def _job(script: str, mode: str, nproc: int, worker_args: list[str], timeout: float, cache: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"kp-torchrun-{mode}-") as tmp:
        results = Path(tmp)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
        env.pop("TRITON_CACHE_DIR", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd += [script, "--worker", mode, str(results), *worker_args]
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            outcome = f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            # torchrun starts its workers in sessions of their own: a SIGKILL would leave them on the GPUs, into the
            # next job's numbers. SIGTERM makes torchrun stop them first.
            proc.terminate()
            try:
                stdout, stderr = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            outcome = f"no result within {timeout:.0f} s"
        log = stdout[-3000:] + stderr[-3000:]
        ranks = [json.loads(p.read_text()) for p in sorted(results.glob("rank*.json"))]
        return {"mode": mode, "outcome": outcome, "wall": time.perf_counter() - t, "ranks": ranks, "log_tail": log}


def medians(results: list[dict[str, Any]], key: str = "ttfs") -> dict[str, dict[int, dict[str, Any]]]:
    """mode -> rank -> {"median": median of ``key`` over the repeats where the rank succeeded, "samples": [...]}"""
    by: dict[str, dict[int, list[float]]] = {}
    for r in results:
        for rank in r["ranks"]:
            if rank.get("ok") and rank.get(key) is not None:
                by.setdefault(r["mode"], {}).setdefault(rank["rank"], []).append(rank[key])
    return {
        mode: {rank: {"median": statistics.median(v), "samples": v} for rank, v in sorted(ranks.items())}
        for mode, ranks in by.items()
    }


def provenance() -> dict[str, str]:
    """The torch build and the kernelpack commit each row is measured at."""
    import torch

    # KP_COMMIT: the device machine's copy of the tree carries a .git that need not be this commit's
    commit = os.environ.get("KP_COMMIT", "")
    if not commit:
        try:
            git = ["git", "rev-parse", "--short", "HEAD"]
            commit = subprocess.run(git, capture_output=True, text=True, check=False).stdout.strip() + " (git)"
        except OSError:
            commit = "unknown"
    return {"torch": torch.__version__, "torch_git": torch.version.git_version, "commit": commit}


def counts(text: str) -> dict[str, int]:
    """``--repeats-for`` "cold=1,unpinned=1" as {"cold": 1, "unpinned": 1}."""
    return {k: int(v) for k, v in (item.split("=") for item in text.split(",") if item)}


def add_arguments(ap: Any, modes: tuple[str, ...], out: str) -> None:
    """The driver's options, the same in both scripts."""
    ap.add_argument("--nproc", type=int, default=None, help="default: every visible GPU")
    ap.add_argument("--modes", default=",".join(modes))
    ap.add_argument("--repeats", type=int, default=1, help="rounds of every mode; ttfs per rank is their median")
    ap.add_argument("--repeats-for", default="", type=counts, help="per-mode counts, e.g. cold=1,unpinned=1")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per torchrun job")
    ap.add_argument("--out", default=out)


def main(script: str, args: Any, worker_args: list[str], describe: Any) -> None:
    """Run the jobs, write ``args.out`` (every rank's JSON, the medians, the torch build, the commit), print each
    job's ranks (``describe(rank_json)`` for an ok rank) and the medians."""
    if args.nproc is None:
        import torch

        args.nproc = torch.cuda.device_count()
    modes = args.modes.split(",")
    results = run_jobs(script, modes, args.repeats, args.nproc, worker_args, args.timeout, args.repeats_for)
    summary = {"nproc": args.nproc, **provenance(), "medians": medians(results), "results": results}
    Path(args.out).write_text(json.dumps(summary, indent=1))
    for r in results:
        done = f"{len(r['ranks'])}/{args.nproc} ranks, wall {r['wall']:.1f} s"
        print(f"{r['mode']} #{r['repeat']}: {r['outcome']}, {done}")
        for k in r["ranks"]:
            where = f"rank {k['rank']} {k['device']} (visible {k['cuda_visible_devices']})"
            print(f"  {where}: ttfs {k['ttfs']:.2f} s; {describe(k) if k['ok'] else k['error'][:600]}")
        if not r["ranks"]:
            print(r["log_tail"])
    print(f"median ttfs per rank, {summary['commit']}, torch {summary['torch']}:")
    for mode, ranks in summary["medians"].items():
        each = (f"rank {r} {m['median']:.2f} s (of {len(m['samples'])})" for r, m in ranks.items())
        print(f"  {mode}: " + ", ".join(each))
