"""Run one config's canonical calls (:mod:`kernelpack.canonical`) through the public entry point, and check them
against a reference computed without flex.

Builder and verifier both call :func:`run_config`, so what is verified is exactly what was built.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .canonical import call as canonical_call
from .canonical import grad_output, make_inputs
from .config import SCORE_MODS
from .evidence import delta, snapshot
from .masks import block_mask_for, mask_for, score_mod_for
from .runtime import flex_attention, guarded
from .signature import Graph, mask_key, score_mod_key

if TYPE_CHECKING:
    import torch

    from .config import Config

# ||out - ref|| / ||ref|| bounds: inputs are rounded to the dtype first, so only the kernel's arithmetic is judged.
# fp32 on CUDA runs the matmuls in tf32 (about 3e-4); bf16 gradients accumulate over the whole window.
TOLERANCE = {"float32": 2e-3, "float16": 1e-2, "bfloat16": 3e-2}


@dataclass(frozen=True, slots=True)
class CallResult:
    seconds: float  # wall time of the first canonical calls of every graph built, synchronized
    errors: dict[str, float]  # relative error per graph and output/gradient, "fwd+bwd:dq" (empty when not checked)
    mask_key: str  # what the call's mask_mod computes (signature.mask_key): the manifest records it
    score_key: str = ""  # what its score_mod computes (signature.score_mod_key), for a score_mod factory
    # a dynamic range config: the other (q_len, kv_len) called after the traced one, and what those calls traced
    # (Dynamo frames) or compiled; none of it may happen: one graph serves the range
    lengths: list[tuple[int, int]] = field(default_factory=list)
    lengths_counters: dict[str, int] = field(default_factory=dict)


def range_lengths(config: Config, n: int, seed: int) -> list[tuple[int, int]]:
    """Lengths a dynamic range config is checked at, besides its traced one: both ends of its ranges (and for
    independent q_len and kv_len ranges the other two corners), then ``n`` random lengths that are not multiples of
    128 where the range has such (seeded)."""
    if config.q_range is None or config.kv_range is None:
        return []
    (q0, q1), (k0, k1) = config.q_range, config.kv_range
    tied = config.tied
    rng = random.Random(seed)

    def draw(lo: int, hi: int) -> int:
        for _ in range(16):
            x = rng.randint(lo, hi)
            if x % 128:
                break
        return x

    out = [(q0, k0), (q1, k1)] + ([] if tied else [(q0, k1), (q1, k0)])
    for _ in range(n):
        q = draw(q0, q1)
        out.append((q, q) if tied else (q, draw(k0, k1)))
    return [x for i, x in enumerate(out) if x not in out[:i] and x != (config.q_len, config.kv_len)]


def run_config(
    config: Config,
    device: Any,
    *,
    check: bool = True,
    lengths: list[tuple[int, int]] | None = None,
    free: Collection[str] = (),
) -> CallResult:
    """The canonical calls of every graph of the config (:mod:`kernelpack.canonical`): fresh inputs, the canonical
    BlockMask, forward (+ backward), then the reference check. For a dynamic range config, then the same calls at
    each of ``lengths`` (in its ranges), counting what they traced or compiled; checked against the reference at the
    ends of the ranges. ``free``: the mask's values its manifest entry keys by type (the mask key is so)."""
    result = _run_config(config, device, check=check, free=free)
    if not lengths:
        return result
    before = snapshot()
    for i, (q, kv) in enumerate(lengths):
        at = config.at(q, kv)
        errors = _run_config(at, device, check=check and i < 2).errors
        result.errors.update({f"{k}@{q}x{kv}": v for k, v in errors.items()})
    return dataclasses.replace(result, lengths=list(lengths), lengths_counters=delta(before, snapshot()))


