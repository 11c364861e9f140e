"""The call signature: one mapping from a recipe point to a call, which the runtime's view of a real call matches;
describe/differences over every field; mask fingerprints equal across processes and different where the mask is."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernelpack.canonical import make_inputs
from kernelpack.config import Config
from kernelpack.masks import block_mask_for
from kernelpack.recipe import load_recipe
from kernelpack.signature import CallParams, CallSignature, layout_name, mask_key, signature_of

ROOT = Path(__file__).resolve().parent.parent
DFLASH = load_recipe(ROOT / "recipes" / "dflash-drafter.toml").configs[0]


@pytest.mark.parametrize("grad", [False, True])
def test_the_runtime_sees_a_canonical_call_as_its_recipe_point(grad: bool) -> None:
    """Config.signature (what an artifact covers) and signature_of (what a call is) agree on the canonical call."""
    config = load_recipe(ROOT / "recipes" / "smoke-cpu.toml").configs[0]
    q, k, v = make_inputs(config, "cpu")
    bm = block_mask_for(config, "cpu")
    for t in (q, k, v):
        t.requires_grad_(grad)
    seen = signature_of({"query": q, "key": k, "value": v, "block_mask": bm}, "default", False)
    assert seen == config.signature(None, "fwd+bwd" if grad else "fwd")
    with torch.no_grad():  # reentrant checkpointing's forward: the forward-only graph even on inputs needing grad
        assert signature_of({"query": q, "key": k, "value": v, "block_mask": bm}, "default", False).graph == "fwd"
    v.requires_grad_(True)  # any input needing grad makes it the training graph
    assert signature_of({"query": q, "key": k.detach(), "value": v}, "default", False).graph == "fwd+bwd"


def test_a_cuda_point_carries_its_device_index_and_a_cpu_point_none() -> None:
    assert DFLASH.signature(5, "fwd").device_index == 5
    assert DFLASH.signature(5, "fwd").describe().startswith("[cuda:5 ")
    cpu = dataclasses.replace(DFLASH, device="cpu", graphs=("fwd",))
    assert cpu.signature(5, "fwd").device_index is None


def test_describe_and_differences_cover_every_field() -> None:
    sig = DFLASH.signature(0, "fwd+bwd")
    assert sig.describe() == ("[cuda:0 sliding_window(1024) B=1 Hq=32 Hkv=8 seq=4096 D=128 bfloat16 fwd+bwd]"), (
        sig.describe()
    )
    other = dataclasses.replace(sig, kernel_options=(("BLOCK_M", 64),), mode="max-autotune", q_len=2048)
    assert other.describe().endswith(
        "q_len=2048 kv_len=4096 D=128 bfloat16 fwd+bwd kernel_options={'BLOCK_M': 64} mode=max-autotune]"
    )
    assert sig.differences(other) == [
        ("q_len", 4096, 2048),
        ("kernel_options", (), (("BLOCK_M", 64),)),
        ("mode", "default", "max-autotune"),
    ]
    # every field of a call, and only those, takes part
    names = {f.name for f in dataclasses.fields(CallSignature)}
    assert names == {f.name for f in dataclasses.fields(CallParams)} | {"mask", "device_index", "graph"}
    assert sig.differences(dataclasses.replace(sig, graph="fwd")) == [("graph", "fwd+bwd", "fwd")]
    assert DFLASH.signature(0, "fwd").describe().endswith(" bfloat16 fwd]")
    assert DFLASH.describe() == (
        f"{DFLASH.id} [cuda sliding_window(1024) B=1 Hq=32 Hkv=8 seq=4096 D=128 bfloat16 fwd & fwd+bwd]"
    )


MASKS = """
import torch

def make(w):
    def mask_mod(b, h, q, kv):
        near = lambda d: d < w  # a nested code object: its repr() holds an address
        return (q >= kv) & near(q - kv)
    return mask_mod

def lower(b, h, q, kv):
    return torch.minimum(q, kv) == kv

def upper(b, h, q, kv):
    return torch.maximum(q, kv) == kv
