"""Job start and the runtime guard: the one package that changes the process kernelpack runs in.

Job start (:mod:`.start`, every door goes through one function):

- :func:`install` / :func:`install_from`: install an artifact (a path, or a registry's artifact for this environment,
  downloaded once per node) and point this process at it: ``TORCHINDUCTOR_CACHE_DIR`` and Dynamo's recompile floor.
  ``kernelpack.install`` and ``kernelpack.install_from``.
- :func:`activate`: the same, plus the warm-up and the guard. Call it once at job start, in the main thread.

The guard (:func:`activate`, then every :func:`flex_attention` call) makes a first step safe in threads:

- The warm-up (:mod:`.warmup`) makes the first call of every covered signature that must trace before training, so
  that no flex call traces during training: a Dynamo trace of a training graph runs make_fx and
  ``torch.autograd.grad`` with torch.fx's process-global tracing flag set, and waits for the autograd engine's device
  thread, which may be running another thread's backward whose checkpoint recompute calls flex: a deadlock whatever
  lock order we pick. Precompiled functions (tier 2) load at their signature's first call: loading traces nothing.
  After it, Dynamo's own guards tell a served call from one that would trace; the latter is refused
  (:class:`~kernelpack.errors.NotWarmedError`, :mod:`.refusals`).
- Without a warm-up (``activate(warmup=False)``, or no artifact), the first call of each call signature runs alone at
  the gate of :mod:`kernelpack.compiled`; steady-state calls run in parallel; a call inside a backward pass never
  waits there for long (:mod:`.dispatch`).
- Strict mode refuses a call the artifact does not cover (:class:`~kernelpack.errors.NotPrecompiledError`, from
  :meth:`Manifest.covers <kernelpack.manifest.Manifest.covers>`) instead of cold-compiling.
- The dense math path is refused (:class:`~kernelpack.errors.DenseFallbackError`), detected where torch runs it
  (:mod:`kernelpack.evidence`).
- :func:`report` (:mod:`.reporting`) says what each first call cost and whether it compiled anything; every compile is
  attributed to the code path and the call that made it (:mod:`.attribution`).

Observers (:func:`observe_calls`, what ``kernelpack record`` uses) see every flex_attention call of the three paths:
kernelpack's entry (and the transformers integration through it) as it is made, the user's own
``torch.compile(flex_attention)`` as Dynamo compiles it.

The package's modules import only down this list: ``session`` (the activation's state), ``refusals``,
``attribution``, ``warmup``, ``dispatch`` and ``reporting``, ``start``; ``ranks`` stands alone (tests/test_layers.py).
"""

from __future__ import annotations

from .attribution import LOAD_PATH, CallObserver, Observed, observe_calls
from .dispatch import flex_attention, guarded
from .ranks import pin_local_gpu, rank_cache_dir
from .refusals import guard_hint, length_hint, refusal
from .reporting import REPORT_SCHEMA, RuntimeReport, report
from .session import Activation, FirstCall, Warmup, active, padded_length, padded_lengths
from .start import INTEGRATIONS, activate, deactivate, install, install_from

__all__ = [
    "INTEGRATIONS",
    "LOAD_PATH",
    "REPORT_SCHEMA",
    "Activation",
    "CallObserver",
    "FirstCall",
    "Observed",
    "RuntimeReport",
    "Warmup",
    "activate",
    "active",
    "deactivate",
    "flex_attention",
    "guard_hint",
    "guarded",
    "install",
    "install_from",
    "length_hint",
    "observe_calls",
    "padded_length",
    "padded_lengths",
    "pin_local_gpu",
    "rank_cache_dir",
    "refusal",
    "report",
]
