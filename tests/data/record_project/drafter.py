"""A block-diffusion drafter in the shape of DFlash (written for kernelpack's tests, not copied from any project).

The draft model predicts ``blocks`` blocks of ``block`` tokens at once. Each draft block starts at an anchor
position of the context; its queries see the context before their anchor (the last ``window`` positions of it in a
sliding layer) and their own draft block. Keys are the ``context`` context positions followed by every draft
token, so q_len = blocks * block and kv_len = context + blocks * block, and the context length changes every step.

The mask is rebuilt every step with torch's ``create_block_mask``; it closes over two tensors (``anchors``,
``keep``: [B, blocks]) and over the ints ``context``, ``blocks``, ``block`` and ``window`` (None in a full layer).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask


def anchored_mask(anchors: torch.Tensor, keep: torch.Tensor, context: int, block: int, window: int | None) -> Any:
    blocks = anchors.shape[1]

    def draft_mask(b, h, q_idx, kv_idx):
        own_block = q_idx // block
        row = own_block.clamp(max=blocks - 1)
        anchor = anchors[b, row]
        in_context = (kv_idx < context) & (kv_idx < anchor)
        if window is not None:
            in_context = in_context & (kv_idx > anchor - window)
        in_draft = (kv_idx >= context) & ((kv_idx - context) // block == own_block)
        return (in_context | in_draft) & keep[b, row]

    return draft_mask


class DraftAttention(nn.Module):
    """One attention layer of the drafter: queries from the draft tokens, keys and values from the context's
    hidden states followed by the draft tokens'."""

    def __init__(
        self, hidden: int, heads: int, kv_heads: int, head_dim: int, window: int | None, flex: Any, masks: Any = None
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.window, self.flex = heads, kv_heads, head_dim, window, flex
        self.masks = (
            masks  # None: this module's anchored_mask; else f(anchors, keep, context, block, window) -> BlockMask
        )
        self.q = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, draft: torch.Tensor, context: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor) -> Any:
        b, n, _ = draft.shape
        block = n // anchors.shape[1]
        keys = torch.cat([context, draft], dim=1)
        if self.masks is not None:  # another project's mask builder (SpecForge's create_dflash_block_mask)
            bm = self.masks(anchors, keep, context.shape[1], block, self.window)
        else:
            mask_mod = anchored_mask(anchors, keep, context.shape[1], block, self.window)
            bm = create_block_mask(mask_mod, b, None, n, keys.shape[1], device=draft.device)
        q = self.q(draft).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(keys).view(b, keys.shape[1], self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(keys).view(b, keys.shape[1], self.kv_heads, self.head_dim).transpose(1, 2)
        out = self.flex(q, k, v, block_mask=bm, enable_gqa=self.heads != self.kv_heads)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


class Drafter(nn.Module):
    """A sliding-window layer, then a full one; with ``checkpoint``, each recomputed in backward by reentrant
    gradient checkpointing (its tensors passed positionally: reentrant checkpoint sees only those)."""

    def __init__(
        self, hidden: int, heads: int, kv_heads: int, head_dim: int, window: int, flex: Any, masks: Any = None
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [DraftAttention(hidden, heads, kv_heads, head_dim, w, flex, masks) for w in (window, None)]
        )
        self.checkpoint = False

    def forward(self, draft: torch.Tensor, context: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor) -> Any:
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:
            if self.checkpoint and torch.is_grad_enabled():
                draft = draft + checkpoint(layer, draft, context, anchors, keep, use_reentrant=True)
            else:
                draft = draft + layer(draft, context, anchors, keep)
        return draft