def _run_config(config: Config, device: Any, *, check: bool, free: Collection[str] = ()) -> CallResult:
    # The public wrapper for the default options, so that verify proves what users call. A dynamic range config is
    # called through it too: it picks the dynamic graph for a call the active artifact's range covers, and in the
    # builder (nothing active) guarded(dynamic=True) is the same compiled callable.
    fn = flex_attention if (config.mode, config.dynamic) == ("default", False) else guarded(config.mode, config.dynamic)
    bm = block_mask_for(config, device)
    errors: dict[str, float] = {}
    seconds = 0.0
    for graph in config.graphs:
        inputs = make_inputs(config, device, graph)
        dout = grad_output(inputs[0]) if graph == "fwd+bwd" else None  # drawn before the clock starts
        _sync(device)
        start = time.perf_counter()
        out, grads, lse = canonical_call(fn, config, graph, inputs, bm, dout)
        _sync(device)
        seconds += time.perf_counter() - start
        if check:
            *ref, ref_lse = reference_attention(config, *inputs, dout, with_lse=True)
            if grads and config.alias != "none":
                ref = [ref[0], *_aliased(ref[1:], config.alias)]
            for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *grads), ref, strict=False):
                errors[f"{graph}:{name}"] = _rel_error(g, r)
            if lse is not None:
                errors[f"{graph}:lse"] = _rel_error(lse.nan_to_num(0.0, 0.0, 0.0), ref_lse.nan_to_num(0.0, 0.0, 0.0))
    score_key = score_mod_key(score_mod_for(config)) if config.score_mod not in SCORE_MODS else ""
    return CallResult(seconds=seconds, errors=errors, mask_key=mask_key(bm.mask_mod, free), score_key=score_key)


@dataclass(frozen=True, slots=True)
class PrecompiledResult:
    """Tier 2 of one graph in verify: what loading its function and its first canonical call took and compiled, and
    how its outputs compare with tier 1's on the same inputs."""

    graph: Graph
    seconds: float = 0.0  # load + first canonical call, synchronized
    counters: dict[str, int] = field(default_factory=dict)  # what they traced or compiled (nothing, or it failed)
    error: str = ""  # the load or the call failed
    equal: bool | None = None  # bitwise equal to tier 1's outputs (None: not compared)
    rel_error: float = 0.0  # against tier 1's outputs


def run_precompiled(
    config: Config,
    device: Any,
    path: str,
    sha256: str,
    graph: Graph,
    lengths: list[tuple[int, int]] | None = None,
) -> tuple[PrecompiledResult, Any]:
    """Load a graph's precompiled function and make the canonical call (:func:`run_config`'s inputs) through it;
    for a dynamic range config then at each of ``lengths`` too (its guards must hold there). Returns the result and
    the outputs (out, *grads) of the first call, for :func:`compare_precompiled` after tier 1 has run."""
    from . import precompiled

    bm = block_mask_for(config, device)
    inputs = make_inputs(config, device, graph)
    dout = grad_output(inputs[0]) if graph == "fwd+bwd" else None
    before = snapshot()
    _sync(device)
    start = time.perf_counter()
    try:
        loaded = precompiled.load(path, config.device, sha256)
        out, grads, _ = canonical_call(loaded.checked, config, graph, inputs, bm, dout)
        _sync(device)
        seconds = time.perf_counter() - start
        for q, kv in lengths or ():
            at = config.at(q, kv)
            at_inputs = make_inputs(at, device, graph)
            at_dout = grad_output(at_inputs[0]) if graph == "fwd+bwd" else None
            canonical_call(loaded.checked, at, graph, at_inputs, block_mask_for(at, device), at_dout)
    except Exception as e:
        return PrecompiledResult(graph, error=f"{type(e).__name__}: {e}"[:1000]), None
    return PrecompiledResult(graph, seconds, delta(before, snapshot())), (out, *grads)


def compare_precompiled(config: Config, device: Any, result: PrecompiledResult, outputs: Any) -> PrecompiledResult:
    """Tier 1's canonical call on the same inputs (warm by now), against tier 2's outputs."""
    import torch

    fn = flex_attention if (config.mode, config.dynamic) == ("default", False) else guarded(config.mode, config.dynamic)
    inputs = make_inputs(config, device, result.graph)
    dout = grad_output(inputs[0]) if result.graph == "fwd+bwd" else None
    out, grads, _ = canonical_call(fn, config, result.graph, inputs, block_mask_for(config, device), dout)
    pairs = list(zip(outputs, (out, *grads), strict=True))
    equal = all(torch.equal(a, b) for a, b in pairs)
    rel = max(_rel_error(a.double(), b.detach().double()) for a, b in pairs)
    return dataclasses.replace(result, equal=equal, rel_error=rel)


