"""Where ``activate()``'s seconds go in one process that drives every GPU (``--devices`` artifact, a thread per GPU).

Each sample is a fresh process. ``--prepared`` first pays, outside activate(), what a job that built its model and
block masks has paid already: Dynamo's and inductor's imports (``create_block_mask`` imports them), then the CUDA
context of every visible GPU. Without it activate() pays them, as in ``threads_first_step.py --spread`` and
``checkpoint_threads.py --spread``. Prints one JSON line per process (``other_s``: activate() less install and
warm-up):

    python bench/activate_phases.py --artifact out/x.kpack [--prepared] --out phases.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(artifact: str, prepared: bool) -> dict[str, object]:
    t = time.perf_counter()
    import torch
    from torch.nn.attention.flex_attention import flex_attention  # noqa: F401  (as the benchmarks import it)

    from kernelpack import runtime

    out: dict[str, object] = {"prepared": prepared, "import_s": time.perf_counter() - t}
    if prepared:
        t = time.perf_counter()
        import torch._dynamo
        import torch._inductor

        out["dynamo_import_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for d in range(torch.cuda.device_count()):
            torch.zeros(1, device=f"cuda:{d}")
            torch.cuda.synchronize(d)
        out["cuda_init_s"] = time.perf_counter() - t
    t = time.perf_counter()
    activation = runtime.activate(artifact)
    out["activate_s"] = time.perf_counter() - t
    assert activation.install is not None and activation.warmup is not None
    out["install_s"] = activation.install.seconds
    out["install_phases"] = activation.install.timings
    out["warmup_s"] = activation.warmup.seconds
    out["other_s"] = out["activate_s"] - activation.install.seconds - activation.warmup.seconds  # type: ignore[operator]
    calls = runtime.report().first_calls
    out["first_calls"] = len(calls)
    out["first_call_s"] = [round(c.seconds, 3) for c in calls]
    out["devices"] = torch.cuda.device_count()
    out["torch"] = torch.__version__
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True)
    p.add_argument("--prepared", action="store_true")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--out")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.artifact, a.prepared)))
        return
    lines = []
    for _ in range(a.runs):
        with tempfile.TemporaryDirectory() as cache:  # a fresh node: nothing installed yet
            cmd = [sys.executable, __file__, "--child", "--artifact", a.artifact]
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            cmd += ["--prepared"] if a.prepared else []
            done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"child failed ({done.returncode}):\n{done.stderr[-3000:]}")
            lines.append(done.stdout.strip().splitlines()[-1])
            print(lines[-1], flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
