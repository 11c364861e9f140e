"""A user's model code, as it would be in their own package: not kernelpack's. Used by tests/test_recording.py
(``kernelpack record -- python train.py``) and the GPU test."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def local_window(window: int) -> Any:
    """The user's own mask, in its own words: causal, at most ``window`` back."""

    def local_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return local_causal


class Attention(torch.nn.Module):
    """Linear projections seen as [B, H, S, D] through ``.view(B, S, H, D).transpose(1, 2)`` (what every HF model
    passes), GQA, a scale, a score_mod closure that returns the score (transformers' without softcap); ``flex`` is
    kernelpack.flex_attention, or the user's own ``torch.compile(flex_attention)``."""

    def __init__(self, flex: Any, hq: int = 4, hkv: int = 2, d: int = 16, window: int = 64) -> None:
        super().__init__()
        self.hq, self.hkv, self.d, self.window, self.flex = hq, hkv, d, window, flex
        hidden = hq * d
        self.q_proj = torch.nn.Linear(hidden, hq * d, bias=False)
        self.k_proj = torch.nn.Linear(hidden, hkv * d, bias=False)
        self.v_proj = torch.nn.Linear(hidden, hkv * d, bias=False)
        self.o_proj = torch.nn.Linear(hq * d, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.hq, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.hkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.hkv, self.d).transpose(1, 2)
        mask = create_block_mask(local_window(self.window), None, None, s, s, device=x.device)  # every step
        softcap = None

        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            if softcap is not None:
                score = softcap * torch.tanh(score / softcap)
            return score

        out = self.flex(q, k, v, score_mod=score_mod, block_mask=mask, scale=self.d**-0.5, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def own_compiled_flex() -> Any:
    """The user's own torch.compile of flex_attention (static shapes, as a fixed-length job would)."""
    return torch.compile(flex_attention, dynamic=False)


def documents(doc_ids: torch.Tensor) -> Any:
    """A mask over a tensor (packed documents): record cannot name it by reference, it needs a factory."""

    def same_document(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return doc_ids[q_idx] == doc_ids[kv_idx]

    return same_document


# Masks as real code makes them: cached and decorated factories, siblings of one name, comprehension lambdas, the
# late-binding default idiom, a dtype in the closure (tests/test_recording.py: each named and made again exactly).


@functools.lru_cache
def cached_window(window: int) -> Any:
    def cached(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return cached


def logged(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return fn(b, h, q_idx, kv_idx)

    return wrapper


def decorated_window(window: int) -> Any:
    @logged
    def decorated(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx - kv_idx < window

    return decorated


def causal_or_window(causal: bool, window: int) -> Any:
    if causal:

        def mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return q_idx >= kv_idx
    else:

        def mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return q_idx - kv_idx < window

    return mask


def comprehension_windows(windows: tuple[int, ...]) -> list[Any]:
    return [lambda b, h, q_idx, kv_idx, w=w: q_idx - kv_idx < w for w in windows]


def typed_window(window: int, dtype: torch.dtype) -> Any:
    def typed(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx - kv_idx).to(dtype) < window

    return typed
