"""``kernelpack verify``: prove that an artifact makes the first call of every config compile nothing.

In a fresh subprocess with an empty cache dir: install the artifact, then run every config of its manifest in
shuffled order through the canonical entry points (forward and backward as built) and read torch's own counters
(:mod:`kernelpack.evidence`). Passes only if, summed over all configs, there were no FX-graph or AOTAutograd cache
misses, no Triton or C++ kernel was compiled, and flex_attention's dense path never ran.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import artifact as art
from .errors import KernelpackError, VerifyError


@dataclass(frozen=True, slots=True)
class VerifyReport:
    ok: bool
    data: dict[str, Any]  # the worker's JSON report: per-config counters and time-to-first-call

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [c for c in self.data.get("configs", []) if c["reasons"]]


def verify(
    artifact: str | os.PathLike[str], *, seed: int | None = None, check: bool = False, timeout: float = 3600.0
) -> VerifyReport:
    """Raises :class:`VerifyError` when any config compiled something; returns the report otherwise."""
    path = str(artifact)
    art.read_manifest(path)  # fail fast, before starting torch, on a missing or corrupt file
    seed = random.randrange(2**31) if seed is None else seed
    with tempfile.TemporaryDirectory(prefix="kernelpack-verify-") as tmp:
        env = dict(os.environ)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp, "cache"))
        env.pop("TRITON_CACHE_DIR", None)
        # In-process compilation, so that Triton's listener and the C++ wrapper see every compile.
        env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        result_file = Path(tmp, "report.json")
        cmd = [
            sys.executable,
            "-m",
            "kernelpack.verify",
            "--worker",
            os.path.abspath(path),
            str(seed),
            "1" if check else "0",
            str(result_file),
        ]
        try:
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False
            )
        except subprocess.TimeoutExpired:
            raise VerifyError(f"verification of {path} timed out after {timeout:.0f} s") from None
        if not result_file.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
            raise VerifyError(f"verification worker for {path} exited with status {proc.returncode}:\n{tail}")
        data = json.loads(result_file.read_text())
    if data.get("error"):
        raise VerifyError(f"{path}: {data['error']}")
    failures = [c for c in data["configs"] if c["reasons"]]
    if failures:
        lines = [f"{path}: {len(failures)} of {len(data['configs'])} config(s) compiled on their first call:"]
        lines += [f"- {c['describe']}: {', '.join(c['reasons'])}" for c in failures]
        raise VerifyError("\n".join(lines), failed=[c["id"] for c in failures])
    return VerifyReport(True, data)


def _worker_main(path: str, seed: str, check: str, result_file: str) -> int:
    report: dict[str, Any] = {"artifact": path, "seed": int(seed), "configs": []}
    try:
        from . import evidence
        from .install import install
        from .recipe import Config
        from .workload import check_errors, run_config

        evidence.install_hooks()
        import torch

        report["torch"] = {"version": torch.__version__, "git": torch.version.git_version}
        report["triton_detection"] = evidence.triton_detection
        result = install(path)  # into TORCHINDUCTOR_CACHE_DIR, the empty directory the parent made
        report["install_seconds"] = result.seconds
        report["installed_files"] = result.written
        manifest = art.read_manifest(path)
        default_devices = manifest.data.get("devices", [manifest.data.get("device_index", 0)])
        pairs = [
            (Config.from_dict(c["params"]), int(d))
            for c in manifest.data["configs"]
            for d in c.get("devices", default_devices)
        ]
        random.Random(int(seed)).shuffle(pairs)
        for config, index in pairs:
            device = "cpu" if config.device == "cpu" else f"cuda:{index}"
            before = evidence.snapshot()
            call = run_config(config, device, check=check == "1")
            d = evidence.delta(before, evidence.snapshot())
            reasons = evidence.compiled_anything(d)
            if check == "1" and (msg := check_errors(config, call.errors)):
                reasons.append(msg)
            report["configs"].append(
                {
                    "id": config.id,
                    "device": device,
                    "describe": config.describe() + ("" if config.device == "cpu" else f" on {device}"),
                    "seconds": call.seconds,
                    "counters": d,
                    "reasons": reasons,
                }
            )
        report["totals"] = {k: sum(c["counters"][k] for c in report["configs"]) for k in evidence.snapshot()}
        report["first_step_seconds"] = sum(c["seconds"] for c in report["configs"])
    except KernelpackError as e:
        report["error"] = str(e)
    except Exception as e:
        import traceback

        traceback.print_exc()
        report["error"] = f"{type(e).__name__}: {e}"
    report["finished_at"] = time.time()
    Path(result_file).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(*sys.argv[2:]))
    sys.exit("usage: python -m kernelpack.verify --worker ARTIFACT SEED CHECK RESULT_FILE")
