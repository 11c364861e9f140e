"""The side-by-side table of a bench/transformers_step.py run: per arm, the median first step, the median of model
construction + first step (the background arm's clock already holds its model construction), its ratio to native
warm, and the median second step.

    python bench/tf_summary.py transformers_step.json
"""

from __future__ import annotations

import json
import statistics
import sys


def main(path: str) -> None:
    samples = json.load(open(path))["samples"]

    def total(mode: str, r: dict) -> float:
        return r["first_step"] + (0.0 if mode == "background" else r["model_s"])

    warm = statistics.median(total("warm", r) for r in samples["warm"])
    columns = ("arm", "first step, median (s)", "samples (s)", "model + first step, median (s)", "/ native warm")
    print("| " + " | ".join((*columns, "second step (s)")) + " |")
    print("|---|---|---|---|---|---|")
    for mode, runs in samples.items():
        first = [r["first_step"] for r in runs]
        both = statistics.median(total(mode, r) for r in runs)
        print(
            f"| {mode} | {statistics.median(first):.2f} | {', '.join(f'{x:.2f}' for x in first)} | {both:.2f} | "
            f"{both / warm:.2f} | {statistics.median(r['second_step'] for r in runs):.4f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