def _aliased(grads: list[Any], alias: str) -> list[Any]:
    """The reference gradients of q, k, v as autograd returns them when one tensor is passed for several (``alias``
    "k=v", "q=k=v", ...): the sum over the positions it fills, for each of them."""
    shared = set(alias.replace("=", ""))
    total = sum(grads["qkv".index(n)] for n in sorted(shared))
    return [total if n in shared else g for n, g in zip("qkv", grads, strict=True)]


def check_errors(config: Config, errors: dict[str, float]) -> str | None:
    """A message naming what is off, or None when every output is within the dtype's tolerance."""
    tol = TOLERANCE[config.dtype]
    bad = {k: v for k, v in errors.items() if not (v <= tol)}  # NaN fails too
    if bad:
        detail = ", ".join(f"{k} rel. error {v:.2e}" for k, v in bad.items())
        return f"compiled output differs from the reference: {detail} (tolerance {tol:.0e} for {config.dtype})"
    return None


def _rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got64 = got.detach().to(ref.device, ref.dtype)
    denom = ref.norm().item()
    return float((got64 - ref).norm().item() / (denom if denom > 0 else 1.0))


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def reference_attention(
    config: Config,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor | None,
    chunk: int = 1024,
    *,
    with_lse: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Masked softmax attention in float64, without flex: forward and, given ``dout``, the exact gradients; with
    ``with_lse`` the row log-sum-exp of the scaled scores (natural log, as flex_attention returns it) last.

    Written out (not autograd) and chunked over query rows so that even 16k-long sequences never hold a full score
    matrix: memory is one ``chunk x kv_len`` block per step. Rows the mask empties produce 0, like flex_attention.
    """
    import torch

    mask_mod = mask_for(config, q.device)
    score_mod = score_mod_for(config)
    dev = q.device
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    do64 = dout.double() if dout is not None else None
    scale = config.scale if config.scale is not None else config.head_dim**-0.5
    group = config.q_heads // config.kv_heads
    out = torch.zeros_like(q64)
    lse_all = torch.zeros(q64.shape[:-1], dtype=q64.dtype, device=dev)
    dq = torch.zeros_like(q64) if do64 is not None else None
    dk = torch.zeros_like(k64) if do64 is not None else None
    dv = torch.zeros_like(v64) if do64 is not None else None
    kv_idx = torch.arange(config.kv_len, device=dev)[None, :]
    for b in range(config.batch):
        b_t = torch.tensor(b, device=dev)
        for h in range(config.q_heads):
            hk = h // group
            h_t = torch.tensor(h, device=dev)
            kk, vv = k64[b, hk], v64[b, hk]
            for i0 in range(0, config.q_len, chunk):
                i1 = min(i0 + chunk, config.q_len)
                q_idx = torch.arange(i0, i1, device=dev)[:, None]
                allowed = mask_mod(b_t, h_t, q_idx, kv_idx).expand(i1 - i0, config.kv_len)
                s = (q64[b, h, i0:i1] @ kk.T) * scale
                if score_mod is not None:  # elementwise, on broadcast index tensors as flex evaluates it
                    s = score_mod(s, b_t, h_t, q_idx, kv_idx)
                s = s.masked_fill(~allowed, float("-inf"))
                lse = torch.logsumexp(s, dim=-1, keepdim=True)
                lse_all[b, h, i0:i1] = lse[:, 0]
                p = torch.exp(s - lse).nan_to_num(0.0)  # fully masked rows: -inf - -inf
                o = p @ vv
                out[b, h, i0:i1] = o
                if do64 is not None:
                    assert dq is not None and dk is not None and dv is not None
                    do = do64[b, h, i0:i1]
                    dp = do @ vv.T
                    ds = p * (dp - (do * o).sum(-1, keepdim=True))
                    dq[b, h, i0:i1] = (ds @ kk) * scale
                    dk[b, hk] += (ds.T @ q64[b, h, i0:i1]) * scale
                    dv[b, hk] += p.T @ do
    extra = (lse_all,) if with_lse else ()
    if do64 is None:
        return (out, *extra)
    assert dq is not None and dk is not None and dv is not None
    return (out, dq, dk, dv, *extra)