"""

KEYS = "import json, usermasks as m; from kernelpack.signature import mask_key as k;" + (
    "print(json.dumps([k(m.make(64)), k(m.make(128)), k(m.lower), k(m.upper)]))"
)


def keys_in_a_fresh_process(tmp_path: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", KEYS], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_mask_fingerprints_are_stable_across_processes_and_tell_masks_apart(tmp_path: Path) -> None:
    (tmp_path / "usermasks.py").write_text(MASKS)
    first, second = keys_in_a_fresh_process(tmp_path), keys_in_a_fresh_process(tmp_path)
    assert first == second  # the builder and every worker name the same mask alike
    w64, w128, lower, upper = first
    assert w64 != w128  # the closure's window
    assert lower != upper  # same bytecode, other global function
    assert w64.startswith("make.<locals>.mask_mod#")


def test_kernelpack_masks_are_named_by_what_they_compute() -> None:
    from kernelpack.masks import sliding_window

    assert (
        mask_key(sliding_window(64))
        == "sliding_window(64)"
        == Config.from_dict({**DFLASH.to_dict(), "window": 64}).mask_label
    )
    assert mask_key(None) == "none"


def test_the_signature_sees_how_a_model_calls_flex() -> None:
    """An HF-style block: Linear projections seen through .view(B, S, H, D).transpose(1, 2), a scale, the lse, GQA
    asked for explicitly, a BlockMask of another block size. Each is a field, named by describe() and differences()."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, s, hq, hkv, d = 1, 128, 4, 2, 16
    x = torch.randn(b, s, 32)
    q = torch.nn.Linear(32, hq * d)(x).view(b, s, hq, d).transpose(1, 2)
    k = torch.nn.Linear(32, hkv * d)(x).view(b, s, hkv, d).transpose(1, 2)
    v = torch.nn.Linear(32, hkv * d)(x).view(b, s, hkv, d).transpose(1, 2)
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, s, s, device="cpu", BLOCK_SIZE=64)
    call = {"query": q, "key": k, "value": v, "block_mask": bm, "scale": 0.3, "enable_gqa": True, "return_lse": True}
    sig = signature_of(call, "default", False)
    assert (sig.layout, sig.scale, sig.return_lse, sig.enable_gqa, sig.block_size) == (
        "bshd",
        0.3,
        True,
        True,
        (64, 64),
    )
    assert sig.describe().endswith("fwd+bwd layout=bshd scale=0.3 return_lse=True block_size=(64, 64)]")
    canonical = signature_of(
        {"query": q.contiguous(), "key": k.contiguous(), "value": v.contiguous()}, "default", False
    )
    assert (canonical.layout, canonical.scale, canonical.return_lse, canonical.block_size) == (
        "bhsd",
        None,
        False,
        (128, 128),
    )
    assert not canonical.enable_gqa  # what the call passed (torch refuses it, but that is torch's to say)
    assert [f for f, _, _ in canonical.differences(sig)] == [
        "layout",
        "scale",
        "enable_gqa",
        "return_lse",
        "block_size",
        "mask",  # the lambda vs no BlockMask at all
    ]
    mixed = signature_of({"query": q, "key": k.contiguous(), "value": v, "enable_gqa": True}, "default", False)
    assert mixed.layout == "q=bshd k=bhsd v=bshd"
    # every other position of a bshd q: rows twice as wide, which is all Dynamo's guards see of it
    rows = signature_of({"query": q[:, :, ::2], "key": k, "value": v, "enable_gqa": True}, "default", False)
    assert rows.layout == "q=bshd(row=128) k=bshd v=bshd"
    strided = signature_of({"query": q[..., ::2], "key": k, "value": v, "enable_gqa": True}, "default", False)
    assert strided.layout.startswith("q=strided(")


