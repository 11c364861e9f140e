"""The canonical call of a recipe point, per graph: what the builder compiles, verify proves and ``activate()`` warms.

One definition for all three, so that what the runtime warms is exactly what was built:

- ``"fwd"``: inputs that do not require grad, called under ``torch.no_grad()`` (inference, and the forward of
  reentrant gradient checkpointing). Dynamo guards on grad mode, so the same call with grad mode on would be another
  Dynamo entry; the guarded entry makes every forward-only call under no_grad instead
  (:func:`kernelpack.runtime.flex_attention`), on q, k, v detached: the same result for a call that autograd does
  not record, whatever its grad mode and its inputs' ``requires_grad``.
- ``"fwd+bwd"``: inputs that require grad, forward then backward (``torch.autograd.grad``), so that the compiled
  backward is loaded too (CUDA only: compiled flex has no backward on CPU). The backward runs on the autograd
  engine's device thread, which the warm-up waits for before training threads can use it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .masks import score_mod_for
from .signature import Strides, normal_kernel_options, normal_scale, parse_layout, split_layout

if TYPE_CHECKING:
    import torch

    from .config import Config
    from .signature import Graph


def make_inputs(
    config: Config, device: Any, graph: Graph | None = None, *, random: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of the canonical call, seeded by the config id; they require grad for the ``"fwd+bwd"`` graph (the
    default when the config builds it). ``random=False``: zeros made on the device, for a warm-up that checks no
    values (drawing a 16k-long q on the CPU costs more than its warm call)."""
    import torch

    if graph is None:
        graph = "fwd+bwd" if config.backward else "fwd"
    seed = int(hashlib.sha256(config.id.encode()).hexdigest()[:8], 16)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = getattr(torch, config.dtype)

    layouts = split_layout(config.layout)
    assert layouts is not None  # validated by Config

    def rand(heads: int, length: int, layout: str) -> torch.Tensor:
        # drawn as [B, H, S, D] whatever the layout, so that every layout of a config sees the same values
        shape = (config.batch, heads, length, config.head_dim)
        if random:
            t = torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
        else:
            t = torch.zeros(shape, device=device, dtype=dtype)
        strides = parse_layout(layout)
        assert strides is not None  # validated by Config
        b, h, s, d = shape
        if strides.row is not None and not config.dynamic:
            # a slice of wider rows (a fused projection's output, Phi-3's v): a view at the end of each row, as a
            # fused qkv's v is, storage offset and all
            if strides.order == "bshd":
                head = strides.head or d
                base = t.new_empty((b, s, strides.row))[:, :, strides.row - h * head :]
                view = base.unflatten(-1, (h, head))[..., :d].transpose(1, 2)
            else:
                view = t.new_empty((b, h, s, strides.row))[..., strides.row - d :]
            t = view.copy_(t)
        elif strides != Strides("bhsd"):
            # proj(x).view(B, S, H, D).transpose(1, 2): the same values, other strides. A fresh tensor with the
            # model's strides, not t.transpose(1, 2).contiguous(): with one head that returns the view itself
            # (contiguous but for a size-1 dim's stride, which Dynamo guards on). And not a view: with dynamic
            # shapes Dynamo guards on a view's base (its strides by symbol), so a graph traced on a view misses a
            # tensor with these strides that is none (transformers' q and k after RoPE); one traced on a non-view
            # serves both (CPU, torch 2.13)
            t = torch.empty_strided(shape, strides.strides(b, h, s, d), dtype=t.dtype, device=t.device).copy_(t)
        return t.requires_grad_(graph == "fwd+bwd")

    q = rand(config.q_heads, config.q_len, layouts[0])
    k = q if config.alias in ("q=k", "q=k=v") else rand(config.kv_heads, config.kv_len, layouts[1])
    shared = {"k=v": k, "q=v": q, "q=k=v": q}.get(config.alias)
    v = shared if shared is not None else rand(config.kv_heads, config.kv_len, layouts[2])
    return q, k, v


def grad_output(q: torch.Tensor, *, random: bool = True) -> torch.Tensor:
    """The backward's ``dout``, drawn on the CPU with a fixed seed (a 16k-long randn costs more than a warm call: draw
    it before starting a clock); ``random=False``: ones on the device."""
    import torch

    if not random:
        return torch.ones(q.shape, device=q.device, dtype=q.dtype)
    gen = torch.Generator(device="cpu").manual_seed(1)
    return torch.randn(q.shape, generator=gen, dtype=torch.float32).to(device=q.device, dtype=q.dtype)


