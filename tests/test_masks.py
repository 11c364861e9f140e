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


def _dense_gaps(mask_mod: Any, bm: Any, tile: int) -> set[tuple[int, int, int]]:
    """The rows whose first scheduled tile keeps no key, read from the dense mask (torch's create_mask): the oracle
    for first_tile_gaps, which evaluates only those tiles."""
    from torch.nn.attention.flex_attention import create_mask

    q_len, kv_len = bm.seq_lengths
    q_block, kv_block = bm.BLOCK_SIZE
    B, H, _ = bm.kv_num_blocks.shape
    dense = create_mask(mask_mod, B, H, q_len, kv_len, "cpu")
    full = bm.full_kv_num_blocks
    out = set()
    for b in range(B):
        for h in range(H):
            for row in range(q_len):
                i = row // q_block
                if int(bm.kv_num_blocks[b, h, i]) == 0:
                    if full is None or int(full[b, h, i]) == 0:
                        out.add((b, h, row))
                    continue
                k0 = int(bm.kv_indices[b, h, i, 0]) * kv_block
                if not bool(dense[b, h, row, k0 : min(k0 + tile, kv_len)].any()):
                    out.add((b, h, row))
    return out


def left_padded(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return (q >= kv) & (kv >= 300 * b)  # row b=1 keeps no key below 300: its first rows have none at all


@pytest.mark.parametrize("tile", [16, 64])
@pytest.mark.parametrize(
    "mask_mod, batch, heads, q_len, kv_len, holds",
    [
        (sliding_window(64), None, None, 1000, 1000, False),
        (sliding_window(200), None, None, 700, 700, False),
        (sliding_window(5000), None, None, 1000, 1000, True),  # wider than the sequence: causal
        (documents, None, None, 1000, 1000, False),
        (per_head, None, 3, 700, 900, False),
        (left_padded, 2, None, 600, 600, False),
    ],
    ids=["window64", "window200", "causal", "documents", "per-head", "left-padded"],
)
def test_first_tile_gaps_are_the_rows_whose_first_scheduled_keys_are_all_masked(
    mask_mod: Any, batch: Any, heads: Any, q_len: int, kv_len: int, holds: bool, tile: int
) -> None:
    """kernel_options.ROWS_GUARANTEED_SAFE's condition (torch 2.15's docs): every row keeps a key in the first tile of
    the first KV block scheduled for it. first_tile_gaps evaluates only those tiles; the dense mask says the same.
    Causal attention holds it (the docs' example); sliding windows, documents and padded rows do not."""
    from kernelpack.masks import first_tile_gaps

    bm = create_block_mask(mask_mod, batch, heads, q_len, kv_len, device="cpu")
    got = {(g["batch"], g["head"], g["row"]) for g in first_tile_gaps(bm, tile, limit=None, max_elements=5000)}
    assert got == _dense_gaps(mask_mod, bm, tile)
    assert (not got) == holds, sorted(got)[:5]
    first = first_tile_gaps(bm, tile)
    assert len(first) == min(1, len(got)) and all((g["batch"], g["head"], g["row"]) in got for g in first)
