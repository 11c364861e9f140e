"""The per-rank table of a bench/torchrun_first_step.py or bench/torchrun_train.py run (--out JSON): per mode and rank,
the median time to first step with every sample, its ratio to cold and to native warm of the same rank (when the run
has them), the median warm-up (kernelpack's modes), what served the rank, and the commit and torch build; then every
job that did not end with all its ranks' results.

    python bench/torchrun_summary.py torchrun_first_step.json
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any


def served(ranks: list[dict[str, Any]]) -> str:
    """What the samples of one (mode, rank) show: the tiers, the compiles, or the error (each distinct one once)."""
    seen: list[str] = []
    for r in ranks:
        if not r.get("ok"):
            kind = r.get("error", "failed").split(":")[0]
            text = kind + (" (refused)" if kind in ("NotPrecompiledError", "NotWarmedError") else " (failed)")
        elif "compiles_in_steps" in r:  # torchrun_train: torch's compile records outside kernelpack's warm-up
            text = f"{r['compiles_in_steps']} compiles in the steps"
        else:
            c = r.get("counters", {})
            text = (
                f"{c.get('inductor.fxgraph_cache_miss', 0)} FX misses, {c.get('inductor.fxgraph_cache_hit', 0)} hits,"
                f" {c.get('triton_compiled', 0)} Triton compiled"
            )
        if r.get("tiers"):
            text += f", tiers {'+'.join(r['tiers'])}"
        if text not in seen:
            seen.append(text)
    return "; ".join(seen)


def main(path: str) -> None:
    run = json.load(open(path))
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for job in run["results"]:
        for r in job["ranks"]:
            by.setdefault((job["mode"], r["rank"]), []).append(r)
    medians = {key: statistics.median(ok) for key, ranks in by.items() if (ok := [r["ttfs"] for r in ranks if r["ok"]])}
    nproc = run["nproc"]
    # runs before 0d1477e (torchrun-f4dc3f8.json) recorded neither the torch build nor the commit
    torch = f"torch {run['torch']} (git {run['torch_git'][:12]})" if "torch" in run else "torch not recorded"
    print(f"{path}: commit {run.get('commit', 'not recorded')}, {torch}, {nproc} ranks")
    print("| mode | rank | median ttfs (s) | samples (s) | vs cold | vs native warm | warm-up (s) | served by |")
    print("|---|---|---|---|---|---|---|---|")
    for (mode, rank), ranks in by.items():
        ok = [r["ttfs"] for r in ranks if r["ok"]]
        warmups = [r["warmup_s"] for r in ranks if r.get("warmup_s") is not None]
        warmup = f"{statistics.median(warmups):.2f}" if warmups else "–"
        if not ok:
            print(f"| {mode} | {rank} | – | – | – | – | {warmup} | {served(ranks)} |")
            continue
        median = statistics.median(ok)
        cold, warm = medians.get(("cold", rank)), medians.get(("warm", rank))
        print(
            f"| {mode} | {rank} | {median:.2f} | {', '.join(f'{x:.2f}' for x in ok)} | "
            f"{f'{cold / median:.1f}x' if cold else '–'} | {f'{median / warm:.2f}x' if warm else '–'} | {warmup} | "
            f"{served(ranks)} |"
        )
    for job in run["results"]:  # a timeout or a crash leaves fewer rank results than ranks: never drop it silently
        if job.get("outcome") != "exit 0" or len(job["ranks"]) < nproc:
            print(f"job {job['mode']} #{job.get('repeat')}: {job.get('outcome')}, {len(job['ranks'])}/{nproc} ranks")
            print("  " + job.get("log_tail", "").strip()[-800:].replace("\n", "\n  "))


if __name__ == "__main__":
    main(sys.argv[1])
