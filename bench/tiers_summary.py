"""The tiers' targets from one `bench/warm_start.py --tiers` run: per-config first-call cost with tier 2 against
native warm, each paired run, and the ratios to cold, native warm, mega-cache and tier 1.

    python bench/tiers_summary.py tiers.json manifest.json     (manifest: `kernelpack inspect --json` of the artifact)

Native warm's per-config cost is its first canonical call of the config (forward, then forward + backward) in
`calls`, in the manifest's config order; tier 2's is the warm-up's load + call of the same config's graphs
(`warmup_calls`, one per graph, named by the config's description).
"""

from __future__ import annotations

import json
import statistics
import sys


def main(tiers_path: str, manifest_path: str) -> None:
    data = json.load(open(tiers_path))
    samples = data["samples"]
    configs = json.load(open(manifest_path))["configs"]

    def key(describe: str) -> str:  # "[cuda:0 sliding_window(2048) B=1 ... bfloat16 fwd+bwd]" -> without the graph
        return describe.strip("[]").rsplit(" ", 1)[0].split(" ", 1)[1]

    def label(c: dict) -> str:
        p = c["params"]
        return f"window {p['window']} seq {p['q_len']}"

    def ours(c: dict, p: dict) -> str:  # the config's part of a warm-up description, as Config.describe() writes it
        return (
            f"{c['mask_key']} B={p['batch']} Hq={p['q_heads']} Hkv={p['kv_heads']} seq={p['q_len']} D={p['head_dim']}"
        )

    rows = []
    for i, c in enumerate(configs):
        warm = [s["calls"][i] for s in samples["warm"]]
        per_tier = {}
        for tier in ("tier1", "tier2"):
            per_tier[tier] = [
                sum(sec for call, _, sec in s["warmup_calls"] if key(call).startswith(ours(c, c["params"])))
                for s in samples[tier]
            ]
        rows.append((label(c), warm, per_tier["tier1"], per_tier["tier2"]))
    print(
        "| config (order of the calls) | native warm first call (s) | tier 1 warm-up (s) | tier 2 load + call (s) |"
        " tier 2 / native warm |"
    )
    print("|---|---|---|---|---|")
    for name, warm, t1, t2 in rows:
        m = statistics.median
        print(f"| {name} | {m(warm):.3f} | {m(t1):.3f} | {m(t2):.3f} | {m(t2) / m(warm):.2f} |")
    summary = {m: statistics.median(s["total"] for s in v) for m, v in samples.items()}
    print()
    for m, v in summary.items():
        runs = ", ".join(f"{s['total']:.2f}" for s in samples[m])
        print(f"{m}: median {v:.2f} s of {len(samples[m])}: {runs}")
    pairs = list(zip((s["total"] for s in samples["tier2"]), (s["total"] for s in samples["warm"]), strict=False))
    print(
        "paired runs, tier 2 vs native warm:",
        ", ".join(f"{a:.2f} vs {b:.2f}" for a, b in pairs),
        "-> below in every pair" if all(a < b for a, b in pairs) else "-> NOT below in every pair",
    )
    t2 = summary["tier2"]
    for m in ("cold", "warm", "mega", "kernelpack", "tier1"):
        print(f"tier 2 / {m}: {t2 / summary[m]:.2f}x" + (f" ({summary[m] / t2:.1f}x faster)" if m == "cold" else ""))


if __name__ == "__main__":
    main(*sys.argv[1:3])