@pytest.mark.parametrize("heads", [1, 2])
def test_a_layout_is_named_by_the_strides_dynamo_guards_on_with_size_one_head_dims_too(heads: int) -> None:
    """One kv head (multi-query attention, Gemma3): transformers' k is proj(x).view(B, S, 1, D).transpose(1, 2),
    which is_contiguous() calls contiguous (it ignores a size-1 dim's stride) but whose stride on the head dim differs
    from a contiguous tensor's, and Dynamo guards it: the signature tells them apart, and the canonical inputs of
    each layout have the strides of the tensor named so (the layout a recipe says is the one the warm-up traces)."""
    b, s, d = 1, 256, 32
    x = torch.randn(b, s, 32)
    view = torch.nn.Linear(32, heads * d)(x).view(b, s, heads, d).transpose(1, 2)
    made = torch.empty(view.shape).copy_(view)  # not .contiguous(): with one head it returns the view itself
    assert signature_of({"query": view, "key": view, "value": view}, "default", False).layout == "bshd"
    assert signature_of({"query": made, "key": made, "value": made}, "default", False).layout == "bhsd"
    if heads == 1:
        assert view.is_contiguous() and view.stride() != made.stride()  # what fooled is_contiguous()
    for layout, real in (("bshd", view), ("bhsd", made)):
        config = Config(
            mask="sliding_window", window=64, q_heads=4, kv_heads=heads, q_len=s, kv_len=s, head_dim=d,
            batch=b, dtype="float32", device="cpu", layout=layout,
        )  # fmt: skip
        _, k, _ = make_inputs(config, "cpu")
        assert k.stride() == real.stride(), (layout, k.stride(), real.stride())
    odd = torch.empty_strided((b, heads, s, d), (7 * s * d, s * d, d, 1))  # a size-1 batch dim with another stride
    assert signature_of({"query": odd, "key": odd, "value": odd}, "default", False).layout.startswith("strided(")


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_slice_of_a_fused_projection_is_named_by_its_rows_and_made_again_so(dynamic: bool) -> None:
    """Phi-3's v is a slice of qkv_proj(x)'s rows ([B, S, (Hq + 2 Hkv) D]); GPT-NeoX's a chunk of each head's 3 D:
    neither is bshd, and Dynamo guards their strides. The signature names them by their rows ("bshd(row=128)",
    "bshd(head=48,row=192)"), and the canonical inputs of those layouts have the model's strides (for a static graph
    a view at the end of each row, as the model's v; for a dynamic one, not a view)."""
    b, s, hq, hkv, d = 2, 64, 4, 2, 16
    qkv = torch.randn(b, s, (hq + 2 * hkv) * d)
    phi3 = qkv[..., (hq + hkv) * d :].view(b, s, hkv, d).transpose(1, 2)
    neox = torch.randn(b, s, hq * 3 * d).view(b, s, hq, 3 * d).transpose(1, 2).chunk(3, dim=-1)[2]
    for real, name, heads in ((phi3, "bshd(row=128)", hkv), (neox, "bshd(head=48,row=192)", hq)):
        assert signature_of({"query": real, "key": real, "value": real}, "default", False).layout == name
        config = Config(
            mask="sliding_window", window=64, q_heads=4, kv_heads=heads, q_len=s, kv_len=s, head_dim=d, batch=b,
            dtype="float32",
            device="cpu", layout=f"q=bhsd k=bhsd v={name}", dynamic=dynamic,
        )  # fmt: skip
        q, _, v = make_inputs(config, "cpu")
        assert v.stride() == real.stride() and q.is_contiguous(), (name, v.stride(), real.stride())
        assert (v._base is not None) == (not dynamic), name
    assert layout_name(torch.randn(b, s, hq, 32)[..., :d].transpose(1, 2)) == "bshd(head=32,row=128)"
    assert layout_name(torch.randn(b, hq, s, 32)[..., :d]) == "bhsd(row=32)"
    every_other_batch = torch.randn(2 * b, s, hq, d)[::2].transpose(1, 2)  # rows, but not one buffer of them
    assert layout_name(every_other_batch).startswith("strided(")


