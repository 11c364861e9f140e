"""transformers: ``attn_implementation="kernelpack"`` serves a transformers model from the artifact.

:func:`register` registers the name ``"kernelpack"`` with transformers' ``AttentionInterface`` (:func:`attention`,
transformers' own ``flex_attention_forward`` calling :func:`kernelpack.flex_attention` instead of its own
``torch.compile(flex_attention)``) and ``AttentionMaskInterface`` (:func:`block_mask`, transformers'
``flex_attention_mask`` building the BlockMask without ``torch.compile``, in bounded memory). So a model loaded with
``attn_implementation="kernelpack"`` makes calls an artifact can serve:

- the attention call: transposed-view q/k/v, GQA (``enable_gqa``, or transformers' ``repeat_kv`` for head counts
  that are not a power of two), ``scaling``, softcap, the lse through ``return_aux`` on CUDA (not on CPU, as
  transformers does), the score_mod closure of this module (so a recipe's score_mod factory returns the very same
  code and Dynamo serves it as it is);
- the mask: transformers' own mask functions (sliding window, causal, padding, offsets) evaluated eagerly by
  :func:`kernelpack.masks.eager_block_mask`. transformers' own path builds it with create_block_mask's compiled
  path, one more compiled graph per length, traced during training (measured on an H200: one of the
  3 FX-graph misses of a warm transformers step); kernelpack's builder traces nothing.

:func:`recipe_for` writes the recipe of a model config (heads, head_dim, sliding window, scaling, dtype, lengths,
graphs); its ``mask`` and ``score_mod`` are the factories :func:`sliding_window_mask`, :func:`causal_mask` and
:func:`recipe_score_mod`. :func:`kernelpack.runtime.activate` calls :func:`register` when transformers is already
imported (importing it costs seconds, so kernelpack never does it for you).

Tested with transformers 5.17 (``kernelpack[transformers]``); the attention function mirrors
``transformers.integrations.flex_attention.flex_attention_forward`` of that release.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .. import _toml, closures
from ..errors import KernelpackError
from ..recipe import parse_recipe
from ..signature import joined_layout

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

if TYPE_CHECKING:
    import torch

    from ..config import Config

NAME = "kernelpack"
TESTED = "transformers>=5.17,<6"


def register(*, takeover: bool = False) -> None:
    """Register ``"kernelpack"`` with transformers' attention and mask interfaces: then
    ``from_pretrained(..., attn_implementation="kernelpack")`` (or ``config._attn_implementation = "kernelpack"``)
    routes attention through kernelpack. ``takeover=True`` also serves models that keep
    ``attn_implementation="flex_attention"`` (SpecForge dispatches through that name) by registering the same
    functions under it, for every model in this process. Idempotent."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise KernelpackError(
            f"kernelpack's transformers integration needs transformers: {e}",
            hint=f"pip install 'kernelpack[transformers]' ({TESTED})",
        ) from e
    names = (NAME, "flex_attention") if takeover else (NAME,)
    for name in names:
        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, block_mask)


# ------------------------------------------------------------------------------------------------ the call