def call(
    fn: Callable[..., Any],
    config: Config,
    graph: Graph,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_mask: Any,
    dout: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None]:
    """The canonical call of ``graph`` through ``fn``: the output, for ``"fwd+bwd"`` the gradients of q, k, v
    (``dout`` is required then), and the log-sum-exp when the config returns it."""
    import torch

    with torch.set_grad_enabled(graph == "fwd+bwd"):
        out = fn(**arguments(config, inputs, block_mask))
    lse = None
    if config.return_lse:
        out, lse = out
    elif config.return_aux != "none":
        out, aux = out
        lse = aux.lse
    if graph == "fwd":
        return out, (), lse
    if dout is None:
        raise ValueError("the fwd+bwd canonical call needs dout")
    return out, torch.autograd.grad(out, inputs, dout), lse


def arguments(
    config: Config, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], block_mask: Any
) -> dict[str, Any]:
    """The canonical call's arguments, by flex_attention's parameter names (as Dynamo's guards see them), in the
    spelling calls are served in (:func:`kernelpack.signature.normalized`: an option at torch's default is no
    option); it runs with grad mode on exactly for the ``"fwd+bwd"`` graph."""
    q, k, v = inputs
    args: dict[str, Any] = {
        "query": q,
        "key": k,
        "value": v,
        "block_mask": block_mask,
        "enable_gqa": config.q_heads != config.kv_heads,
        "kernel_options": dict(normal_kernel_options(dict(config.kernel_options))) or None,
    }
    if config.score_mod != "none":
        args["score_mod"] = score_mod_for(config)
    scale = normal_scale(config.scale, config.head_dim)
    if scale is not None:
        args["scale"] = scale
    if config.return_lse:
        args["return_lse"] = True
    if config.return_aux != "none":
        from torch.nn.attention.flex_attention import AuxRequest

        wanted = config.return_aux.split("+")
        args["return_aux"] = AuxRequest(lse="lse" in wanted, max_scores="max_scores" in wanted)
    return args


def marks(config: Config, device: Any) -> tuple[str, ...]:
    """What a dynamic range config's graph keeps symbolic, in :func:`kernelpack.compiled.resolve_marks`'s words:
    torch's automatic-dynamic rule (a size or int that differs between two calls becomes symbolic) applied ahead of
    time, to the canonical calls at both ends of the config's ranges, plus the mask's closure ints that the job
    itself varied without following a length (``{example = ..., seen = [...]}`` in the recipe). Sizes that do not
    vary (batch, heads, head_dim, the mask's block size) stay static, as in the graph the job compiles natively
    after two lengths: its kernels are the faster ones. () for a static config."""
    from . import closures, functions
    from .masks import block_mask_for

    if not config.dynamic or config.q_range is None or config.kv_range is None:
        return ()
    ends = [config.at(config.q_range[0], config.kv_range[0]), config.at(config.q_range[1], config.kv_range[1])]
    calls = []
    for at in ends:
        inputs = make_inputs(at, "meta", random=False)  # only their shapes are compared
        calls.append(arguments(at, inputs, block_mask_for(at, device)))
    out: list[str] = []

    def compare(path: str, a: Any, b: Any) -> None:
        if functions.is_tensor(a) and functions.is_tensor(b) and a.dim() == b.dim():
            out.extend(f"{path}.shape[{i}]" for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y)
        elif isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and a != b:
            out.append(path)
        elif isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                compare(f"{path}[{i}]", x, y)

    lo, hi = calls
    for name in ("query", "key", "value"):
        compare(name, lo[name], hi[name])
    for attr, value in vars(lo["block_mask"]).items():
        if attr != "mask_mod":
            compare(f"block_mask.{attr}", value, getattr(hi["block_mask"], attr, None))
    for prefix, fa, fb, ref in (
        ("block_mask.mask_mod", lo["block_mask"].mask_mod, hi["block_mask"].mask_mod, config.reference("mask")),
        ("score_mod", lo.get("score_mod"), hi.get("score_mod"), config.reference("score")),
    ):
        if fa is None or fb is None:
            continue
        other = {n.path: n.value for n in functions.tree(fb).walk()}
        for node in functions.tree(fa).walk():
            if node.path and node.kind in ("scalar", "tensor"):
                compare(f"{prefix}.{node.path}", node.value, other.get(node.path))
        for path, expr in closures.varying(ref).items() if ref is not None else ():
            if expr == "example":  # the job varied it: symbolic, as automatic dynamic would make it
                out.append(f"{prefix}.{path}")
    return tuple(dict.fromkeys(out))
