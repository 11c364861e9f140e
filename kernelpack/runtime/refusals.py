"""Why a call is not served, in the user's terms: each server's :class:`Rejection`, and the refusal the chain's
rejections make (:func:`refused`): strict mode's refusal of an uncovered call (the nearest covered signatures and the
one field that differs), the refusal of a call the warm-up did not warm (the Dynamo guard that failed, and its fix).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import functions
from ..errors import DEVICE_HINT, KernelpackError, NotPrecompiledError, NotWarmedError
from ..manifest import Coverage
from ..masks import mask_for
from ..signature import CallSignature
from .calls import FlexCall
from .session import Activation, Warmup


def _mask_differs(coverage: Coverage) -> bool:
    return bool(coverage.nearest) and "mask" in [d[0] for d in coverage.nearest[0].differences]


def mask_detail(active: Activation, coverage: Coverage, arguments: Mapping[str, Any]) -> str:
    """For a refusal whose nearest covered signature differs in its mask: which of the mask's values differ from the
    artifact's (``window: 2048 built, None here``), or that it runs other code; "" when that cannot be told."""
    manifest = active.manifest
    mask_mod = getattr(arguments.get("block_mask"), "mask_mod", None)
    if manifest is None or mask_mod is None or not _mask_differs(coverage):
        return ""
    built = next((c for c in manifest.configs if c.id == coverage.nearest[0].config_id), None)
    if built is None:
        return ""
    try:
        covered = mask_for(built.config, arguments["query"].device)
    except Exception:  # a courtesy: the refusal stands without it
        return ""
    diffs = functions.differences(covered, mask_mod, built.mask_free)
    if not diffs:
        return ""
    if diffs[0][0] == "code":
        return (
            f"the call's mask_mod is {diffs[0][2]}, the artifact's {diffs[0][1]}: other code is another graph (build "
            "the BlockMask with the function the recipe names)"
        )
    shown = "; ".join(f"{path}: {a} built, {b} here" for path, a, b in diffs[:4])
    more = f" (and {len(diffs) - 4} more)" if len(diffs) > 4 else ""
    return f"the call's mask closes over other values than the artifact's: {shown}{more}"


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why one server of the chain (:mod:`.serving`) did not serve a call: its name, what kind of no it is, and the
    detail, formatted only if the call is refused (a served call never pays for it).

    Kinds: ``"guards"``, a warmed function or Dynamo entry of the call's signature exists and fails the call (the
    detail: the guard that failed, in Dynamo's words); ``"not warmed"``, the artifact covers the call but this
    process did not warm it (the detail says why); ``"range"``, a dynamic graph's guards pass for a length the
    artifact does not cover (strict); ``"none"``, nothing of this server's is there for the call."""

    server: str
    kind: str
    detail: Callable[[], str] | None = None

    def why(self) -> str:
        return self.detail() if self.detail is not None else ""


def refused(
    call: FlexCall, trace: Sequence[Rejection], active: Activation, warm: Warmup | None
) -> tuple[KernelpackError, str]:
    """The error for a call no server served, formatted from the chain's ``trace``, and its reason in one line (the
    report's). Strict mode refuses an uncovered call (:func:`refusal`, with the nearest covered configs); any other
    call is one activate() did not warm, or one that differs from the warm-up's in what Dynamo guards on
    (:func:`not_warmed`)."""
    coverage = call.coverage(active)
    if coverage.entry is None and active.strict:
        error: KernelpackError = refusal(
            coverage, active.artifact, detail=mask_detail(active, coverage, call.arguments)
        )
        return error, "not covered by the artifact (strict mode)"
    error = not_warmed(coverage, trace, call.arguments, active)
    return error, error.reason.splitlines()[0]


def not_warmed(
    coverage: Coverage,
    trace: Sequence[Rejection] = (),
    arguments: Mapping[str, Any] | None = None,
    active: Activation | None = None,
) -> NotWarmedError:
    """After the warm-up, a call no server served: one the artifact does not cover (non-strict mode still refuses
    it: tracing it could hang threads), one activate() did not warm (a :class:`Rejection` of kind "not warmed" says
    why), or one that differs from the warm-up's in what Dynamo guards on (the first rejection of kind "guards" says
    which guard)."""
    sig = coverage.signature
    hint = (
        "make the call as the recipe declares it (its [call] layout, scale and flags; the BlockMask from the "
        "recipe's mask function; its score_mod), as the warm-up did (kernelpack.canonical); or activate(warmup=False), "
        "where no other thread runs backward while a first call compiles"
    )
    if coverage.entry is None:
        reason = "the artifact does not cover it; nearest covered:\n" + "\n".join(
            f"  {n.describe()}" for n in coverage.nearest
        )
        detail = mask_detail(active, coverage, arguments or {}) if active is not None else ""
        if detail:
            reason += "\n" + detail
        hint = (
            "add it to the recipe and rebuild; non-strict mode compiles uncovered calls only with "
            "activate(warmup=False), where no other thread runs backward while a first call compiles"
        )
        if coverage.only is not None and coverage.only[0] == "device_index":
            hint = DEVICE_HINT
        lengths = length_hint(coverage)
        if lengths:
            hint = f"{lengths}; non-strict mode compiles uncovered calls only with activate(warmup=False)"
    elif (skipped := next((r for r in trace if r.kind == "not warmed"), None)) is not None:
        reason = f"the artifact covers it, but activate() did not warm it: {skipped.why()}"
    else:
        failed = next((r.why() for r in trace if r.kind == "guards"), "")
        reason = (
            "the artifact covers it and activate() warmed it, but this call differs from the warm-up's in what "
            "Dynamo guards on: " + (failed or "(torch does not say which guard)")
        )
        hint = guard_hint(failed, sig) or hint
    return NotWarmedError(sig.describe(), reason, hint=hint)


