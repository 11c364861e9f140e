"""Several workers on a node: each rank's GPU as cuda:0 (:func:`pin_local_gpu`), or a cache dir of its own
(:func:`rank_cache_dir`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .. import settings
from ..errors import KernelpackError
from ..installer import resolve_cache_dir


def pin_local_gpu(local_rank: int | None = None) -> str:
    """Make this process see only its own GPU, as ``cuda:0`` (what ``torchrun --virtual-local-rank`` does).

    Inductor's cache keys contain the device index (pytorch#170123): an artifact built on cuda:0 misses on cuda:5.
    Pinning each rank's GPU as cuda:0 lets one single-GPU artifact hit on every rank. Must run before CUDA
    initializes; ``local_rank`` defaults to $LOCAL_RANK. Returns the CUDA_VISIBLE_DEVICES entry now in force.
    """
    if local_rank is None:
        local_rank = settings.local_rank()
        if local_rank is None:
            raise KernelpackError("pin_local_gpu: LOCAL_RANK is not set", hint="pass local_rank= or run under torchrun")
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_initialized():
            raise KernelpackError(
                "pin_local_gpu: CUDA is already initialized in this process; CUDA_VISIBLE_DEVICES no longer applies",
                hint="call kernelpack.runtime.pin_local_gpu() at the very top of the worker, before any CUDA call",
            )
    devices = settings.cuda_visible_devices()
    if devices is not None and local_rank >= len(devices):
        raise KernelpackError(
            f"pin_local_gpu: LOCAL_RANK={local_rank} but CUDA_VISIBLE_DEVICES={','.join(devices)!r} lists "
            f"{len(devices)}",
            hint="start one process per visible GPU",
        )
    chosen = devices[local_rank] if devices is not None else str(local_rank)
    os.environ["CUDA_VISIBLE_DEVICES"] = chosen
    return chosen


def rank_cache_dir(base: str | os.PathLike[str] | None = None, local_rank: int | None = None) -> Path:
    """A private cache dir per worker on a node: ``<base>/rank<LOCAL_RANK>`` (base: the inductor cache dir).

    For jobs that keep one cache per rank instead of sharing the node directory; both are safe with concurrent
    installers. ``local_rank`` defaults to $LOCAL_RANK.
    """
    if local_rank is None:
        local_rank = settings.local_rank()
        if local_rank is None:
            raise KernelpackError("LOCAL_RANK is not set", hint="pass local_rank= or run under torchrun")
    return resolve_cache_dir(base) / f"rank{local_rank}"
