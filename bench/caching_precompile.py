"""torch's caching precompile (TORCH_CACHING_PRECOMPILE=1 + save/load_cache_artifacts) side by side with kernelpack's
tiers, on one torch, every sample a fresh process.

Workloads:
  w1  recipes/smoke-cpu.toml: q, k, v [1, 2, 256, 64] float32, causal sliding window 64 and 128, forward (no_grad)
  w2  a random-weight 2-layer MistralForCausalLM (hidden 128, 4 heads, 2 kv heads, head_dim 32, window 64, float32),
      no_grad forward at 128 then 256 tokens

Arms (the job process always starts with an empty TORCHINDUCTOR_CACHE_DIR, except D-warm):
  A  torch caching precompile: a build process with TORCH_CACHING_PRECOMPILE=1 makes the workload's calls through
     torch.compile(flex_attention, dynamic=False) (w1) or transformers' attn_implementation="flex_attention" (w2) and
     writes torch.compiler.save_cache_artifacts() to a file; the job (TORCH_CACHING_PRECOMPILE=1) calls
     torch.compiler.load_cache_artifacts(blob), then makes the calls
  B  kernelpack tier 2: `kernelpack build`, then runtime.activate(artifact, cache_dir=<empty>), then the calls through
     kernelpack.flex_attention (w1) or attn_implementation="kernelpack" (w2)
  C  kernelpack tier 1 only: B with KERNELPACK_PRECOMPILED=0 in the job
  D  native: torch.compile(flex_attention) / transformers' flex with the cache dir a cold process filled (warm), and
     that cold process itself (once)

Per job process: load/activate seconds, every first call's seconds and torch counters (Dynamo frames traced,
unique graphs, FX-graph/AOTAutograd cache hits and misses, C++ kernels compiled), steady-state ms, and for B/C
kernelpack's runtime.report(). The first repeat of each arm also makes an uncovered call (w1: seq 384; w2: 384
tokens) after the covered ones. Separate processes per arm: 3 threads making every covered call at once right after
the load (threading.Barrier, joins bounded by --thread-timeout), and for B/C activate(strict=False) + the uncovered
call.

    PYTHONPATH=/tmp/kp-snap python bench/caching_precompile.py --workloads w1,w2 --repeats 3 \
        --out docs/data/caching-precompile
    python bench/caching_precompile.py --summarize docs/data/caching-precompile   # Markdown tables of every JSON

Writes <out>/<torch version>.json (everything, every process's raw numbers); prints each sample as it ends.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ARMS = ("A", "B", "C", "D")
ARM_NAMES = {
    "A": "torch caching precompile",
    "B": "kernelpack tier 2",
    "C": "kernelpack tier 1 only",
    "D": "native warm cache",
    "D-cold": "native cold",
}
W1_UNCOVERED = 384
W2_LENGTHS = (128, 256)
W2_UNCOVERED = 384
STEADY_CALLS = {"w1": 20, "w2": 5}

# ----------------------------------------------------------------------------------------------------------- child


def counters_now() -> dict[str, int]:
    from torch._dynamo.utils import counters

    from kernelpack import evidence

    snap = {
        "frames_ok": int(counters["frames"]["ok"]),
        "frames_total": int(counters["frames"]["total"]),
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "fx_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
        "fx_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fx_bypass": int(counters["inductor"]["fxgraph_cache_bypass"]),
        "aot_miss": int(counters["aot_autograd"]["autograd_cache_miss"]),
        "aot_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "dynamo_cache_hit": int(counters["dynamo_cache"]["dynamo_cache_hit"]),
        "dynamo_cache_miss": int(counters["dynamo_cache"]["dynamo_cache_miss"]),
    }
    own = evidence.snapshot()
    snap["cpp_compiled"] = int(own.get("cpp_compiled", 0))
    snap["dense_calls"] = int(own.get("dense_calls", 0))
    return snap


def diff(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}


class W1:
    """The smoke recipe's canonical calls (kernelpack.canonical), the uncovered one at seq 384."""

    def __init__(self, arm: str, recipe: str) -> None:
        import torch

        from kernelpack import canonical, masks
        from kernelpack.recipe import load_recipe

        self.torch, self.canonical = torch, canonical
        self.configs = load_recipe(recipe).configs
        self.inputs = [canonical.make_inputs(c, "cpu", "fwd") for c in self.configs]
        self.masks = [masks.block_mask_for(c, "cpu") for c in self.configs]
        gen = torch.Generator().manual_seed(0)
        n = W1_UNCOVERED
        self.unc_inputs = tuple(torch.randn(1, 2, n, 64, generator=gen) for _ in range(3))
        self.unc_mask = masks.block_mask(masks.sliding_window(64), n, n, "cpu")
        self.arm = arm

    def bind(self, fn: Any) -> None:
        self.fn = fn

    def calls(self) -> list[tuple[str, Any]]:
        return [
            (c.id, lambda c=c, i=i, m=m: self.canonical.call(self.fn, c, "fwd", i, m))
            for c, i, m in zip(self.configs, self.inputs, self.masks, strict=True)
        ]

    def uncovered(self) -> tuple[str, Any]:
        def run() -> Any:
            q, k, v = self.unc_inputs
            with self.torch.no_grad():
                return self.fn(q, k, v, block_mask=self.unc_mask)

        return f"seq {W1_UNCOVERED} window 64", run

    def other_mask(self) -> tuple[str, Any, Any]:
        """A covered shape (seq 256) with another mask function: bidirectional window 64, a graph nobody built.
        Returns the call and the float64 references of the mask it asks for and of the covered causal one."""
        from kernelpack import masks

        torch = self.torch
        q, k, v = self.inputs[0]
        bm = masks.block_mask(masks.sliding_window_bidirectional(64), 256, 256, "cpu")
        i = torch.arange(256)
        d = i[:, None] - i[None, :]
        s = (q.double() @ k.double().transpose(-1, -2)) / 8.0

        def ref(allowed: Any) -> Any:
            return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v.double()

        def run() -> Any:
            with torch.no_grad():
                return self.fn(q, k, v, block_mask=bm)

        refs = {"bidirectional_64": ref((d < 64) & (-d < 64)), "causal_64": ref((d >= 0) & (d < 64))}
        return "seq 256, sliding_window_bidirectional(64)", run, refs


