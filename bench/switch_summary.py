"""bench/start_h200.sh's `switch` part: per KERNELPACK_START_SWITCH_INTERVAL, the start's clock (the activate()
line to the end of the first step) and its timeline, medians over the fresh processes, from the part's run.log."""

import json
import statistics
import sys

runs: dict[str, list[dict]] = {}
for line in open(sys.argv[1]):
    try:
        row = json.loads(line)
    except ValueError:
        continue
    runs.setdefault(row["interval"], []).append(row["line"])
for interval, lines in runs.items():
    timelines = [r.get("start_timeline") or {} for r in lines]
    marks = sorted({k for t in timelines for k in t}, key=lambda k: statistics.median(t.get(k, 0) for t in timelines))
    print(
        json.dumps(
            {
                "switch_interval": interval,
                "runs": len(lines),
                "start_to_first_step_s": [round(r["start_to_first_step_s"], 3) for r in lines],
                "median_start_to_first_step_s": round(statistics.median(r["start_to_first_step_s"] for r in lines), 3),
                "median_timeline_s": {k: round(statistics.median(t[k] for t in timelines if k in t), 3) for k in marks},
                "compiles_in_steps": [r["compiles_in_steps"] for r in lines],
                "misses_in_steps": [r["misses_in_steps"] for r in lines],
            }
        )
    )
