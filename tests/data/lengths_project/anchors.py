"""A DFlash-style drafter's mask, as its code makes it: each draft block of 16 queries sees the
context up to its anchor and its own block. The anchors are a tensor of one entry per block, so its length follows
the batch's length: a recipe serves it over a range through the factory below."""

from __future__ import annotations

from typing import Any

import torch

BLOCK = 16


def make_mask(anchors: torch.Tensor) -> Any:
    def anchor_mask(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (kv_idx <= anchors[q_idx // BLOCK]) | (kv_idx // BLOCK == q_idx // BLOCK)

    return anchor_mask


def factory(config: Any) -> Any:
    """The recipe's mask factory: the job's own function over example anchors of this config's length."""
    # One anchor per draft block, the last one partial: the builder calls a dynamic range at lengths that are not
    # multiples of BLOCK, and a short tensor is indexed out of bounds there (a device-side assert on CUDA).
    # On the device of the call (CUDA: the current one, which the builder and the warm-up set).
    return make_mask(torch.zeros(-(-config.q_len // BLOCK), dtype=torch.int32, device=config.device))
