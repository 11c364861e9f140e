"""kernelpack's BlockMask builder: torch's create_block_mask, the same BlockMask, in bounded memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from kernelpack.masks import eager_block_mask, sliding_window

IDS = torch.sort(torch.randint(0, 5, (1000,), generator=torch.Generator().manual_seed(0)))[0]


def documents(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return (IDS[q] == IDS[kv]) & (q >= kv)


def per_head(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return (q - kv < 64 * (h + 1)) & (q >= kv)


def per_batch(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return (q >= kv) | (b == 1)


FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
FIELDS += ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize(
    "mask_mod, batch, heads, q_len, kv_len, block",
    [
        (sliding_window(64), None, None, 1000, 1000, 128),
        (sliding_window(300), None, None, 2048, 4096, (128, 64)),
        (documents, None, None, 1000, 1000, 128),
        (per_head, None, 3, 700, 900, 128),
        (per_batch, 2, None, 513, 513, 64),
    ],
)
def test_the_bounded_builder_makes_torchs_block_mask(
    mask_mod: Any, batch: int | None, heads: int | None, q_len: int, kv_len: int, block: Any
) -> None:
    """In chunks of whole query blocks (here far smaller than the grid), with ragged tails: every block table equal
    to create_block_mask's, and the BlockMask carries the caller's own mask_mod."""
    want = create_block_mask(mask_mod, batch, heads, q_len, kv_len, device="cpu", BLOCK_SIZE=block)
    got = eager_block_mask(mask_mod, batch, heads, q_len, kv_len, "cpu", block, max_elements=300_000)
    for name in FIELDS:
        a, b = getattr(want, name), getattr(got, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    assert got.BLOCK_SIZE == want.BLOCK_SIZE and got.seq_lengths == want.seq_lengths and got.mask_mod is mask_mod