def mistral_config() -> Any:
    from transformers import MistralConfig

    return MistralConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=64,
        max_position_embeddings=1024,
    )


class W2:
    """A random-weight Mistral's no_grad forward at 128 and 256 tokens; uncovered: 384 tokens."""

    def __init__(self, arm: str, recipe: str) -> None:
        import torch
        from transformers import MistralForCausalLM  # before activate(): its pytree nodes (README "Transformers")

        self.torch, self.cls = torch, MistralForCausalLM
        self.config = mistral_config()
        gen = torch.Generator().manual_seed(0)
        self.ids = {n: torch.randint(0, 256, (1, n), generator=gen) for n in (*W2_LENGTHS, W2_UNCOVERED)}

    def bind(self, attn: str) -> None:
        self.torch.manual_seed(0)
        self.config._attn_implementation = attn
        self.model = self.cls(self.config).eval()

    def _forward(self, n: int) -> Any:
        with self.torch.no_grad():
            return self.model(self.ids[n], use_cache=False).logits

    def calls(self) -> list[tuple[str, Any]]:
        return [(f"forward {n}", lambda n=n: self._forward(n)) for n in W2_LENGTHS]

    def uncovered(self) -> tuple[str, Any]:
        return f"forward {W2_UNCOVERED}", lambda: self._forward(W2_UNCOVERED)


def kp_report() -> dict[str, Any]:
    from kernelpack import runtime

    r = runtime.report().to_dict()
    return {
        "summary": r["summary"],
        "precompiled": r["precompiled"],
        "inductor_cache_tier": r["inductor_cache_tier"],
        "served_tiers": sorted({s["tier"] for s in r["served"]}),
        "warmup_seconds": r["warmup_seconds"],
        "first_calls": [[c["call"], c["tier"], c["seconds"], c["warmup"], c["compiled"]] for c in r["first_calls"]],
        "compiles_outside_warmup": [
            {k: c[k] for k in ("path", "thread", "fx_misses", "cpp_compiled", "missed", "failed", "seconds")}
            for c in r["compiles"]
            if c["path"] != "kernelpack warm-up"
        ],
        "compiles_in_warmup": sum(1 for c in r["compiles"] if c["path"] == "kernelpack warm-up"),
        "refused": r["refused"],
        "dense": len(r["dense"]),
    }


def timed(fn: Any) -> tuple[float, str | None]:
    t = time.perf_counter()
    try:
        fn()
        return time.perf_counter() - t, None
    except BaseException as e:
        return time.perf_counter() - t, f"{type(e).__name__}: {e}"


