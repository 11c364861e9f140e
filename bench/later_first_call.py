"""What a signature's later first call costs through kernelpack against torch's own load and call of the same
precompiled function: kernelpack's share of a later first call, and the floor under it.

    python bench/later_first_call.py ARTIFACT [--runs 3] [--calls 6] [--profile]

Both arms run in fresh processes, alternated, on the same configs in the same order. Each activates the artifact
into an empty cache dir with KERNELPACK_INSTALL=all and waits for the whole install (no call installs a part, so what
is timed is loading and calling), which also pays the warm-up's one load: every import and one-time initialization
a load needs is paid before the clock. Then, for ``--calls`` configs other than the warmed one:

- ``kernelpack``: the config's first call through ``kernelpack.flex_attention`` (dispatch, the call's signature, the
  part check, the file's sha256, torch's load, kernelpack's wrapper, torch's guard check, the call; forward and
  backward for a config built for both), then a second call of the same inputs (a served call's steady cost);
- ``torch``: the installed function's file read and loaded by torch (``torch.compiler.load_compiled_function``,
  through kernelpack's tracing-context shim where this torch needs one), then called with the same arguments,
  torch's guard check included (on CUDA skipped, microseconds: it holds the builder's CPU thread count, which a
  job's may not be; kernelpack builds a guard manager for the job's): what a job that loads precompiled functions
  itself pays, at least; then, untimed as a call, the function's saved guards unpickled again (what kernelpack's
  wrapper did at every CUDA load before ``b1e5a27``).

``--profile``: one more process per arm after the timed ones, under cProfile: in the torch arm its loads (the
shares of torch's guard manager build, saved-guard unpickling, compiled artifacts: its wrapper module, its C++
kernels), in the kernelpack arm its first calls (the same, sha256, and each kernelpack function's cumulative share).

Prints one JSON line per process, then the medians per arm and kernelpack's difference. CPU or CUDA (the config's
device); on CUDA every timed call ends with a synchronize.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, sys, tempfile, time, torch
import kernelpack
from kernelpack import runtime
from kernelpack._torch import aot
from kernelpack.artifact import read_manifest
from kernelpack.canonical import call, grad_output, make_inputs
from kernelpack.masks import block_mask_for
arm, path, calls, profile = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
m = read_manifest(path)
cuda = m.configs[0].config.device == "cuda"
device = "cuda:0" if cuda else "cpu"
sync = torch.cuda.synchronize if cuda else (lambda: None)
with tempfile.TemporaryDirectory() as cache:
    a = runtime.activate(path, cache_dir=cache)
    a.wait()
    while not a.installing.complete:
        assert a.installing.error is None, a.installing.error
        time.sleep(0.01)
    warmed = set(a.warmup.precompiled)
    # each config's last graph (its backward too where it has one), served by its precompiled function
    todo = [b for b in m.configs if b.precompiled_for(0, b.config.graphs[-1]) is not None
            and not warmed.intersection(b.signatures(0))][:calls]
    first, second = [], []
    profiler = None
    if profile:
        import cProfile
        profiler = cProfile.Profile()
    for built in todo:
        c, graph = built.config, built.config.graphs[-1]
        inputs = make_inputs(c, device, graph)
        bm = block_mask_for(c, device)
        dout = grad_output(inputs[0]) if graph == "fwd+bwd" else None
        sync()
        if arm == "kernelpack":
            t = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            call(kernelpack.flex_attention, c, graph, inputs, bm, dout)
            sync()
            if profiler is not None:
                profiler.disable()
            first.append(time.perf_counter() - t)
            t = time.perf_counter()
            call(kernelpack.flex_attention, c, graph, inputs, bm, dout)
            sync()
            second.append(time.perf_counter() - t)
        else:
            t = time.perf_counter()
            with open(os.path.join(cache, built.precompiled_for(0, graph).path), "rb") as f:
                blob = f.read()
            if profiler is not None:
                profiler.enable()
            fn = aot.loads(blob)
            if profiler is not None:
                profiler.disable()
            if cuda:  # torch's check holds the builder's CPU thread count (aot._guard_manager says why)
                fn.disable_guard_check()
            call(fn, c, graph, inputs, bm, dout)
            sync()
            first.append(time.perf_counter() - t)
            # what kernelpack's wrapper did on CUDA before b1e5a27 at every load: the saved guards unpickled again
            t = time.perf_counter()
            aot._unpickling_guards(lambda: aot._load_guards_state(fn))
            second.append(time.perf_counter() - t)
    shares = {}
    if profiler is not None:  # each named function's share of the profiled time (cumulative, under the profiler)
        import pstats
        stats = pstats.Stats(profiler)
        names = {"load_guard_manager": "guard manager build", "load_guards_state": "saved guards unpickled",
                 "deserialize_compile_artifacts": "compiled artifacts (AOTAutograd entry, wrapper, kernels)",
                 "_reload_python_module": "wrapper module compiled and run", "load_async": "C++ kernels' .so loaded",
                 "<built-in method _hashlib.openssl_sha256>": "sha256", "load_compiled_function": "torch's load"}
        for (path, _, fname), row in stats.stats.items():
            name = names.get(fname)
            if name is None and arm == "kernelpack" and "/kernelpack/" in path:  # kernelpack's own, by function
                name = path.split("/kernelpack/", 1)[1] + ":" + fname
            if name is not None:
                shares[name] = round(shares.get(name, 0) + row[3] / stats.total_tt, 3)
        shares = {k: v for k, v in sorted(shares.items(), key=lambda kv: -kv[1]) if v >= 0.01}
        shares["profiled_s"] = round(stats.total_tt, 4)
    if arm == "kernelpack":  # the CPU thread counts the loaded functions' guard managers were built for
        loaded = list(a.warmup.precompiled.values())
        shares["thread_counts"] = sorted({n for f in loaded for n in (f._managers or {})})
        shares["guards_unpickled_again"] = sum(f._state is not None for f in loaded)
        shares["this_thread"] = torch.get_num_threads()
    report = runtime.report()
    print(json.dumps({"arm": arm, "configs": [b.id for b in todo], "first_call_s": first, "second_call_s": second,
                      "profile_shares": shares,
                      "function_bytes": [m.files[b.precompiled_for(0, b.config.graphs[-1]).path].size for b in todo],
                      "compiled": len(report.compiled), "torch": torch.__version__}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--calls", type=int, default=6)
    p.add_argument("--profile", action="store_true", help="one more process per arm, under cProfile")
    args = p.parse_args()
    rows: dict[str, list[dict]] = {"kernelpack": [], "torch": []}
    env = {**os.environ, "KERNELPACK_INSTALL": "all"}
    for _ in range(args.runs):
        for arm in rows:
            child = [sys.executable, "-c", CHILD, arm, args.artifact, str(args.calls), "0"]
            out = subprocess.run(child, env=env, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                sys.exit(out.stderr[-3000:])
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows[arm].append(row)
            print(json.dumps(row), flush=True)
    medians = {}
    for arm, rs in rows.items():
        firsts = [s for r in rs for s in r["first_call_s"]]
        medians[arm] = statistics.median(firsts)
        seconds = [s for r in rs for s in r["second_call_s"]]
        # kernelpack: a second call of the same inputs; torch: the saved guards unpickled again after the load
        second = "median_second_call_ms" if arm == "kernelpack" else "median_guards_unpickled_again_ms"
        print(
            json.dumps(
                {
                    "arm": arm,
                    "runs": len(rs),
                    "calls": len(firsts),
                    "median_first_call_ms": round(medians[arm] * 1000, 2),
                    "max_first_call_ms": round(max(firsts) * 1000, 2),
                    second: round(statistics.median(seconds) * 1000, 2),
                    "compiled": [r["compiled"] for r in rs],
                }
            )
        )
    print(json.dumps({"kernelpack_minus_torch_ms": round((medians["kernelpack"] - medians["torch"]) * 1000, 2)}))
    for arm in rows if args.profile else ():  # one more process per arm, under cProfile (not among the timed runs)
        child = [sys.executable, "-c", CHILD, arm, args.artifact, str(args.calls), "1"]
        out = subprocess.run(child, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            sys.exit(out.stderr[-3000:])
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps({"arm": arm, "profile_shares": row["profile_shares"]}))


if __name__ == "__main__":
    main()
