"""Canonical mask_mods and the BlockMask helper that the builder and every worker must share.

The FX-graph cache key includes the mask_mod's traced graph, so the *order of operations* matters:
``(q >= kv) & (q - kv < w)`` and ``(q - kv < w) & (q >= kv)`` are different cache entries. These functions are
frozen: changing one invalidates every published artifact. The function name, module and argument names do not enter
the key. Each built-in mask_mod carries ``kernelpack_mask``, the name :func:`kernelpack.signature.mask_key` gives it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import closures, settings
from ._torch.flex import NoInternals, block_mask_of, block_tables
from .compiled import outside_first_calls
from .errors import KernelpackError
from .signature import DEFAULT_BLOCK_SIZE, mask_key

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

    from .config import Config

MaskMod = Callable[..., Any]


@functools.cache
def sliding_window(window: int) -> MaskMod:
    """Causal sliding window: query q attends to kv in (q - window, q]."""

    def sliding_window_mask(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    sliding_window_mask.kernelpack_mask = f"sliding_window({window})"  # type: ignore[attr-defined]
    return sliding_window_mask


@functools.cache
def sliding_window_bidirectional(window: int) -> MaskMod:
    """Bidirectional sliding window: |q - kv| < window."""

    def sliding_window_bidirectional_mask(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (q_idx - kv_idx < window) & (kv_idx - q_idx < window)

    sliding_window_bidirectional_mask.kernelpack_mask = f"sliding_window_bidirectional({window})"  # type: ignore[attr-defined]
    return sliding_window_bidirectional_mask


BUILTIN = {"sliding_window": sliding_window, "sliding_window_bidirectional": sliding_window_bidirectional}


def padded(mask_mod: MaskMod, kv_len: Any, device: Any = None) -> MaskMod:
    """``mask_mod`` with every key at ``kv_len`` and beyond masked out: the mask of a batch padded to its bucket
    (:func:`kernelpack.runtime.padded_length`), for a recipe with ``[call] padded = true``.

    ``kv_len`` is the real length: an int, or a 0-d integer tensor. It becomes an int32 tensor on ``device`` (the
    call's device; default: the tensor's own, or the CPU for an int), as the builder makes it: a tensor the mask
    closes over is a graph input, read by value at run time, so one compiled graph serves every real length of a
    bucket (Dynamo guards on its dtype and device). A Python int closed over would be a constant of the graph: a
    graph per length. Make it per step with the same
    ``mask_mod``; padded query rows compute garbage that the caller drops (``out[:, :, :n]``), which also keeps their
    gradients out of the real rows'. A causal mask needs none of this for keys padded at the end: no real query
    sees them."""
    import torch

    if not isinstance(kv_len, torch.Tensor):
        if isinstance(kv_len, bool) or not isinstance(kv_len, int):
            raise KernelpackError(
                f"padded(mask_mod, kv_len): kv_len is an int or a 0-d integer tensor, got {type(kv_len).__name__}",
                hint="padded(mask_mod, n, device=q.device)",
            )
        kv_len = torch.tensor(kv_len, dtype=torch.int32, device=device or "cpu")
    if kv_len.dim() != 0 or kv_len.dtype.is_floating_point or kv_len.dtype == torch.bool:
        raise KernelpackError(
            f"padded(mask_mod, kv_len): kv_len must be a 0-d integer tensor, got {tuple(kv_len.shape)} {kv_len.dtype}",
            hint="padded(mask_mod, n, device=q.device)",
        )
    kv_len = kv_len.to(dtype=torch.int32, device=device if device is not None else kv_len.device)

    def padded_mask(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return mask_mod(b, h, q_idx, kv_idx) & (kv_idx < kv_len)

    padded_mask.kernelpack_mask = f"padded({mask_key(mask_mod)})"  # type: ignore[attr-defined]
    for attr in ("per_batch", "per_head"):
        if getattr(mask_mod, attr, False):
            setattr(padded_mask, attr, True)
    return padded_mask


def identity_score(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    """The score_mod of a recipe with ``score_mod = "identity"``: the score unchanged. A call passing any function
    that computes the same (transformers' closure without softcap) is served with this one in its place."""
    return score


def score_mod_for(config: Config) -> Callable[..., Any] | None:
    """The score_mod a config was built with: None, :func:`identity_score`, or ``factory(config)`` for
    ``score_mod = "pkg.mod:factory"``."""
    if config.score_mod == "none":
        return None
    if config.score_mod == "identity":
        return identity_score
    ref = config.reference("score")
    if ref is not None:  # recorded: the job's own function, made again (kernelpack.closures)
        return closures.rebuild(ref, dims=config)
    return _from_factory(config.score_mod, config, "score_mod", "score_mod(score, b, h, q_idx, kv_idx) -> tensor")


def mask_for(config: Config, device: Any = "cpu") -> MaskMod:
    """The mask_mod a config was built with: a built-in, the function a recorded reference names, or
    ``factory(config)`` for ``mask = "pkg.mod:factory"``; with ``[call] padded = true`` that mask :func:`padded` to
    the config's kv_len (a tensor on ``device``)."""
    if config.padded:
        import torch

        inner = mask_for(dataclasses.replace(config, padded=False), device)
        return padded(inner, torch.tensor(config.kv_len, dtype=torch.int32, device=device))
    if config.mask in BUILTIN:
        assert config.window is not None
        return BUILTIN[config.mask](config.window)
    ref = config.reference("mask")
    if ref is not None:  # recorded: the job's own function, made again at this point (kernelpack.closures)
        return closures.rebuild(ref, dims=config, device=device)
    return _from_factory(config.mask, config, "mask", "mask_mod(b, h, q_idx, kv_idx) -> bool tensor")


def modules_for(config: Config) -> set[str]:
    """The modules :func:`mask_for` and :func:`score_mod_for` import for ``config``: its factories' and every
    function its recorded references name, nested ones too. A background start imports them in activate(): its
    thread holds the import gate (kernelpack._imports.importing_alone), and a job thread importing one of them waits
    at the gate holding that module's import lock, so the thread must find them imported (it deadlocked on
    SpecForge's DFlash mask module, imported by the job after activate())."""
    found: set[str] = set()
    for kind, spec in (("mask", config.mask), ("score", config.score_mod)):
        ref = config.reference(kind)  # type: ignore[arg-type]
        if ref is not None:
            found |= closures.modules(ref)
        elif ":" in spec and spec not in BUILTIN:
            found.add(spec.partition(":")[0])
    return found


def _from_factory(spec: str, config: Config, what: str, returns: str) -> Any:
    """``factory(config)`` for a recipe's ``"pkg.mod:factory"``: a function of the recipe point's shapes (example
    tensors of those shapes when the function closes over tensors; their values do not enter the graph)."""
    factory = load_factory(spec, what)
    try:
        fn = factory(config)
    except Exception as e:
        raise KernelpackError(
            f"{what} factory {spec!r} failed for config {config.id}: {type(e).__name__}: {e}",
            hint=f"the factory is called with the kernelpack Config and must return a {returns}",
        ) from e
    if not callable(fn):
        raise KernelpackError(
            f"{what} factory {spec!r} returned {type(fn).__name__}, not a function",
            hint=f"return a function {returns}",
        )
    return fn


def load_factory(spec: str, what: str = "mask") -> Callable[[Config], MaskMod]:
    module_name, _, attr = spec.partition(":")
    obj: Any = closures.import_module(module_name, f"{what} {spec!r}")
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise KernelpackError(
                f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}",
                hint=f"{what} = 'package.module:factory' names a function that takes a Config and returns a "
                f"{'mask_mod' if what == 'mask' else what}",
            ) from None
    return obj  # type: ignore[no-any-return]