def child(spec: dict[str, Any]) -> None:
    arm, role, wl = spec["arm"], spec["role"], spec["workload"]
    import torch

    from kernelpack import evidence

    evidence.install_hooks()
    work = (W1 if wl == "w1" else W2)(arm, spec["recipe"])
    out: dict[str, Any] = {
        "arm": arm,
        "role": role,
        "workload": wl,
        "torch": torch.__version__,
        "env": {k: os.environ.get(k) for k in ("TORCH_CACHING_PRECOMPILE", "KERNELPACK_PRECOMPILED")},
    }
    before_prep = counters_now()
    t0 = time.perf_counter()
    if arm == "A" and role != "build":
        info = torch.compiler.load_cache_artifacts(Path(spec["blob"]).read_bytes())
        out["load_s"] = time.perf_counter() - t0
        out["cache_info"] = {k: len(v) for k, v in vars(info).items()} if info is not None else None
    elif arm in ("B", "C"):
        from kernelpack import runtime

        if wl == "w2":
            from kernelpack.integrations import transformers as kp_tf

            kp_tf.register()
        runtime.activate(spec["artifact"], cache_dir=spec["cache_dir"], strict=spec.get("strict", True))
        out["load_s"] = time.perf_counter() - t0
    else:
        out["load_s"] = 0.0
    t1 = time.perf_counter()
    if wl == "w1":
        if arm in ("B", "C"):
            import kernelpack

            work.bind(kernelpack.flex_attention)
        else:
            from torch.nn.attention.flex_attention import flex_attention

            work.bind(torch.compile(flex_attention, dynamic=False))  # A: DynamoCache.load() of the package is here
    else:
        work.bind("kernelpack" if arm in ("B", "C") else "flex_attention")
    out["bind_s"] = time.perf_counter() - t1
    out["prep_counters"] = diff(before_prep, counters_now())
    if arm in ("B", "C"):
        out["report_after_activate"] = kp_report()

    if role == "threads":
        import threading

        n = 3
        barrier = threading.Barrier(n)
        results: list[dict[str, Any]] = [{} for _ in range(n)]

        def worker(i: int) -> None:
            r = results[i]
            try:
                barrier.wait(timeout=60)
            except threading.BrokenBarrierError as e:
                r["error"] = f"barrier: {e!r}"
                return
            r["calls"] = []
            for name, fn in work.calls():
                s, err = timed(fn)
                r["calls"].append([name, s, err])

        before = counters_now()
        t = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(i,), daemon=True, name=f"worker-{i}") for i in range(n)]
        for th in threads:
            th.start()
        deadline = time.monotonic() + spec["thread_timeout"]
        for th in threads:
            th.join(timeout=max(0.0, deadline - time.monotonic()))
        out["threads_wall_s"] = time.perf_counter() - t
        out["hung"] = [th.name for th in threads if th.is_alive()]
        out["threads"] = results
        out["counters"] = diff(before, counters_now())
        out["errors"] = sum(1 for r in results for c in r.get("calls", []) if c[2]) + sum(
            1 for r in results if "error" in r
        )
        if arm in ("B", "C"):
            out["report"] = kp_report()
        Path(spec["result"]).write_text(json.dumps(out))
        sys.stdout.flush()
        os._exit(0)  # a hung daemon thread must not keep the process alive

    before = counters_now()
    out["first_calls"] = []
    for name, fn in work.calls():
        c0 = counters_now()
        s, err = timed(fn)
        out["first_calls"].append({"call": name, "s": s, "error": err, "counters": diff(c0, counters_now())})
    out["calls_counters"] = diff(before, counters_now())
    out["first_calls_total_s"] = sum(c["s"] for c in out["first_calls"])
    if role == "build" and arm == "A":
        saved = torch.compiler.save_cache_artifacts()
        assert saved is not None, "save_cache_artifacts() returned None"
        Path(spec["blob"]).write_bytes(saved[0])
        out["blob_bytes"] = len(saved[0])
        out["saved_info"] = {k: len(v) for k, v in vars(saved[1]).items()}
    if role != "nonstrict":
        out["steady_ms"] = {}
        for name, fn in work.calls():
            times = []
            for _ in range(STEADY_CALLS[wl]):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
            out["steady_ms"][name] = statistics.median(times)
    if spec.get("uncovered"):
        name, fn = work.uncovered()
        c0 = counters_now()
        s, err = timed(fn)
        out["uncovered"] = {"call": name, "s": s, "error": err and err[:1500], "counters": diff(c0, counters_now())}
        if arm == "A":
            # what the recompile said, if anything: torch's own recompile reasons for this code
            from torch._dynamo.utils import counters

            out["uncovered"]["recompiles"] = {k: v for k, v in counters["recompiles"].items()} or None
        if wl == "w1":
            name, fn, refs = work.other_mask()
            c0 = counters_now()
            box: list[Any] = []
            s, err = timed(lambda: box.append(fn()))
            om: dict[str, Any] = {
                "call": name,
                "s": s,
                "error": err and err[:1500],
                "counters": diff(c0, counters_now()),
            }
            if box:
                om["max_abs_diff"] = {k: float((box[0].double() - r).abs().max()) for k, r in refs.items()}
            out["other_mask"] = om
    if arm in ("B", "C"):
        out["report"] = kp_report()
    Path(spec["result"]).write_text(json.dumps(out))