def score_mod(
    softcap: float | None = None, score_mask: torch.Tensor | None = None, position_bias: torch.Tensor | None = None
) -> Callable[..., Any]:
    """The score_mod transformers passes (``flex_attention_forward``'s closure): softcap, an additive score mask,
    a position bias, each when given. The identity without them. One code object for every call and for the
    recipe's factory (:func:`recipe_score_mod`), so that Dynamo serves the warmed graph without a stand-in. It
    closes over plain values only (``Tensor.tanh``, not the ``torch`` module), so its graph is recorded once per
    softcap value, not per call."""

    def transformers_score_mod(score: Any, batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        if softcap is not None:
            score = softcap * (score / softcap).tanh()
        if score_mask is not None:
            score = score + score_mask[batch_idx][0][q_idx][kv_idx]
        if position_bias is not None:
            score = score + position_bias[batch_idx, head_idx, q_idx, kv_idx]
        return score

    return transformers_score_mod


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' ``flex_attention_forward`` (5.17) with :func:`kernelpack.flex_attention` for the call: the
    same arguments, numerics and outputs (attention output as [B, S, H, D], and the lse on CUDA)."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    if kwargs.get("dropout", 0.0) > 0:
        raise ValueError(
            "`flex_attention` does not support `dropout`. Please use it with inference only (`model.eval()`) or turn "
            "off the attention dropout in the respective config."
        )
    block = attention_mask if isinstance(attention_mask, BlockMask) else None
    score_mask = None if block is not None else attention_mask
    if score_mask is not None:
        score_mask = score_mask[:, :, :, : key.shape[-2]]
    enable_gqa = True
    heads = query.shape[1]
    if heads & (heads - 1):  # not a power of two (tensor parallel shards): transformers repeats k and v
        key = _repeat_kv(key, heads // key.shape[1])
        value = _repeat_kv(value, heads // value.shape[1])
        enable_gqa = False
    return_lse = query.device.type != "cpu"  # transformers: the lse is not returned on CPU
    if not return_lse and s_aux is not None:
        raise ValueError(
            "Attention sinks cannot be run on CPU with flex attention. Please switch to a different device, e.g. CUDA"
        )
    # inside the user's own torch.compile(model): torch's flex_attention, inlined into their graph (transformers
    # does the same); kernelpack's gate is not traceable and its artifact cannot serve another graph anyway
    flex: Any = torch_flex if torch.compiler.is_compiling() else _entry()
    out = flex(
        query,
        key,
        value,
        score_mod=score_mod(softcap, score_mask, position_bias),
        block_mask=block,
        enable_gqa=enable_gqa,
        scale=scaling,
        kernel_options=kwargs.get("kernel_options"),
        **_lse_kwargs(return_lse),
    )
    lse = None
    if return_lse:
        out, aux = out
        lse = (aux.lse if hasattr(aux, "lse") else aux).to(value.dtype)
        if s_aux is not None:  # attention sinks: renormalize with the lse, as transformers does
            b, h, s, _ = out.shape
            sinks = s_aux.view(1, -1, 1, 1).expand(b, h, s, 1)
            lse_expanded = lse.unsqueeze(-1)
            combined = torch.logsumexp(torch.cat([lse_expanded, sinks], dim=-1), dim=-1, keepdim=True)
            out = (out * torch.exp(lse_expanded - combined)).to(query.dtype)
    return out.transpose(1, 2).contiguous(), lse


def _lse_kwargs(return_lse: bool) -> dict[str, Any]:
    # the lse through return_aux (return_lse is deprecated since torch 2.9), as transformers asks for it
    from torch.nn.attention.flex_attention import AuxRequest

    return {"return_aux": AuxRequest(lse=True) if return_lse else None}


def _repeat_kv(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, h, s, d = hidden.shape
    if n_rep == 1:
        return hidden
    return hidden[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


_entries: dict[int, Callable[..., Any]] = {}


def _entry() -> Callable[..., Any]:
    """kernelpack's guarded entry compiled with the active artifact's options (the defaults otherwise; with several
    option sets in one artifact, the defaults: such a recipe is served through kernelpack.runtime.guarded)."""
    from .. import runtime

    active = runtime.active()
    if active is None or active.manifest is None:
        return runtime.flex_attention
    entry = _entries.get(id(active))
    if entry is None:
        options = {(c.config.mode, c.config.dynamic) for c in active.manifest.configs}
        mode, dynamic = options.pop() if len(options) == 1 else ("default", False)
        entry = runtime.flex_attention if (mode, dynamic) == ("default", False) else runtime.guarded(mode, dynamic)
        _entries.clear()  # one activation at a time
        _entries[id(active)] = entry
    return entry


# ------------------------------------------------------------------------------------------------ the mask


def block_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    device: Any = "cpu",
    **kwargs: Any,
) -> Any:
    """transformers' ``flex_attention_mask`` (5.17) built by :func:`kernelpack.masks.eager_block_mask`: the same
    mask, with no ``torch.compile`` (nothing to trace during training, no graph to ship), in bounded memory.

    The BlockMask has one block table per batch element, as transformers builds it (``mask_dims = "per-batch"``
    when the batch is larger than 1): packed sequences, padding and model-specific masks read the batch index.
    Offsets wrap the mask function only when not zero."""
    from transformers.masking_utils import (
        add_offsets_to_mask_function,
        and_masks,
        causal_mask_function,
        padding_mask_function,
        prepare_padding_mask,
    )

    from ..masks import eager_block_mask

    function = mask_function if mask_function is not None else causal_mask_function
    if attention_mask is not None and not bool(attention_mask.all()):
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        assert padding is not None
        function = and_masks(function, padding_mask_function(padding))
    if q_offset or kv_offset:
        function = add_offsets_to_mask_function(function, q_offset, kv_offset)
    return eager_block_mask(function, batch_size, None, q_length, kv_length, device)


# ------------------------------------------------------------------------------------------------ recipes


def recipe_score_mod(config: Config) -> Callable[..., Any]:
    """Recipe score_mod factory: :func:`score_mod` without softcap, score mask or position bias (the identity), the
    closure :func:`attention` passes for such a model."""
    return score_mod()


def sliding_window_mask(config: Config) -> Callable[..., Any]:
    """Recipe mask factory: transformers' sliding-window causal mask function for ``config.window`` (what a model
    with ``sliding_window = W`` passes to the mask interface)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    if config.window is None:
        raise KernelpackError(
            "mask kernelpack.integrations.transformers:sliding_window_mask needs windows",
            hint="windows = [W] (the model config's sliding_window), or mask = "
            '"kernelpack.integrations.transformers:causal_mask"',
        )
    return sliding_window_causal_mask_function(config.window)


def causal_mask(config: Config) -> Callable[..., Any]:
    """Recipe mask factory: transformers' causal mask function (a model without a sliding window)."""
    from transformers.masking_utils import causal_mask_function

    return causal_mask_function


# Families whose q, k, v are slices of one fused projection (transformers 5.17): v's layout, by (q_heads, kv_heads,
# head_dim). Phi-3 slices qkv_proj(x) ([B, S, (Hq + 2 Hkv) D]) into q, k, v; GPT-NeoX views query_key_value(x) as
# [B, S, H, 3 D] and chunks each head's 3 D. Their q and k go through RoPE, whose output over a slice is contiguous.
def _sliced_qkv(q: int, kv: int, d: int) -> str:
    return f"bshd(row={(q + 2 * kv) * d})"


_FUSED_QKV: dict[str, Callable[[int, int, int], str]] = {
    "phi3": _sliced_qkv,
    "phi4_multimodal": _sliced_qkv,
    "gpt_neox": lambda q, kv, d: f"bshd(head={3 * d},row={3 * kv * d})",
}
# Families with attention sinks (s_aux: transformers renormalizes flex's output with its lse, CUDA only)
_SINKS = frozenset({"gpt_oss", "granite_swa", "granitemoe_swa", "mimo_v2_flash", "openai_privacy_filter"})


def recipe_for(
    model_config: Any,
    *,
    seq_lens: Sequence[int] | Mapping[str, int],
    dtype: str = "bfloat16",
    device: str = "cuda",
    batch: int = 1,
    graphs: Sequence[str] = ("fwd", "fwd+bwd"),
    use_cache: bool = False,
    name: str | None = None,
) -> str:
    """The recipe (TOML text) of the attention calls a transformers model config makes through
    ``attn_implementation="kernelpack"``: heads, head_dim, the sliding window, the scaling, GQA as transformers
    passes it, the layout (q/k/v transposed views; with ``use_cache`` k and v come contiguous from the cache), the
    lse on CUDA. A model that mixes sliding-window and full layers (``layer_types``) gets a config per mask
    (``[[calls]]`` tables); other layer types (chunked, linear attention) are refused: record the job instead.

    ``seq_lens`` is a list of lengths, or a range: ``{"min": 1024, "max": 16384, "multiple": 512}`` (static buckets:
    pad each batch to :func:`kernelpack.runtime.padded_length`, labels -100 on the padding; a causal model needs
    no attention mask for it) or ``{"min": 1024, "max": 16384}`` (one dynamic graph, ``[compile] dynamic = true``)."""
    q_heads = int(model_config.num_attention_heads)
    kv_heads = int(getattr(model_config, "num_key_value_heads", None) or q_heads)
    head_dim = int(getattr(model_config, "head_dim", None) or model_config.hidden_size // q_heads)
    softcap = getattr(model_config, "attn_logit_softcapping", None)
    layer_types = set(getattr(model_config, "layer_types", None) or ())
    unknown = sorted(layer_types - {"sliding_attention", "full_attention"})
    if unknown:  # chunked attention (Llama 4), linear attention (Qwen3-Next): other masks or no flex call
        raise KernelpackError(
            f"recipe_for: this model has attention layers of type {', '.join(map(repr, unknown))}, whose calls "
            "recipe_for does not know",
            hint="record the job's calls instead: kernelpack record -o recipe.toml -- python train.py",
        )
    window = getattr(model_config, "sliding_window", None)
    if getattr(model_config, "use_sliding_window", True) is False or layer_types == {"full_attention"}:
        window = None  # the layers say full attention, whatever sliding_window holds
    # the masks its layers call with: a model that mixes sliding and full layers (Gemma2/3, Qwen2 with
    # max_window_layers, Mistral's layer_types) calls with both, each a config of its own ([[calls]] tables)
    masks: list[dict[str, Any]] = []
    if window and layer_types != {"full_attention"}:
        masks.append({"mask": "kernelpack.integrations.transformers:sliding_window_mask", "window": int(window)})
    if not window or "full_attention" in layer_types:
        masks.append({"mask": "kernelpack.integrations.transformers:causal_mask"})
    # module.scaling as the families this is tested with set it (Llama, Mistral, Qwen2/3, Gemma/2, Olmo2, Mixtral);
    # Granite scales by attention_multiplier. Another model may differ: kernelpack verify and report() show a miss
    multiplier = getattr(model_config, "attention_multiplier", None)
    scalar = getattr(model_config, "query_pre_attn_scalar", None) or head_dim
    scale = float(multiplier) if multiplier is not None else float(scalar) ** -0.5
    enable_gqa = not (q_heads & (q_heads - 1))  # else transformers repeats k, v to q_heads: contiguous copies
    repeated = not enable_gqa and kv_heads != q_heads  # (repeat_kv by 1 returns k and v as they are)
    if not enable_gqa:
        kv_heads = q_heads
    # q and k are RoPE's outputs (elementwise over the transposed views): with more than one head they keep the
    # views' [B, S, H, D] order; with one head (multi-query attention, Gemma3) the order is ambiguous and torch makes
    # them contiguous, while v stays the view: layouts by their exact strides (kernelpack.signature.layout_of; what
    # `kernelpack record` writes for these models on CPU, torch 2.13, transformers 5.17)
    model_type = str(getattr(model_config, "model_type", "model"))
    fused = _FUSED_QKV.get(model_type)
    if model_type in _SINKS and device == "cpu":
        raise KernelpackError(
            f"recipe_for: {model_type} has attention sinks, which transformers applies with flex's lse, and flex "
            "returns no lse on CPU (transformers refuses the model with flex on CPU)",
            hint='device="cuda"',
        )
    q_layout = "bhsd" if q_heads == 1 or fused else "bshd"  # a fused slice through RoPE: a contiguous copy
    if use_cache or repeated:  # from the cache, or repeat_kv's copies: contiguous
        kv_layouts = ("bhsd", "bhsd")
    elif fused:  # k through RoPE (contiguous), v the projection's slice as it is
        kv_layouts = ("bhsd", fused(q_heads, kv_heads, head_dim))
    else:
        kv_layouts = ("bhsd" if kv_heads == 1 else "bshd", "bshd")
    layout = joined_layout((q_layout, *kv_layouts))
    top: dict[str, Any] = {"name": name or f"{model_type}-kernelpack", "device": device}
    if len(masks) == 1:
        top["mask"] = masks[0]["mask"]
        if "window" in masks[0]:
            top["windows"] = [masks[0]["window"]]
    matrix = {
        "batch": batch,
        "q_heads": q_heads,
        "kv_heads": kv_heads,
        "seq_len": _lengths(seq_lens),
        "head_dim": head_dim,
        "dtypes": [dtype],
        "graphs": list(graphs),
    }
    call: dict[str, Any] = {"layout": layout}
    if batch > 1:
        call["mask_dims"] = "per-batch"  # transformers' BlockMask: B = batch size
    # a soft-capping model (Gemma2): the score_mod attention() passes it, score_mod(softcap), by reference with its
    # closure values, as kernelpack record writes a job's own function (kernelpack.closures): the same code object
    # and values, so the same key
    score = closures.describe(score_mod(float(softcap)), "score_mod") if softcap else None
    call |= {
        "scale": scale,
        "enable_gqa": enable_gqa,
        "score_mod": score or "kernelpack.integrations.transformers:recipe_score_mod",
    }
    if device == "cuda":
        call["return_aux"] = "lse"
    dynamic = isinstance(seq_lens, Mapping) and "multiple" not in seq_lens
    tables: list[tuple[str, dict[str, Any]]] = []
    if len(masks) == 1:
        tables += [("[matrix]", matrix), ("[call]", call)]
        if dynamic:
            tables.append(("[compile]", {"dynamic": True}))
    else:  # a [[calls]] table per mask and length, each key one value ([matrix]'s dtypes: dtype)
        lengths = _lengths(seq_lens)
        axes = {k: v for k, v in matrix.items() if k not in ("dtypes", "seq_len")} | {"dtype": dtype}
        for mask in masks:
            for n in [lengths] if isinstance(lengths, dict) else lengths:
                table = mask | {**axes, "seq_len": n} | call
                tables.append(("[[calls]]", table | ({"dynamic": True} if dynamic else {})))
    # through the one TOML writer (a model_type or name with a quote or a newline cannot break the file or add keys),
    # then read back as the builder will: a bad name or value is an error here, naming the key
    about = f'{model_type} through attn_implementation="kernelpack" (kernelpack.integrations.transformers.recipe_for)'
    lines = ["# " + _toml.comment(about)]
    try:
        lines += [f"{_toml.key(k)} = {_toml.value(v)}" for k, v in top.items()]
        for header, items in tables:
            lines += ["", header, *(f"{_toml.key(k)} = {_toml.value(v)}" for k, v in items.items())]
    except _toml.NotWritable as e:
        raise KernelpackError(
            f"recipe_for: a value {e}", hint="pass name= with letters, digits, '-', '_', '.'"
        ) from None
    text = "\n".join(lines) + "\n"
    parse_recipe(tomllib.loads(text), path="recipe_for")  # raises RecipeError naming the key
    return text


def _lengths(seq_lens: Sequence[int] | Mapping[str, int]) -> list[int] | dict[str, int]:
    if isinstance(seq_lens, Mapping):
        unknown = sorted(set(seq_lens) - {"min", "max", "multiple"})
        bad = [v for v in seq_lens.values() if isinstance(v, bool) or not isinstance(v, int)]
        if unknown or bad or not {"min", "max"} <= set(seq_lens):
            raise KernelpackError(
                f"recipe_for: seq_lens {dict(seq_lens)!r} is not a range",
                hint='{"min": 1024, "max": 16384} (dynamic) or {"min": ..., "max": ..., "multiple": 512} (buckets)',
            )
        return {k: int(v) for k, v in seq_lens.items()}
    return [int(n) for n in seq_lens]
