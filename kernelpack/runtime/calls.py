"""One flex_attention call as the runtime serves it: :class:`FlexCall`, made once per call.

Its arguments are in the spelling calls are served in (:func:`kernelpack.signature.normalized`: an ``AuxRequest``
that asks for nothing is None, ``kernel_options`` at torch's defaults are none, flex's default scale written out is
None), and a call autograd does not record is made on detached inputs under ``no_grad`` (the canonical forward-only
call). Its signature, keyed against the active artifact, is computed once, when a server first asks for it, and
every server and the refusal read that one (:mod:`.serving`, :mod:`.refusals`). The user's own
``torch.compile(flex_attention)``, seen at its compile (:mod:`.attribution`), and ``kernelpack record`` key their
calls through it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ..manifest import BuiltConfig, Coverage
from ..signature import CallSignature, graph_of, mask_key, mask_keys, mod_graph, normalized, signature_of
from .session import Activation, current

# What a call keys against a manifest: its signature, and the entry that serves it with the signature that entry
# was built at (a dynamic range config's traced call), or None
Resolution = tuple[CallSignature, "tuple[BuiltConfig, CallSignature] | None"]


class FlexCall:
    """A flex_attention call with the options of the compiled callable it goes through (``mode``, ``dynamic``)."""

    __slots__ = ("_coverage", "_resolved", "arguments", "dynamic", "empty_aux", "mode", "no_grad")

    def __init__(
        self, arguments: dict[str, Any], mode: str, dynamic: bool, *, empty_aux: bool = False, no_grad: bool = False
    ) -> None:
        self.arguments = arguments  # by flex_attention's parameter names, normalized
        self.mode = mode
        self.dynamic = dynamic
        self.empty_aux = empty_aux  # the caller passed an AuxRequest that asks for nothing (return_aux is None here)
        self.no_grad = no_grad  # made on detached inputs under no_grad (a forward-only call)
        self._resolved: dict[tuple[str, bool], Resolution] = {}
        self._coverage: Coverage | None = None

    @classmethod
    def made(cls, arguments: Mapping[str, Any], mode: str, dynamic: bool) -> FlexCall:
        """The call of these arguments (as the user made it), normalized."""
        args, empty_aux = normalized(arguments)
        qkv = (args["query"], args["key"], args["value"])
        no_grad = False
        if graph_of(*qkv) == "fwd" and _closes_over_no_tensor(args.get("score_mod")):
            import torch

            if torch.is_grad_enabled() or any(t.requires_grad for t in qkv):
                # A call autograd does not record (grad mode off, or no input requires grad): the same call on
                # detached inputs under no_grad, as the canonical forward-only call is made. Dynamo guards on grad
                # mode and on each input's requires_grad, so this is what lets one warmed entry serve inference, a
                # forward with grad mode on, and reentrant checkpointing's forward (no_grad on inputs that require
                # grad). Not with a score_mod that closes over tensors: they may require grad.
                plain = {id(t): t.detach() for t in qkv}  # one tensor passed twice stays one (alias is keyed)
                args.update(query=plain[id(qkv[0])], key=plain[id(qkv[1])], value=plain[id(qkv[2])])
                no_grad = True
        return cls(args, mode, dynamic, empty_aux=empty_aux, no_grad=no_grad)

    def replaced(self, arguments: dict[str, Any]) -> FlexCall:
        """The same call with other arguments (a warmed mask_mod or score_mod in place of its own)."""
        return FlexCall(arguments, self.mode, self.dynamic, empty_aux=self.empty_aux, no_grad=self.no_grad)

    # ------------------------------------------------------------------------------------------------ keys

    def resolve(self, mode: str | None = None, dynamic: bool | None = None) -> Resolution:
        """:meth:`signature` and what the active manifest says of it, under these options (default: the call's own),
        computed once per option set."""
        options = (self.mode if mode is None else mode, self.dynamic if dynamic is None else dynamic)
        found = self._resolved.get(options)
        if found is None:
            found = self._resolved[options] = resolve_call(options[0], options[1], self.arguments)
        return found

    @property
    def signature(self) -> CallSignature:
        """The call's signature as the active artifact keys it (:func:`resolve_call`)."""
        return self.resolve()[0]

    def coverage(self, active: Activation) -> Coverage:
        """Whether the active artifact covers the call, and the nearest covered signatures where not."""
        if self._coverage is None:
            self._coverage = active.covers(self.signature)
        return self._coverage

    @property
    def lengths(self) -> tuple[int, int]:
        return int(self.arguments["query"].shape[-2]), int(self.arguments["key"].shape[-2])

    # ------------------------------------------------------------------------------------------------ running

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """What the call runs under, and Dynamo's guards are asked under: no_grad for a detached forward-only call."""
        if not self.no_grad:
            return contextlib.nullcontext()
        import torch

        return torch.no_grad()

    def run(self, fn: Callable[..., Any]) -> Any:
        """``fn(**arguments)``, its output as the user's spelling returns it."""
        out = fn(**self.arguments)
        return self.finish(out)

    def finish(self, out: Any) -> Any:
        """An output in the form the user's arguments ask for: ``(out, AuxOutput(None, None))`` for an
        ``AuxRequest`` that asked for nothing."""
        if not self.empty_aux:
            return out
        from torch.nn.attention.flex_attention import AuxOutput

        return out, AuxOutput(lse=None, max_scores=None)


def _closes_over_no_tensor(score_mod: Callable[..., Any] | None) -> bool:
    if score_mod is None:
        return True
    graph = mod_graph(score_mod, "score")
    return graph is not None and not graph.reads_tensors


def frame_call(frame: Mapping[str, Any]) -> FlexCall | None:
    """The call a compiled flex_attention frame makes (the user's own ``torch.compile(flex_attention)``, seen as
    Dynamo compiles it), or None when the frame is not one. Its options are the defaults: the frame does not hold
    the compile's."""
    if not all(n in frame for n in ("query", "key", "value", "block_mask", "score_mod")):
        return None
    arguments, empty_aux = normalized(frame)
    return FlexCall(arguments, "default", False, empty_aux=empty_aux)


def resolve_call(mode: str, dynamic: bool, arguments: Mapping[str, Any]) -> Resolution:
    """The call's signature as the active artifact keys it, and what :meth:`Manifest.resolve` says of it (the entry
    that serves it and the signature that entry was built at), or None where nothing serves it: its mask by every
    value or, where that is not covered, with the values a dynamic config's graph keeps symbolic by type
    (:attr:`BuiltConfig.mask_free`: DFlash's S), when that is covered. One lookup for a served call."""
    active = current().active
    manifest = active.manifest if active is not None else None
    mask_mod = getattr(arguments.get("block_mask"), "mask_mod", None)
    free_sets = manifest.free_sets if manifest is not None and mask_mod is not None else ()
    if manifest is None or not free_sets:
        plain = signature_of(arguments, mode, dynamic)
        return plain, manifest.resolve(plain) if manifest is not None else None
    # every key of a mask not seen before from one walk (a DFlash mask is rebuilt every step); by every value only
    # where some config keys its mask so (an artifact of dynamic configs alone never does)
    by_value = manifest.keys_by_value
    mask_keys(mask_mod, ((), *free_sets) if by_value else free_sets)
    # one signature made; the others differ from it in the mask alone
    base = signature_of(arguments, mode, dynamic, mask=None if by_value else mask_key(mask_mod, free_sets[0]))
    if by_value:
        found = manifest.resolve(base)
        if found is not None:
            return base, found
    near = None
    for free in free_sets:
        key = mask_key(mask_mod, free)
        keyed = base if base.mask == key else dataclasses.replace(base, mask=key)
        found = manifest.resolve(keyed)
        if found is not None:
            return keyed, found
        if near is None and any(c.mask_key == keyed.mask for c in manifest.configs):
            near = keyed  # a config's mask, at lengths it does not cover: a refusal then names only the lengths
    # not served: the mask by every value, unless a config's mask at other lengths says more
    if near is not None:
        return near, None
    return (base if by_value else signature_of(arguments, mode, dynamic)), None