# ---------------------------------------------------------------------------------------------------------- parent


def run_child(spec: dict[str, Any], env_extra: dict[str, str], timeout: float) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=spec["cache_dir"], PYTHONUNBUFFERED="1")
    for k in ("TORCH_CACHING_PRECOMPILE", "KERNELPACK_PRECOMPILED", "TRITON_CACHE_DIR"):
        env.pop(k, None)
    env.update(env_extra)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        spec = dict(spec, result=f.name)
    t = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"arm": spec["arm"], "role": spec["role"], "failed": f"timed out after {timeout} s"}
    wall = time.perf_counter() - t
    text = Path(spec["result"]).read_text() if os.path.getsize(spec["result"]) else ""
    os.unlink(spec["result"])
    if proc.returncode != 0 or not text:
        return {
            "arm": spec["arm"],
            "role": spec["role"],
            "failed": f"rc {proc.returncode}",
            "stderr_tail": proc.stderr[-4000:],
            "process_wall_s": wall,
        }
    data = json.loads(text)
    data["process_wall_s"] = wall
    data["stderr_warnings"] = sorted({ln[:300] for ln in proc.stderr.splitlines() if "arning" in ln})[:10]
    return data


def env_of(arm: str) -> dict[str, str]:
    return {"A": {"TORCH_CACHING_PRECOMPILE": "1"}, "C": {"KERNELPACK_PRECOMPILED": "0"}}.get(arm, {})