def test_mod_graphs_tell_what_a_function_computes_not_its_name() -> None:
    from kernelpack.masks import sliding_window
    from kernelpack.signature import mod_graph

    w = 64

    def mine(b: object, h: object, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:  # other names, same graph
        return (q >= kv) & (q - kv < w)

    def reordered(b: object, h: object, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (q - kv < w) & (q >= kv)

    builtin = mod_graph(sliding_window(64), "mask")
    assert builtin is not None and builtin.text.splitlines()[-1] == "return %3"
    assert mod_graph(mine, "mask") == builtin and mod_graph(reordered, "mask") != builtin
    assert mod_graph(sliding_window(128), "mask") != builtin  # a closure constant is part of the graph

    def per_batch(anchors: torch.Tensor) -> object:  # a new closure every step, as the drafters build them
        def mask_mod(b: torch.Tensor, h: object, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return (q >= kv) & (kv >= anchors[b])

        return mask_mod

    graph = mod_graph(per_batch(torch.zeros(4, dtype=torch.int32)), "mask")  # type: ignore[arg-type]
    assert graph is not None and "__getitem__(tensor(4,):int32, b)" in graph.text
    # a closed-over tensor enters by shape and dtype, not by value
    assert mod_graph(per_batch(torch.full((4,), 7, dtype=torch.int32)), "mask") == graph  # type: ignore[arg-type]
    assert mod_graph(per_batch(torch.zeros(8, dtype=torch.int32)), "mask") != graph  # type: ignore[arg-type]

    def branchy(b: object, h: object, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return q >= kv if q.item() > 3 else q < kv  # depends on a value, not on a graph

    assert mod_graph(branchy, "mask") is None
    softcap = None

    def hf_score_mod(score: torch.Tensor, b: object, h: object, q: object, kv: object) -> torch.Tensor:
        if softcap is not None:  # transformers' flex_attention_forward: an identity unless softcapping
            score = softcap * torch.tanh(score / softcap)
        return score

    assert mod_graph(hf_score_mod, "score") == mod_graph(lambda score, b, h, q, kv: score, "score")


def test_arguments_that_mean_the_default_are_keyed_and_passed_as_the_default() -> None:
    """TorchTitan passes ``AuxRequest(lse=False)`` and ``kernel_options={}`` on every call, others write flex's
    default scale out or ask for GQA with as many kv heads as q heads: torch traces one graph for each pair, so each is
    one signature, and the call is passed on in the default's spelling (Dynamo guards on the value as passed)."""
    from torch.nn.attention.flex_attention import AuxRequest

    from kernelpack.signature import normalized

    q = torch.randn(1, 4, 128, 16)
    plain = {"query": q, "key": q.clone(), "value": q.clone()}
    base = signature_of(plain, "default", False)
    same = [
        {"return_aux": AuxRequest(lse=False)},
        {"return_aux": AuxRequest(lse=False, max_scores=False)},
        {"kernel_options": {}},
        {"kernel_options": {"BACKEND": "AUTO", "PRESCALE_QK": False, "ROWS_GUARANTEED_SAFE": False}},
        {"kernel_options": {"BLOCKS_ARE_CONTIGUOUS": False, "WRITE_DQ": True}},
        {"scale": 0.25},  # 1 / sqrt(16)
        {"scale": 16**-0.5},
        {"enable_gqa": True},  # 4 q heads, 4 kv heads
    ]
    for extra in same:
        args, empty_aux = normalized({**plain, **extra})
        assert signature_of({**plain, **extra}, "default", False) == base, extra
        assert signature_of(args, "default", False) == base, extra
        assert args.get("return_aux") is None and args.get("kernel_options") is None, (extra, args)
        assert args.get("scale") is None and not args.get("enable_gqa"), (extra, args)
        assert empty_aux == ("return_aux" in extra), extra
    differ = [
        ({"return_aux": AuxRequest(lse=True)}, "return_aux"),
        ({"kernel_options": {"BACKEND": "FLASH"}}, "kernel_options"),  # never dropped: another kernel
        ({"kernel_options": {"BACKEND": "TRITON"}}, "kernel_options"),
        ({"kernel_options": {"WRITE_DQ": 1}}, "kernel_options"),  # torch keeps 1, not True
        ({"kernel_options": {"PRESCALE_QK": True}}, "kernel_options"),
        ({"scale": 0.3}, "scale"),
    ]
    for extra, field in differ:
        sig = signature_of({**plain, **extra}, "default", False)
        assert [f for f, _, _ in sig.differences(base)] == [field], extra
        assert normalized({**plain, **extra})[0].get(field) is not None, extra
    gqa = {"query": q, "key": torch.randn(1, 2, 128, 16), "value": torch.randn(1, 2, 128, 16), "enable_gqa": True}
    assert normalized(gqa)[0]["enable_gqa"] is True and signature_of(gqa, "default", False).enable_gqa


def test_a_recipe_point_that_spells_out_a_default_is_keyed_as_the_call_without_it() -> None:
    """A recipe's ``kernel_options.PRESCALE_QK = false`` or ``scale = 0.125`` (head_dim 64) builds the graph of no
    option: its signature equals the call's that omits them, its id stays its own (the artifact's parts are named by
    it), and the canonical call passes them in the default's spelling."""
    from kernelpack.canonical import arguments

    smoke = load_recipe(Path(__file__).resolve().parent.parent / "recipes" / "smoke-cpu.toml").configs[0]
    spelled = dataclasses.replace(smoke, kernel_options=(("PRESCALE_QK", False),), scale=smoke.head_dim**-0.5)
    assert spelled.id != smoke.id
    assert spelled.signatures(None) == smoke.signatures(None)
    canonical = arguments(spelled, make_inputs(spelled, "cpu", random=False), None)
    assert canonical["kernel_options"] is None and "scale" not in canonical