def guard_hint(failed: str, sig: CallSignature) -> str | None:
    """The fix for the guard a warmed call fails (Dynamo's words, :func:`kernelpack.compiled.guard_failure`): a
    tensor's strides or sizes (q, k, v laid out otherwise than the warm-up's, or a BlockMask's tables), the mask
    function's code, a pytree node type registered late, global state. None when none of these is named."""
    tensor = re.search(r"tensor '(.+?)' (stride|size|dtype|device|requires_grad)", failed)
    if tensor is not None:  # first: a tensor guard is what failed, whatever else a code check says
        source, what = tensor.group(1), tensor.group(2)
        name = re.search(r"\['(\w+)'\]", source)
        argument = name.group(1) if name else source
        if argument in ("query", "key", "value"):
            return (
                f"{argument}'s {what}s differ from the warm-up's, which Dynamo guards on (this call's layout: "
                f"{sig.layout}; a size-1 dim's stride counts, and with dynamic shapes a view is guarded through its "
                "base): pass q, k, v as the recipe's layout says (kernelpack.signature.layout_of names a tensor's), "
                "or record the job (kernelpack record) for the layouts it really passes and rebuild"
            )
        return (
            f"{source}'s {what} differs from the warm-up's, which Dynamo guards on: build the BlockMask as the "
            "recipe's (its mask_dims, block_size; kernelpack.masks.block_mask_for makes the warm-up's)"
        )
    if "mask_mod" in failed:
        return (
            "build the BlockMask from the recipe's mask function (kernelpack.masks.sliding_window(W), or the "
            "recipe's factory): another function object with other code is another Dynamo entry, even when it "
            "computes the same"
        )
    if "SUPPORTED_NODES" in failed:
        # kernelpack's own graphs do not keep this guard (_torch.dynamo.guard_filter): a precompiled function
        # of an older build does, or a graph traced outside kernelpack
        return (
            "a pytree node type was registered after activate() (importing a transformers model module "
            "registers its output classes), and this graph keeps Dynamo's guard on their count: an artifact "
            "built before kernelpack dropped that guard (2026-12-02). Rebuild the artifact, or import your model "
            "code before kernelpack.runtime.activate()"
        )
    if "GLOBAL_STATE" in failed or "dispatch" in failed.lower():
        return (
            "this call runs under other global torch state than the warm-up (autocast, deterministic "
            "algorithms, inference_mode, ...), which Dynamo guards on: make the flex call outside autocast and "
            "inference_mode (its inputs are already in the recipe's dtype), with the settings in force at "
            "activate()"
        )
    return None


def refusal(coverage: Coverage, artifact: str | None, *, detail: str = "") -> NotPrecompiledError:
    """Strict mode's error for an uncovered call: the call, the nearest covered signatures with what differs, and
    the one field that differs when only one does (device index: pinning; graph: the recipe's graphs; a length: the
    covered range and the fix)."""
    return NotPrecompiledError(
        coverage.signature.describe(),
        [n.describe() for n in coverage.nearest],
        artifact=artifact,
        only=coverage.only,
        detail=detail,
        hint=length_hint(coverage),
    )


def length_hint(coverage: Coverage) -> str | None:
    """The fix for a call the nearest covered config misses only in its lengths: the covered range (or lengths) and
    the three ways to serve it. None when something else differs too."""
    if not coverage.nearest:
        return None
    diffs = coverage.nearest[0].differences
    if not diffs or any(name not in ("q_len", "kv_len") for name, _, _ in diffs):
        return None
    told = ", ".join(f"{name} {value} (covered: {covered})" for name, covered, value in diffs)
    near = coverage.nearest[0].signature
    blocks = {"q_len": near.block_size[0], "kv_len": near.block_size[1]}
    small = [(n, v) for n, covered, v in diffs if isinstance(covered, str) and ".." in covered and v <= blocks[n]]
    if small:
        # torch specializes a length of one block or less (its BlockMask has one block): no dynamic range can hold it
        name, value = small[0]
        key = "seq_len" if len(small) == 2 and small[0][1] == small[1][1] else name
        return (
            f"{told}: a {name} of one block ({blocks[name]}) or less is its own static graph, never part of a dynamic "
            f"range: add a [[calls]] table with {key} = {value} (or record a step at that length) and rebuild, or pad "
            "the batch into the range (kernelpack.runtime.padded_lengths)"
        )
    return (
        f"{told}: widen the range (kernelpack record --lengths MIN:MAX, or the recipe's {{ min, max }}) and rebuild, "
        "pad the batch to a covered length (kernelpack.runtime.padded_lengths), or add a bucket for it"
    )