def kp_build(recipe: Path, out: Path, cache: Path, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "kernelpack.cli", "build", str(recipe), "-o", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    s = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"kernelpack build failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    artifact = next(p for p in out.glob("*.kpack") if ".shard-" not in p.name)
    return {
        "seconds": s,
        "artifact": str(artifact),
        "artifact_bytes": artifact.stat().st_size,
        "command": " ".join(["python", "-m", "kernelpack.cli", "build", recipe.name, "-o", "OUT"]),
        "stdout_tail": proc.stdout[-1500:],
    }


def median_of(runs: list[dict[str, Any]], get: Any) -> float | None:
    vals = [get(r) for r in runs if "failed" not in r]
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def bench_workload(wl: str, repeats: int, timeout: float, thread_timeout: float, work: Path, log: Any) -> dict:
    import kernelpack

    root = Path(kernelpack.__file__).resolve().parents[1]
    res: dict[str, Any] = {"samples": {a: [] for a in ARMS}, "threads": {}, "nonstrict": {}}
    if wl == "w1":
        recipe = root / "recipes" / "smoke-cpu.toml"
    else:
        from kernelpack.integrations.transformers import recipe_for

        recipe = work / "mistral-tiny.toml"
        recipe.write_text(
            recipe_for(
                mistral_config(),
                seq_lens=list(W2_LENGTHS),
                dtype="float32",
                device="cpu",
                graphs=["fwd"],
                name="mistral-tiny",
            )
        )
        res["recipe_text"] = recipe.read_text()
    base = {"workload": wl, "recipe": str(recipe), "thread_timeout": thread_timeout}
    res["kernelpack_build"] = kp_build(recipe, work / "kp-out", work / "kp-build-cache", timeout)
    artifact = res["kernelpack_build"]["artifact"]
    log(
        f"[{wl}] kernelpack build {res['kernelpack_build']['seconds']:.1f} s, "
        f"{res['kernelpack_build']['artifact_bytes']} bytes"
    )
    blob = str(work / "caching-precompile.bin")
    t = time.perf_counter()
    res["A_build"] = run_child(
        dict(base, arm="A", role="build", blob=blob, cache_dir=str(work / "a-build")), env_of("A"), timeout
    )
    res["A_build"]["build_wall_s"] = time.perf_counter() - t
    if "failed" in res["A_build"]:
        log(f"[{wl}] A build FAILED: {res['A_build']}")
    else:
        log(f"[{wl}] A build {res['A_build']['process_wall_s']:.1f} s, blob {res['A_build']['blob_bytes']} bytes")
    warm = work / "d-warm"
    res["D_cold"] = run_child(dict(base, arm="D", role="cold", cache_dir=str(warm), uncovered=False), {}, timeout)
    log(f"[{wl}] D cold first calls {res['D_cold'].get('first_calls_total_s')}")

    def spec(arm: str, role: str, i: int, **kw: Any) -> dict[str, Any]:
        d = str(warm) if arm == "D" else str(work / f"{arm}-{role}-{i}")
        return dict(base, arm=arm, role=role, cache_dir=d, blob=blob, artifact=artifact, **kw)

    def one(key: str, s: dict[str, Any], store: Any) -> None:
        r = run_child(s, env_of(s["arm"]), timeout)
        store(r)
        if s["arm"] != "D":
            shutil.rmtree(s["cache_dir"], ignore_errors=True)
        brief = r.get("failed") or (
            f"load {r.get('load_s', 0):.2f} s, first calls {r.get('first_calls_total_s', 0):.2f} s, "
            f"calls counters {r.get('calls_counters', r.get('counters'))}"
            + (
                f", uncovered {r['uncovered']['s']:.2f} s err={bool(r['uncovered']['error'])}"
                if "uncovered" in r
                else ""
            )
            + (f", hung {r['hung']}, errors {r['errors']}" if "hung" in r else "")
        )
        log(f"[{wl}] {key}: {brief}")

    for i in range(repeats):
        for arm in ARMS:
            one(f"{arm} repeat {i + 1}", spec(arm, "main", i, uncovered=i == 0), res["samples"][arm].append)
    for arm in ARMS:
        one(f"{arm} threads", spec(arm, "threads", 0), lambda r, arm=arm: res["threads"].__setitem__(arm, r))
    for arm in ("B", "C"):
        one(
            f"{arm} strict=False",
            spec(arm, "nonstrict", 0, uncovered=True, strict=False),
            lambda r, arm=arm: res["nonstrict"].__setitem__(arm, r),
        )

    res["summary"] = {
        arm: {
            "load_s": median_of(runs, lambda r: r["load_s"] + r["bind_s"]),
            "first_calls_s": [median_of(runs, lambda r, j=j: r["first_calls"][j]["s"]) for j in range(2)],
            "first_calls_total_s": median_of(runs, lambda r: r["first_calls_total_s"]),
            "steady_ms": [median_of(runs, lambda r, j=j: list(r["steady_ms"].values())[j]) for j in range(2)],
            "compiles_in_calls": [r.get("calls_counters") for r in runs],
        }
        for arm, runs in res["samples"].items()
    }
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="w1,w2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="docs/data/caching-precompile")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--thread-timeout", type=float, default=300)
    ap.add_argument("--summarize", default=None, help="print the Markdown tables of every JSON in this folder")
    args = ap.parse_args()
    if args.summarize:
        for p in sorted(Path(args.summarize).glob("*.json")):
            print(tables(json.loads(p.read_text())))
        return
    import torch

    import kernelpack

    root = Path(kernelpack.__file__).resolve().parents[1]
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out_path = Path(args.out) / f"{torch.__version__.split('+')[0]}.json"
    data: dict[str, Any] = json.loads(out_path.read_text()) if out_path.exists() else {}
    data.update(
        {
            "torch": torch.__version__,
            "torch_git": torch.version.git_version,
            "kernelpack_commit": commit,
            "kernelpack_path": str(root),
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "cpu": cpu, "note": "shared with other work"},
            "command": "PYTHONPATH=" + str(root) + " " + sys.executable + " " + " ".join(sys.argv),
        }
    )
    data.setdefault("workloads", {})
    work = Path(tempfile.mkdtemp(prefix="kp-cachingprecompile-"))

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    try:
        for wl in args.workloads.split(","):
            wdir = work / wl
            wdir.mkdir()
            data["workloads"][wl] = bench_workload(wl, args.repeats, args.timeout, args.thread_timeout, wdir, log)
            out_path.write_text(json.dumps(data, indent=1))
            log(f"wrote {out_path}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(tables(data))


def _c(d: dict[str, int] | None) -> str:
    """Dynamo frames traced / FX-graph misses / C++ kernels compiled / dense (math-path) flex_attention calls."""
    if not d:
        return "0/0/0/0"
    return f"{d.get('frames_ok', 0)}/{d.get('fx_miss', 0)}/{d.get('cpp_compiled', 0)}/{d.get('dense_calls', 0)}"


def _unc(r: dict[str, Any]) -> str:
    u = r.get("uncovered")
    if not u:
        return "-"
    if u["error"]:
        return f"raised in {u['s']:.2f} s: `{u['error'].splitlines()[0][:110]}`"
    return f"served, {u['s']:.1f} s, compiles {_c(u['counters'])}"


def tables(data: dict[str, Any]) -> str:
    lines = [
        f"### torch {data['torch']} ({data['torch_git'][:12]}), kernelpack {data['kernelpack_commit']}, {data['date']}"
    ]
    for wl, res in data["workloads"].items():
        lines += [
            "",
            f"#### {wl}",
            "",
            "| arm | load (s) | first calls (s) | steady (ms) | compiles in calls (frames/FX miss/C++/dense), per run "
            "| uncovered shape (repeat 1) | 3 threads |",
            "|---|---|---|---|---|---|---|",
        ]
        for arm in ("A", "B", "C", "D", "D-cold"):
            runs = [res["D_cold"]] if arm == "D-cold" else res["samples"][arm]
            ok = [r for r in runs if "failed" not in r]
            if not ok:
                lines.append(f"| {arm} {ARM_NAMES[arm]} | failed: {runs[0].get('failed') if runs else '-'} |||||")
                continue
            load = median_of(ok, lambda r: r["load_s"] + r["bind_s"])
            fc = [median_of(ok, lambda r, j=j: r["first_calls"][j]["s"]) for j in range(len(ok[0]["first_calls"]))]
            st = [median_of(ok, lambda r, j=j: list(r["steady_ms"].values())[j]) for j in range(len(fc))]
            comp = ", ".join(_c(r.get("calls_counters")) for r in ok)
            th = res["threads"].get(arm) if arm != "D-cold" else None
            if th is None:
                ths = "-"
            elif "failed" in th:
                ths = f"process failed: {th['failed']}"
            else:
                ths = (
                    f"{th['errors']} errors, hung {len(th['hung'])}, {th['threads_wall_s']:.2f} s, "
                    f"compiles {_c(th['counters'])}"
                )
            lines.append(
                f"| {arm} {ARM_NAMES[arm]} | {load:.2f} | {' + '.join(f'{x:.2f}' for x in fc)} | "
                f"{' / '.join(f'{x:.2f}' for x in st)} | {comp} | {_unc(ok[0])} | {ths} |"
            )
        for arm, r in res.get("nonstrict", {}).items():
            lines.append(f"\n{arm} with activate(strict=False), uncovered: {_unc(r) if 'failed' not in r else r}")
        for arm in ARMS:
            r = (res["samples"][arm] or [{}])[0]
            om = r.get("other_mask") or (
                res.get("A_rerun_other_mask", {}).get("job", {}).get("other_mask") if arm == "A" else None
            )
            if om:
                what = (
                    f"raised in {om['s']:.2f} s: `{om['error'].splitlines()[0][:90]}`"
                    if om["error"]
                    else f"served in {om['s']:.2f} s, compiles {_c(om['counters'])}, max |out - ref| "
                    + ", ".join(f"{k}: {v:.2g}" for k, v in om["max_abs_diff"].items())
                )
                lines.append(f"\n{arm}, covered shape with another mask ({om['call']}): {what}")
        a = res.get("A_build", {})
        lines.append(
            f"\nbuilds: kernelpack {res['kernelpack_build']['seconds']:.1f} s, artifact "
            f"{res['kernelpack_build']['artifact_bytes']} B; caching precompile build process "
            f"{a.get('process_wall_s', 0):.1f} s, blob {a.get('blob_bytes')} B"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        main()
