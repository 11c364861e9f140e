"""The autograd engine, as the first-call gate needs it."""

from __future__ import annotations


def in_backward() -> bool:
    """Whether this thread is running a backward pass (an autograd engine thread, or a backward on the CPU): the
    thread that a first call's make_fx + ``torch.autograd.grad`` may be waiting for. torch 2.11-2.15: the engine's
    current graph task id, -1 outside a backward."""
    import torch

    return bool(torch._C._current_graph_task_id() != -1)
