"""Time-to-first-step over all configs of a recipe, side by side in one run, each sample a fresh subprocess:

  (a) cold      empty TORCHINDUCTOR_CACHE_DIR: compile everything
  (b) warm      the same cache dir (a) filled: torch's native warm start
  (c) mega      torch.compiler.load_cache_artifacts() of the blob (a) saved, into an empty dir (load time included)
  (d) kernelpack kernelpack.install() of the artifact into an empty dir (install time included)
  (e) tier1     runtime.activate() into an empty dir with KERNELPACK_PRECOMPILED=0: install, warm-up through the
                inductor cache (Dynamo traces each call), then the calls through kernelpack.flex_attention
  (f) tier2     runtime.activate() into an empty dir: install, load every precompiled function and call it once,
                then the calls through kernelpack.flex_attention, served without Dynamo

Time-to-first-step = preparation (load/install/activate) + the first canonical call of every config (forward, and
backward when built), synchronized. Import of torch/kernelpack and CUDA init are excluded for every mode alike.
Prints a Markdown table; writes everything to --out as JSON.

    python bench/warm_start.py --artifact out/dflash-drafter-....kpack --repeats 3 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(mode: str, cache_dir: str, artifact: str, blob: str, result: str) -> None:
    import torch

    from kernelpack import evidence
    from kernelpack.artifact import read_manifest
    from kernelpack.workload import run_config

    evidence.install_hooks()
    manifest = read_manifest(artifact)
    configs = [c.config for c in manifest.configs]
    if any(c.device == "cuda" for c in configs):
        torch.cuda.init()
        torch.zeros(1, device="cuda")
    prep = 0.0
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    if mode == "mega":
        torch.compiler.load_cache_artifacts(Path(blob).read_bytes())
        prep = time.perf_counter() - t0
    elif mode == "kernelpack":
        from kernelpack import install

        r = install(artifact, cache_dir)
        prep = time.perf_counter() - t0
        phases = r.timings
    elif mode in ("tier1", "tier2"):  # KERNELPACK_PRECOMPILED is set per mode by run_child
        from kernelpack import runtime

        activation = runtime.activate(artifact, cache_dir=cache_dir)
        prep = time.perf_counter() - t0
        phases = {"install": activation.install.seconds if activation.install else 0.0}
    before = evidence.snapshot()
    calls = []
    for c in configs:
        device = "cpu" if c.device == "cpu" else "cuda:0"
        calls.append(run_config(c, device, check=False).seconds)
    counters = evidence.delta(before, evidence.snapshot())
    out = {
        "mode": mode,
        "prep": prep,
        "calls": calls,
        "total": prep + sum(calls),
        "counters": counters,
        "phases": phases,
        "torch": torch.__version__,
        "git": torch.version.git_version,
    }
    if mode in ("tier1", "tier2"):
        report = runtime.report().to_dict()
        out["tiers"] = sorted({s["tier"] for s in report["served"]})
        # the warm-up's first call of each signature (load + call for tier 2): the per-config first-call cost
        out["warmup_calls"] = [[c["call"], c["tier"], c["seconds"]] for c in report["first_calls"]]
    if mode == "cold":
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            Path(blob).write_bytes(saved[0])
            out["blob_bytes"] = len(saved[0])
    Path(result).write_text(json.dumps(out))


def run_child(mode: str, cache_dir: Path, artifact: str, blob: Path, timeout: float, script: str = __file__) -> dict:
    """One fresh process of ``script`` (this file, or bench/user_block.py, which shares the protocol)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1")
    env.pop("TRITON_CACHE_DIR", None)
    if mode == "tier1":
        env["KERNELPACK_PRECOMPILED"] = "0"
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    cmd = [sys.executable, script, "--child", mode, str(cache_dir), artifact, str(blob), result]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        sys.exit(f"{mode} child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    data = json.loads(Path(result).read_text())
    os.unlink(result)
    return data


def side_by_side(
    script: str,
    artifact: str,
    modes: list[str],
    repeats: int,
    timeout: float,
    out: str,
    cold_repeats: int | None = None,
) -> dict[str, list[dict]]:
    """``repeats`` fresh processes of ``script`` per mode, interleaved so that drift hits every mode alike: cold into
    an empty dir (the first fills the dir warm reuses and saves the blob mega loads; only the first ``cold_repeats``
    repeats run it), every other mode but warm into an empty dir each. Used by bench/user_block.py and
    bench/transformers_step.py. Each sample is printed as it ends and every sample so far is kept in
    ``out + ".partial"``: a run cut short by a time limit keeps what it measured."""
    # tier1: kernelpack with KERNELPACK_PRECOMPILED=0; background: kernelpack with activate(warmup="background")
    order = ["cold", "warm", "mega", "kernelpack", "tier1", "background"]
    if not set(modes) <= set(order) or ({"warm", "mega"} & set(modes) and "cold" not in modes):
        sys.exit(f"modes {modes}: any of {order}; warm and mega need cold (it fills their cache and blob)")
    modes = sorted(modes, key=order.index)  # cold first in every repeat: warm and mega reuse what it wrote
    work = Path(tempfile.mkdtemp(prefix="kp-bench-"))
    samples: dict[str, list[dict]] = {m: [] for m in modes}
    warm_dir, blob = work / "warm", work / "mega.bin"
    try:
        for i in range(repeats):
            for mode in modes:
                if mode == "cold" and cold_repeats is not None and i >= cold_repeats:
                    continue
                if mode == "cold":
                    d, b = (warm_dir, blob) if i == 0 else (work / f"cold{i}", work / "x.bin")
                elif mode == "warm":
                    d, b = warm_dir, blob
                else:
                    d, b = work / f"{mode}{i}", blob
                samples[mode].append(run_child(mode, d, artifact, b, timeout, script=script))
                r = samples[mode][-1]
                print(f"repeat {i + 1} {mode}: first step {r['first_step']:.2f} s, {r['compiles_in_steps']} compiles")
                Path(out + ".partial").write_text(json.dumps({"samples": samples}))
                if mode not in ("cold", "warm"):
                    shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return samples


def step_table(samples: dict[str, list[dict]], out: str) -> None:
    """Medians of first step, preparation and second step per mode, with every run's compiles (misses) in the
    steps; written with the samples to ``out`` as JSON and printed as a Markdown table."""
    summary = {
        m: {
            "median_first_step": statistics.median(s["first_step"] for s in runs),
            "median_prep": statistics.median(s["prep"] for s in runs),
            "median_second_step": statistics.median(s["second_step"] for s in runs),
            "compiles_in_steps": [s["compiles_in_steps"] for s in runs],
            "misses_in_steps": [s["misses_in_steps"] for s in runs],
            "fx_misses_in_steps": [s["fx_misses_in_steps"] for s in runs],
        }
        for m, runs in samples.items()
    }
    Path(out).write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))
    print("| mode | first step (median s) | prep (s) | second step (s) | compiles (misses) in the steps, per run |")
    print("|---|---|---|---|---|")
    for m, s in summary.items():
        runs = ", ".join(f"{c} ({x})" for c, x in zip(s["compiles_in_steps"], s["misses_in_steps"], strict=True))
        print(
            f"| {m} | {s['median_first_step']:.2f} | {s['median_prep']:.2f} | {s['median_second_step']:.2f} | {runs} |"
        )


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file() and "locks" not in p.parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold-repeats", type=int, default=None, help="default: --repeats")
    ap.add_argument("--out", default="warm_start.json")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--tiers", action="store_true", help="also (e) tier1 and (f) tier2: activate()")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kp-bench-"))
    fresh = ("mega", "kernelpack", *(("tier1", "tier2") if args.tiers else ()))
    samples: dict[str, list[dict]] = {m: [] for m in ("cold", "warm", *fresh)}
    warm_dir, blob = work / "warm", work / "mega.bin"

    def keep(mode: str, sample: dict) -> None:  # printed as it ends, and kept: a run cut short keeps what it measured
        samples[mode].append(sample)
        print(f"{mode}: {sample['total']:.2f} s (prep {sample['prep']:.2f} s, calls {sum(sample['calls']):.2f} s)")
        Path(args.out + ".partial").write_text(json.dumps({"samples": samples}))

    try:
        cold_repeats = args.cold_repeats or args.repeats
        for i in range(max(args.repeats, cold_repeats)):
            # Interleave the modes so drift (clocks, page cache) hits all of them alike.
            if i < cold_repeats:
                d = warm_dir if i == 0 else work / f"cold{i}"
                keep("cold", run_child("cold", d, args.artifact, blob if i == 0 else work / "x.bin", args.timeout))
            if i < args.repeats:
                keep("warm", run_child("warm", warm_dir, args.artifact, blob, args.timeout))
                for mode in fresh:
                    d = work / f"{mode}{i}"
                    keep(mode, run_child(mode, d, args.artifact, blob, args.timeout))
                    shutil.rmtree(d, ignore_errors=True)
        raw = dir_bytes(warm_dir)
        from kernelpack.artifact import read_manifest

        manifest = read_manifest(args.artifact)
        summary = {
            m: {
                "median_total": statistics.median(s["total"] for s in v),
                "median_prep": statistics.median(s["prep"] for s in v),
                "totals": [s["total"] for s in v],
                "counters": v[0]["counters"],
            }
            for m, v in samples.items()
        }
        cold = summary["cold"]["median_total"]
        warm = summary["warm"]["median_total"]
        kp = summary["kernelpack"]["median_total"]
        sizes = {
            "raw_cache_bytes": raw,
            "manifest_bytes": manifest.total_size,
            "artifact_bytes": os.path.getsize(args.artifact),
            "mega_blob_bytes": samples["cold"][0].get("blob_bytes"),
        }
        result = {
            "summary": summary,
            "sizes": sizes,
            "samples": samples,
            "configs": len(manifest.configs),
            "torch": samples["cold"][0]["torch"],
            "git": samples["cold"][0]["git"],
            "speedup_vs_cold": cold / kp,
            "ratio_vs_warm": kp / warm,
            "artifact_over_raw": sizes["artifact_bytes"] / raw,
        }
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"| mode | time-to-first-step, median of {args.repeats} (s) | of which load/install (s) | samples |")
        print("|---|---|---|---|")
        for m in samples:
            s = summary[m]
            print(
                f"| {m} | {s['median_total']:.2f} | {s['median_prep']:.3f} | "
                f"{', '.join(f'{x:.2f}' for x in s['totals'])} |"
            )
        print(f"\nkernelpack vs cold: {cold / kp:.1f}x faster; vs native warm: {kp / warm:.2f}x")
        if args.tiers:
            t2, t1 = summary["tier2"]["median_total"], summary["tier1"]["median_total"]
            result.update({"tier2_vs_cold": cold / t2, "tier2_vs_warm": t2 / warm, "tier2_vs_tier1": t2 / t1})
            Path(args.out).write_text(json.dumps(result, indent=1))
            print(f"tier2 vs cold: {cold / t2:.1f}x faster; vs native warm: {t2 / warm:.2f}x; vs tier1: {t2 / t1:.2f}x")
            print("tiers that served:", {m: [s.get("tiers") for s in samples[m]] for m in ("tier1", "tier2")})
        print(
            f"raw cache {raw / 2**20:.1f} MiB, artifact {sizes['artifact_bytes'] / 2**20:.1f} MiB "
            f"({sizes['artifact_bytes'] / raw:.2f}x), mega-cache blob "
            f"{(sizes['mega_blob_bytes'] or 0) / 2**20:.1f} MiB"
        )
        for m in samples:
            print(m, "counters:", {k: v for k, v in summary[m]["counters"].items() if v})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:7])
    else:
        main()