def block_mask(
    mask_mod: MaskMod,
    q_len: int,
    kv_len: int,
    device: str | Any,
    *,
    batch: int | None = None,
    heads: int | None = None,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
) -> BlockMask:
    """The BlockMask exactly as the builder makes it.

    Its tensors are graph inputs, so their shapes are part of the cache key: ``batch`` / ``heads`` give it one block
    table per batch element / head (the recipe's ``[call] mask_dims``); None (the default) broadcasts. Keep them None
    unless the mask really depends on the batch or head index, and the block size the recipe builds (default 128). A
    mask_mod that needs per-batch or per-head blocks says so with ``per_batch = True`` / ``per_head = True``.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    if getattr(mask_mod, "per_batch", False) and batch is None:
        raise KernelpackError("this mask_mod is per-batch: pass batch=", hint="block_mask(..., batch=B)")
    if getattr(mask_mod, "per_head", False) and heads is None:
        raise KernelpackError("this mask_mod is per-head: pass heads=", hint="block_mask(..., heads=H)")
    # create_block_mask traces the mask_mod (vmap, fx node meta) with torch state that a concurrent compile in another
    # thread also uses; so it waits while a first call compiles or loads, like any other kernelpack call.
    with outside_first_calls():
        try:
            return eager_block_mask(mask_mod, batch, heads, q_len, kv_len, device, block_size)
        except NoInternals:
            return create_block_mask(mask_mod, batch, heads, q_len, kv_len, device=device, BLOCK_SIZE=block_size)


def eager_block_mask(
    mask_mod: MaskMod,
    batch: int | None,
    heads: int | None,
    q_len: int,
    kv_len: int,
    device: str | Any,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    *,
    max_elements: int | None = None,
) -> BlockMask:
    """``create_block_mask(mask_mod, batch, heads, q_len, kv_len, device, BLOCK_SIZE=block_size)``, the same
    BlockMask, without torch.compile and in bounded memory.

    torch's eager path evaluates the mask_mod over the whole [B, H, Q, KV] grid at once: at 16k x 16k a single
    int64 intermediate is 2 GiB. Its compiled path (what transformers uses) traces with FX during
    training (torch.fx's process-global tracing flag, which another thread's compiled call trips over: see
    :mod:`kernelpack.compiled` and the README's "Runtime guard" section) and its graphs are one more thing to ship. This
    evaluates the mask_mod over whole query blocks at a time, at most ``max_elements`` (default
    KERNELPACK_MASK_CHUNK_ELEMENTS, 2**24) grid points per chunk, reduces each chunk to its block table and builds the
    BlockMask with torch's own helpers (:mod:`kernelpack._torch.flex`), exactly as create_block_mask does for the whole
    grid."""
    import torch
    from torch.nn.attention.flex_attention import create_mask

    q_block, kv_block = (block_size, block_size) if isinstance(block_size, int) else block_size
    limit = max_elements if max_elements is not None else settings.mask_chunk_elements()
    per_row = (batch or 1) * (heads or 1) * kv_len
    rows = max(q_block, (limit // max(per_row, 1)) // q_block * q_block)
    partial: list[Any] = []
    full: list[Any] = []
    for start in range(0, q_len, rows):
        n = min(rows, q_len - start)

        def shifted(b: Any, h: Any, q_idx: Any, kv_idx: Any, start: int = start) -> Any:
            return mask_mod(b, h, q_idx + start, kv_idx)

        dense = create_mask(shifted if start else mask_mod, batch, heads, n, kv_len, device)
        blocks = block_tables(dense, q_block, kv_block)
        partial.append(blocks[0])
        full.append(blocks[1])
        del dense
    full_blocks = torch.cat(full, dim=2) if all(f is not None for f in full) else None
    return block_mask_of((torch.cat(partial, dim=2), full_blocks), mask_mod, (q_len, kv_len), q_block, kv_block)


def block_mask_for(config: Config, device: str | Any, mask_mod: MaskMod | None = None) -> BlockMask:
    """The BlockMask of a recipe point: its mask (``mask_mod``: the one :func:`mask_for` made already), block size
    and B/H (``[call] mask_dims``)."""
    if mask_mod is None:
        mask_mod = mask_for(config, device)
    dims = config.mask_dims.split("+")
    for attr, dim in (("per_batch", "per-batch"), ("per_head", "per-head")):
        if getattr(mask_mod, attr, False) and dim not in dims and _dim_size(config, dim) > 1:
            raise KernelpackError(
                f"mask {config.mask_label!r} needs a {dim} BlockMask, but config {config.id} declares mask_dims "
                f"{config.mask_dims!r}",
                hint=f'declare it in the recipe: [call] mask_dims = "{dim}" (or "per-batch+per-head")',
            )
    per_batch = "per-batch" in dims or getattr(mask_mod, "per_batch", False)
    per_head = "per-head" in dims or getattr(mask_mod, "per_head", False)
    return block_mask(
        mask_mod,
        config.q_len,
        config.kv_len,
        device,
        batch=config.batch if per_batch else None,
        heads=config.q_heads if per_head else None,
        block_size=config.block_size,
    )


def _dim_size(config: Config, dim: str) -> int:
    return config.batch if dim == "per-batch" else config.q_heads


# flex's Triton forward tiles a KV block into BLOCK_N keys; autotuning may pick 16 (torch 2.11-2.15's
# template_heuristics/flex configs), so without a fixed BLOCK_N the first tile is assumed to be 16 keys
SMALLEST_TILE = 16


def first_tile_gaps(
    bm: BlockMask, tile: int = SMALLEST_TILE, *, limit: int | None = 1, max_elements: int = 1 << 22
) -> list[dict[str, int]]:
    """The rows of ``bm`` that ``kernel_options.ROWS_GUARANTEED_SAFE = True`` would turn into NaN, sorted by (batch,
    head, row): all of them (``limit`` None) or the first ``limit`` found; empty when the promise holds.

    What the option needs is stronger than "every row keeps a key" (torch 2.15's kernel_options docs): the forward
    kernel starts each row's running maximum at -inf and, with the option, no longer sanitizes it, so a row must keep
    a key in the first ``tile`` keys of the first KV block scheduled for it. That is the first partial block when its
    q block has any (they run before the full blocks), else a full block, which is safe. A q block with no block
    scheduled at all fails every row. Each gap: batch, head, row and the keys of that first tile (``block`` -1: none
    scheduled). Keys past kv_len count as masked; rows past q_len are not checked."""
    import torch

    q_len, kv_len = bm.seq_lengths
    q_block, kv_block = bm.BLOCK_SIZE
    num = bm.kv_num_blocks
    full = bm.full_kv_num_blocks if bm.full_kv_num_blocks is not None else torch.zeros_like(num)
    device = num.device
    gaps: list[dict[str, int]] = []
    for b, h, i in ((num == 0) & (full == 0)).nonzero().tolist():
        for row in range(i * q_block, min((i + 1) * q_block, q_len)):
            gaps.append({"batch": b, "head": h, "row": row, "block": -1, "first_key": -1, "last_key": -1})
    scheduled = (num > 0).nonzero()  # [N, 3]: (b, h, q block) whose first block is partial
    if len(scheduled):
        first = bm.kv_indices[scheduled[:, 0], scheduled[:, 1], scheduled[:, 2], 0].long()
        rows = scheduled[:, 2, None] * q_block + torch.arange(q_block, device=device)  # [N, q_block]
        keys = first[:, None] * kv_block + torch.arange(tile, device=device)  # [N, tile]
        evaluate = torch.vmap(bm.mask_mod)
        step = max(1, max_elements // (q_block * tile))
        for start in range(0, len(scheduled), step):
            if limit is not None and len(gaps) >= limit:
                break
            s = slice(start, start + step)
            shape = (len(scheduled[s]), q_block, tile)
            b_, h_ = scheduled[s, 0, None, None].expand(shape), scheduled[s, 1, None, None].expand(shape)
            q, k = rows[s, :, None].expand(shape), keys[s, None, :].expand(shape)
            # indices past the lengths clamped: a mask over a tensor of the sequence's size must not index past it
            qc, kc = q.clamp(max=q_len - 1), k.clamp(max=kv_len - 1)
            kept = evaluate(b_.reshape(-1), h_.reshape(-1), qc.reshape(-1), kc.reshape(-1)).reshape(shape)
            ok = (kept & (k < kv_len)).any(-1) | (rows[s] >= q_len)
            for j, r in (~ok).nonzero().tolist():
                at = start + j
                key0 = int(first[at]) * kv_block
                b, h = int(scheduled[at, 0]), int(scheduled[at, 1])
                gaps.append({"batch": b, "head": h, "row": int(rows[at, r]), "block": int(first[at]),
                             "first_key": key0, "last_key": key0 + tile - 1})  # fmt: skip
    gaps.sort(key=lambda g: (g["batch"], g["head"], g["row"]))
    return gaps if limit is None else gaps[:limit]


def rows_guaranteed_safe_problem(config: Config, device: str | Any, lengths: list[tuple[int, int]]) -> str | None:
    """Why ``config``'s ``kernel_options`` ROWS_GUARANTEED_SAFE promise fails at its length or one of ``lengths``
    (:func:`first_tile_gaps` on the canonical BlockMask), or None: no promise, or it holds there. The build refuses the
    config rather than ship a kernel that computes NaN for those rows (eager and the build's CPU reference would not
    show it: only flex's Triton kernel skips the guard)."""
    options = dict(config.kernel_options)
    if not any(options.get(k) is True for k in ("ROWS_GUARANTEED_SAFE", "fwd_ROWS_GUARANTEED_SAFE")):
        return None
    tile = options.get("fwd_BLOCK_N", options.get("BLOCK_N", SMALLEST_TILE))
    tile = tile if isinstance(tile, int) and not isinstance(tile, bool) and tile > 0 else SMALLEST_TILE
    for q, kv in [(config.q_len, config.kv_len), *lengths]:
        at = config if (q, kv) == (config.q_len, config.kv_len) else config.at(q, kv)
        gaps = first_tile_gaps(block_mask_for(at, device), min(tile, at.block_size[1]))
        if not gaps:
            continue
        gap = gaps[0]
        where = f"at q_len {q}, kv_len {kv}: row {gap['row']} (batch {gap['batch']}, head {gap['head']})"
        if gap["block"] < 0:
            what = "has no KV block scheduled at all"
        else:
            what = (
                f"keeps no key among keys {gap['first_key']}..{gap['last_key']}, the first {tile} of KV block "
                f"{gap['block']}, the first one its query block runs"
            )
        return (
            f"kernel_options.ROWS_GUARANTEED_SAFE = true, but {where} {what}: flex's Triton kernel computes NaN for "
            "such a row under compile (torch's kernel_options docs; local and windowed masks often break it). Drop "
            "the option (flex's default, false, is exact), or fix BLOCK_N to a tile every row's first block keeps a "
            f"key in (the check assumes {tile} keys)"
        )
    return None
