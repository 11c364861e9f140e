"""The float64 reference must itself be right: compare it with torch's SDPA + autograd on a dense mask."""

from __future__ import annotations

import pytest
import torch

from kernelpack.config import Config
from kernelpack.masks import mask_for, sliding_window, sliding_window_bidirectional
from kernelpack.workload import check_errors, reference_attention


def cfg(**over: object) -> Config:
    base = dict(
        device="cpu",
        mask="sliding_window",
        window=5,
        batch=2,
        q_heads=4,
        kv_heads=2,
        q_len=24,
        kv_len=24,
        head_dim=8,
        dtype="float32",
        graphs=("fwd",),  # the reference computes gradients whenever it is given dout
    )
    base.update(over)
    return Config(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("mask", ["sliding_window", "sliding_window_bidirectional"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_reference_matches_sdpa_forward_and_gradients(mask: str, kv_heads: int) -> None:
    c = cfg(mask=mask, kv_heads=kv_heads)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(c.batch, c.q_heads, c.q_len, c.head_dim, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(c.batch, c.kv_heads, c.kv_len, c.head_dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(c.batch, c.kv_heads, c.kv_len, c.head_dim, generator=g, dtype=torch.float64, requires_grad=True)
    do = torch.randn(c.batch, c.q_heads, c.q_len, c.head_dim, generator=g, dtype=torch.float64)
    qi, ki = torch.arange(c.q_len)[:, None], torch.arange(c.kv_len)[None, :]
    dense = mask_for(c)(None, None, qi, ki)
    group = c.q_heads // c.kv_heads
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=dense
    )
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    ours = reference_attention(c, q, k, v, do, chunk=7)  # a chunk that does not divide the length
    for got, want in zip(ours, (ref, *ref_grads), strict=True):
        torch.testing.assert_close(got, want)


def test_masks_are_what_they_say() -> None:
    qi, ki = torch.arange(8)[:, None], torch.arange(8)[None, :]
    causal = sliding_window(3)(0, 0, qi, ki)
    assert causal[5].tolist() == [False, False, False, True, True, True, False, False]
    bi = sliding_window_bidirectional(3)(0, 0, qi, ki)
    assert bi[5].tolist() == [False, False, False, True, True, True, True, True]
    assert sliding_window(3) is sliding_window(3)  # one function object per window: no guard churn


def test_check_errors_flags_large_and_nan_errors() -> None:
    c = cfg(dtype="bfloat16")
    assert check_errors(c, {"out": 1e-3, "dq": 2e-2}) is None
    assert "dq rel. error 5.00e-02" in (check_errors(c, {"out": 1e-3, "dq": 5e-2}) or "")
    assert check_errors(c, {"out": float("nan")}) is not None


@pytest.mark.parametrize("alias", ["k=v", "q=k", "q=v", "q=k=v"])
def test_reference_gradients_of_aliased_inputs_are_what_autograd_returns(alias: str) -> None:
    """One tensor passed as several of q, k, v: autograd returns the sum of its gradients at every position it fills,
    and the build's reference check compares against that."""
    from kernelpack.workload import _aliased

    c = cfg(kv_heads=4, alias=alias)
    g = torch.Generator().manual_seed(1)
    shape = (c.batch, c.q_heads, c.q_len, c.head_dim)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    k = q if alias in ("q=k", "q=k=v") else k
    v = {"k=v": k, "q=v": q, "q=k=v": q}.get(alias, v)
    do = torch.randn(shape, generator=g, dtype=torch.float64)
    qi, ki = torch.arange(c.q_len)[:, None], torch.arange(c.kv_len)[None, :]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask_for(c)(None, None, qi, ki))
    autograd = torch.autograd.grad(out, (q, k, v), do)
    _, *separate = reference_attention(c, q, k, v, do)
    for got, want in zip(_aliased(separate, alias), autograd, strict=True):
        torch.testing.assert_close(got, want)


def test_rows_guaranteed_safe_is_refused_by_the_build_where_a_row_would_be_nan(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """kernel_options.ROWS_GUARANTEED_SAFE = true on a sliding window (the case torch's docs warn about): the build
    refuses the config before compiling, naming the row, the KV block and the fix, and writes no artifact. The same
    promise on a window wider than the sequence (causal) holds; BLOCK_N is the tile checked, and a dynamic range is
    checked at its ends too."""
    from kernelpack.build import build_recipe
    from kernelpack.errors import BuildError
    from kernelpack.masks import rows_guaranteed_safe_problem

    recipe = tmp_path / "r.toml"
    recipe.write_text(
        'name = "r"\ndevice = "cpu"\n[[calls]]\nmask = "sliding_window"\nwindow = 200\nbatch = 1\nq_heads = 2\n'
        'kv_heads = 2\nseq_len = 512\nhead_dim = 16\ndtype = "float32"\ngraphs = ["fwd"]\n'
        "[calls.kernel_options]\nROWS_GUARANTEED_SAFE = true\n"
    )
    with pytest.raises(BuildError) as e:
        build_recipe(recipe, tmp_path / "out", jobs=1)
    text = str(e.value)
    assert "kernel_options.ROWS_GUARANTEED_SAFE = true, but at q_len 512, kv_len 512: row 215" in text, text
    assert "keys 0..15, the first 16 of KV block 0" in text and "Drop the option" in text, text
    assert not list(tmp_path.rglob("*.kpack")), list(tmp_path.rglob("*.kpack"))

    promise = cfg(window=200, q_len=512, kv_len=512, kernel_options=(("ROWS_GUARANTEED_SAFE", True),))
    assert "row 215" in (rows_guaranteed_safe_problem(promise, "cpu", []) or "")
    assert rows_guaranteed_safe_problem(cfg(window=200, q_len=512, kv_len=512), "cpu", []) is None  # no promise
    causal = cfg(window=4096, q_len=512, kv_len=512, kernel_options=promise.kernel_options)
    assert rows_guaranteed_safe_problem(causal, "cpu", []) is None
    # row 215's window starts at key 16: a 16-key tile misses it, a 32-key one (BLOCK_N = 32) does not; row 231's
    # starts at 32, so BLOCK_N = 32 finds that one
    wide = cfg(window=200, q_len=512, kv_len=512, kernel_options=(("BLOCK_N", 32), ("ROWS_GUARANTEED_SAFE", True)))
    assert "row 231" in (rows_guaranteed_safe_problem(wide, "cpu", []) or "")
    # at one block every row's first tile keeps key 0; a length the check is also given (a range's end) does not
    small = cfg(window=200, q_len=128, kv_len=128, kernel_options=promise.kernel_options)
    assert rows_guaranteed_safe_problem(small, "cpu", []) is None
    assert "at q_len 512, kv_len 512" in (rows_guaranteed_safe_problem(small, "cpu", [(512, 512)]) or "")
