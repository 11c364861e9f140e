"""A precompiled function's first load in a fresh process, with and without what kernelpack imports ahead of it.

    python bench/first_load.py ARTIFACT [--runs 3] [--profile]

Each process installs the artifact into an empty cache dir, imports Dynamo and inductor's code cache
(``import_compiler``, as a background start does first), then in mode ``ahead`` what the first load imports besides
(``import_loader``, which a background start runs while the install writes the warm-up's files), and loads the first
config's function (``precompiled.load``). It prints the seconds of each step and the torch/compiler modules the load
still imported. The modes alternate; the medians come last. ``--profile``: one more ``ahead`` process, its load
under cProfile: the cumulative share of each named step (torch's vector-ISA check on CPU, the wrapper module, the
guard manager, Triton's kernel loads on CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import cProfile, json, os, pstats, sys, time
cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
import torch
from kernelpack import precompiled
from kernelpack.artifact import read_manifest
from kernelpack.installer import install_artifact
from kernelpack._torch.inductor import import_compiler, import_loader
path, mode, profile = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
install_artifact(path, cache)
built = read_manifest(path).configs[0]
entry = built.precompiled_for(0, built.config.graphs[-1])
t = time.perf_counter(); import_compiler(); compiler = time.perf_counter() - t
t = time.perf_counter()
if mode == "ahead":
    import_loader({built.config.device})
ahead = time.perf_counter() - t
before = set(sys.modules)
profiler = cProfile.Profile() if profile else None
t = time.perf_counter()
if profiler is not None:
    profiler.enable()
precompiled.load(os.path.join(cache, entry.path), built.config.device, entry.sha256)
if profiler is not None:
    profiler.disable()
load = time.perf_counter() - t
shares = {}
if profiler is not None:
    stats = pstats.Stats(profiler)
    names = {"pick_vec_isa": "CPU vector-ISA check", "_reload_python_module": "wrapper module compiled and run",
             "load_guard_manager": "guard manager build", "load_guards_state": "saved guards unpickled",
             "load_async": "C++ kernels' .so loaded", "triton": "Triton kernels (async_compile.triton)",
             "_find_and_load": "imports"}
    for (_, _, fname), row in stats.stats.items():
        if fname in names:
            shares[names[fname]] = round(max(shares.get(names[fname], 0), row[3] / stats.total_tt), 3)
ours = ("torch.", "triton", "jinja2", "networkx", "sympy")
print(json.dumps({"mode": mode, "import_compiler_s": compiler, "import_loader_s": ahead, "load_s": load,
                  "imported_by_the_load": sorted(m for m in set(sys.modules) - before if m.startswith(ours)),
                  "profile_shares": shares, "torch": torch.__version__}))
"""


def run(artifact: str, mode: str, profile: bool) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        out = subprocess.run(
            [sys.executable, "-c", CHILD, artifact, mode, "1" if profile else "0"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    if out.returncode != 0:
        sys.exit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="one more 'ahead' process, its load under cProfile")
    args = p.parse_args()
    rows: dict[str, list[dict]] = {"alone": [], "ahead": []}
    for _ in range(args.runs):
        for mode in rows:
            row = run(args.artifact, mode, False)
            rows[mode].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "profile_shares"}), flush=True)
    for mode, rs in rows.items():
        print(
            json.dumps(
                {
                    "mode": mode,
                    "runs": len(rs),
                    **{
                        f"median_{k}": round(statistics.median(r[k] for r in rs), 3)
                        for k in ("import_compiler_s", "import_loader_s", "load_s")
                    },
                }
            )
        )
    if args.profile:
        print(json.dumps({"profile_shares": run(args.artifact, "ahead", True)["profile_shares"]}))


if __name__ == "__main__":
    main()
