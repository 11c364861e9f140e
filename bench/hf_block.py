"""An attention block as a transformers model writes it: the user's code that an artifact must serve, not
kernelpack's canonical call. Linear projections seen as [B, H, S, D] through ``.view(B, S, H, D).transpose(1, 2)``,
the user's own sliding-window mask in its own words, torch's ``create_block_mask`` rebuilt every step. Shared by
bench/user_block.py and bench/checkpoint_threads.py (``--block hf``); served by a recipe with ``[call] layout =
"bshd"`` (recipes/dflash-drafter-bshd.toml).
"""

from __future__ import annotations

from typing import Any

import torch


def sliding_window(window: int) -> Any:
    """The user's mask: causal, at most ``window`` back. Not kernelpack's function: kernelpack serves it because
    it computes the same graph as the recipe's ``sliding_window`` mask."""

    def local_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        causal = q_idx >= kv_idx
        near = q_idx - kv_idx < window
        return causal & near

    return local_causal


def block_mask(config: Any, device: str) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(sliding_window(config.window), None, None, config.q_len, config.kv_len, device=device)


class Attention(torch.nn.Module):
    def __init__(self, config: Any, flex: Any, device: str) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = config.q_heads, config.kv_heads, config.head_dim
        hidden = self.hq * self.d
        kw = {"bias": False, "device": device, "dtype": getattr(torch, config.dtype)}
        self.q_proj = torch.nn.Linear(hidden, self.hq * self.d, **kw)
        self.k_proj = torch.nn.Linear(hidden, self.hkv * self.d, **kw)
        self.v_proj = torch.nn.Linear(hidden, self.hkv * self.d, **kw)
        self.o_proj = torch.nn.Linear(self.hq * self.d, hidden, **kw)
        self.flex = flex
        # as transformers' flex_attention_forward passes them, where the recipe declares them
        self.scale = config.scale
        self.with_score_mod = config.score_mod == "identity"
        self.lse = "lse" in config.return_aux

    def forward(self, x: torch.Tensor, mask: Any) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.hq, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.hkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.hkv, self.d).transpose(1, 2)
        softcap = None
        kwargs: dict[str, Any] = {"block_mask": mask, "enable_gqa": self.hq != self.hkv, "scale": self.scale}
        if self.with_score_mod:  # transformers: a closure over softcap, the identity when there is none

            def score_mod(score: Any, batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
                if softcap is not None:
                    score = softcap * torch.tanh(score / softcap)
                return score

            kwargs["score_mod"] = score_mod
        if self.lse:  # transformers asks for the lse through return_aux on torch >= 2.9
            from torch.nn.attention.flex_attention import AuxRequest

            kwargs["return_aux"] = AuxRequest(lse=True)
        out = self.flex(q, k, v, **kwargs)
        if self.lse:
            out, _aux = out
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def hidden_states(config: Any, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(config.batch, config.q_len, config.q_heads * config.head_dim, generator=g)
    return x.to(device, getattr(torch, config.dtype))
