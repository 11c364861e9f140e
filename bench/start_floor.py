""" "know the floor": where a job's start goes, phase by phase, and what each phase cannot go below.

Each sample is a fresh process on an empty cache dir (a new node). ``phases`` pays every cost alone, in the order a
job pays it: ``import torch``, flex_attention's module, Dynamo, inductor (and its code cache and Triton runtime),
Triton, the CUDA context; then kernelpack's install (its own phases), then for every precompiled function of the
artifact its load (sha256 + unpickle + import of its generated code), its first call and a second call. ``job``
times ``activate()`` alone as the job calls it (nothing paid before it; ``START_BACKGROUND=1``: with
``warmup="background"``, and then the wait for its thread). ``--profile N`` (first run): the N costliest functions
of the job's ``activate()`` and of the phases' first load, by cumulative and by own time. The parent adds the floors
no artifact removes: the artifact's bytes decompressed (zstd, to nothing), the installed bytes read back from the
page cache, and a bare interpreter's start.

    python bench/start_floor.py --artifact out/x.kpack [--runs 3] [--mode phases|job|both] [--profile 25]

One JSON line per process on stdout (``--out FILE`` appends them); ``--profile`` tables go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any


def _lap(out: dict[str, Any], name: str, start: float) -> float:
    now = time.perf_counter()
    out[name] = round(now - start, 4)
    return now


def _profiler(on: bool) -> Any:
    if not on:
        return None
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    return prof


def _print_profile(prof: Any, n: int) -> None:
    if prof is None:
        return
    import pstats

    prof.disable()
    for order in ("cumulative", "tottime"):
        pstats.Stats(prof, stream=sys.stderr).sort_stats(order).print_stats(n)


def phases(artifact: str, cache: str, profile: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {"mode": "phases"}
    t = time.perf_counter()
    import torch

    t = _lap(out, "import_torch_s", t)
    import torch.nn.attention.flex_attention as flex

    t = _lap(out, "import_flex_s", t)
    import torch._dynamo

    t = _lap(out, "import_dynamo_s", t)
    import torch._inductor.codecache

    t = _lap(out, "import_inductor_s", t)
    cuda = torch.cuda.is_available()
    if cuda:
        import torch._inductor.runtime.triton_heuristics
        import triton  # noqa: F401

        t = _lap(out, "import_triton_s", t)
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        t = _lap(out, "cuda_init_s", t)
    from kernelpack import canonical, installer, masks, precompiled

    t = _lap(out, "import_kernelpack_s", t)
    result = installer.install_artifact(artifact, cache)
    t = _lap(out, "install_s", t)
    out["install_phases"] = {k: round(v, 4) for k, v in result.timings.items()}
    out["install_bytes"] = result.bytes_written
    out["install_files"] = result.written
    loads = []
    for built in result.manifest.configs:
        config = built.config
        for entry in built.precompiled:
            device = "cpu" if config.device == "cpu" else f"cuda:{entry.device}"
            if config.device == "cuda" and not cuda:
                continue
            one: dict[str, Any] = {"config": config.id, "graph": entry.graph}
            prof = _profiler(profile and not loads)
            t = time.perf_counter()
            loaded = precompiled.load(os.path.join(result.cache_dir, entry.path), config.device, entry.sha256)
            t = _lap(one, "load_s", t)
            _print_profile(prof, profile)
            mask_mod = masks.mask_for(config, device)
            bm = masks.block_mask_for(config, device, mask_mod)
            inputs = canonical.make_inputs(config, device, entry.graph, random=False)
            dout = canonical.grad_output(inputs[0], random=False) if entry.graph == "fwd+bwd" else None
            if cuda:
                torch.cuda.synchronize()
            one["inputs_s"] = round(time.perf_counter() - t, 4)
            for name in ("first_call_s", "second_call_s"):
                t = time.perf_counter()
                canonical.call(loaded.checked, config, entry.graph, inputs, bm, dout)
                if cuda:
                    torch.cuda.synchronize()
                _lap(one, name, t)
            loads.append(one)
    out["precompiled"] = loads
    out["flex_module"] = flex.__name__
    out["torch"] = torch.__version__
    return out


def job(artifact: str, cache: str, profile: int) -> dict[str, Any]:
    out: dict[str, Any] = {"mode": "job", "load": os.environ.get("KERNELPACK_LOAD", "lazy")}
    t = time.perf_counter()
    import torch

    t = _lap(out, "import_torch_s", t)
    from kernelpack import runtime

    t = _lap(out, "import_kernelpack_s", t)
    prof = _profiler(bool(profile))
    background = os.environ.get("START_BACKGROUND") == "1"
    out["background"] = background
    activation = runtime.activate(artifact, cache_dir=cache, warmup="background" if background else True)
    t = _lap(out, "activate_s", t)
    _print_profile(prof, profile)
    assert activation.warmup is not None
    activation.warmup.wait()
    _lap(out, "then_warmup_s", t)  # what a background start's thread took beyond activate()
    assert activation.install is not None
    out["install_s"] = round(activation.install.seconds, 4)
    out["install_phases"] = {k: round(v, 4) for k, v in activation.install.timings.items()}
    out["warmup_s"] = round(activation.warmup.seconds, 4)
    out["first_calls_s"] = [round(c.seconds, 4) for c in runtime.report().first_calls]
    out["torch"] = torch.__version__
    return out


def floors(artifact: str, cache: str) -> dict[str, Any]:
    """What no install removes: decompressing the artifact's bytes, reading the installed bytes back (page cache),
    and a bare interpreter's start."""
    import zstandard

    out: dict[str, Any] = {"mode": "floor", "artifact_bytes": os.path.getsize(artifact)}
    t = time.perf_counter()
    n = 0
    with open(artifact, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as r:
        while chunk := r.read(1 << 22):
            n += len(chunk)
    out["zstd_decompress_s"] = round(time.perf_counter() - t, 4)
    out["expanded_bytes"] = n
    t, n = time.perf_counter(), 0
    for root, _, files in os.walk(cache):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                n += len(f.read())
    out["read_installed_s"] = round(time.perf_counter() - t, 4)
    out["installed_bytes"] = n
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    out["python_start_s"] = round(time.perf_counter() - t, 4)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--mode", choices=("phases", "job", "both"), default="both")
    p.add_argument("--profile", type=int, default=0, help="job mode: print the N costliest functions (first run)")
    p.add_argument("--out")
    p.add_argument("--child", choices=("phases", "job"), help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        line = phases(a.artifact, a.cache, a.profile) if a.child == "phases" else job(a.artifact, a.cache, a.profile)
        print(json.dumps(line))
        return
    modes = ("phases", "job") if a.mode == "both" else (a.mode,)
    lines = []
    for run in range(a.runs):
        for mode in modes:  # alternated, so that a drift of the host touches every mode alike
            with tempfile.TemporaryDirectory() as cache:
                cmd = [sys.executable, __file__, "--child", mode, "--artifact", a.artifact, "--cache", cache]
                cmd += ["--profile", str(a.profile)] if a.profile and run == 0 else []
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                done = subprocess.run(cmd, check=False, env=env, stdout=subprocess.PIPE, text=True)
                if done.returncode:
                    sys.exit(f"{mode} child failed ({done.returncode})")
                lines.append(done.stdout.strip().splitlines()[-1])
                print(lines[-1], flush=True)
                if run == 0 and mode == modes[0]:
                    lines.append(json.dumps(floors(a.artifact, cache)))
                    print(lines[-1], flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
