"""Every error kernelpack raises on purpose.

Each carries the facts a user needs (file, field, value, what was expected) and a ``hint``; the CLI prints
``error: <message>`` and ``hint: <hint>`` and exits non-zero. Subclasses also inherit the matching stdlib type
so callers can catch them the usual way.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any


def printable(text: str) -> str:
    """``text`` with control characters escaped (newlines kept): names from an artifact or a registry are data, and
    a terminal escape in them must not reach the terminal raw."""
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in text)


class KernelpackError(Exception):
    """Base class. ``hint`` says what to do about it."""

    hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if hint is not None:
            self.hint = hint

    def __str__(self) -> str:
        # the hint travels with the error wherever it is printed: a traceback, a log line, Dynamo re-raising it
        return f"{self.message}\nhint: {self.hint}" if self.hint else self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # its state, not its constructor's arguments (each subclass takes others): an error crosses from the
        # install's child process to the job (installer._extract_in_child) as it was raised
        return (_rebuilt, (type(self), self.args, dict(self.__dict__)))


def _rebuilt(cls: type[KernelpackError], args: tuple[Any, ...], state: dict[str, Any]) -> KernelpackError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class KernelpackWarning(UserWarning):
    """Something will work, but not as well as it could (e.g. an artifact installed despite a key mismatch)."""


class TorchUnsupportedError(KernelpackError, RuntimeError):
    """This torch lacks (or changed) something kernelpack relies on: names the torch version, what is missing and
    the versions kernelpack supports, instead of an AttributeError from deep inside a call."""

    def __init__(self, torch_version: str, what: str, supported: str) -> None:
        self.torch_version, self.what, self.supported = torch_version, what, supported
        super().__init__(
            f"torch {torch_version} is not supported by this kernelpack: {what}",
            hint=f"kernelpack supports torch {supported}: install one of those, or upgrade kernelpack",
        )


class SettingError(KernelpackError, ValueError):
    """An environment variable kernelpack reads has a value it cannot use."""

    def __init__(self, variable: str, value: str, expected: str, *, hint: str | None = None) -> None:
        self.variable, self.value, self.expected = variable, value, expected
        super().__init__(
            f"{variable}={value!r} is not {expected}",
            hint=hint or f"set {variable} to {expected}, or unset it to use the default",
        )


class LockTimeoutError(KernelpackError, TimeoutError):
    """Another process held a file lock for longer than we were willing to wait."""

    def __init__(self, lock: str, what: str, seconds: float) -> None:
        self.lock, self.what, self.seconds = lock, what, seconds
        super().__init__(
            f"waited {seconds:.0f} s for the {what} lock {lock}; another process still holds it",
            hint="find the process holding it (a stuck job on this node?), or raise KERNELPACK_LOCK_TIMEOUT (seconds)",
        )


class RecipeError(KernelpackError, ValueError):
    """A recipe file is malformed: names the file, the key, the bad value and what is allowed."""

    def __init__(
        self,
        path: str,
        key: str,
        message: str,
        *,
        value: object = None,
        allowed: Sequence[object] | str | None = None,
        hint: str | None = None,
        typo: str | None = None,
    ) -> None:
        """``typo``: the word to match against ``allowed`` for a "did you mean" (an unknown key's name); by default
        ``value`` when it is a string."""
        self.path, self.key, self.value, self.allowed = path, key, value, allowed
        guess = did_you_mean(typo if typo is not None else value, allowed)
        super().__init__(
            f"{path}: {key}: {_describe_problem(message, value, allowed)}",
            hint=(f"did you mean {guess!r}? " if guess else "")
            + (hint or "fix the recipe; the README's 'Recipe format' section lists every key"),
        )


def did_you_mean(word: object, allowed: Sequence[object] | str | None) -> str | None:
    """The allowed string closest to a mistyped ``word`` (difflib's ratio of at least 0.6), or None."""
    if not isinstance(word, str) or not word or allowed is None or isinstance(allowed, str):
        return None
    choices = [a for a in allowed if isinstance(a, str) and a != word]
    matches = difflib.get_close_matches(word, choices, n=1)
    return matches[0] if matches else None


class ConfigError(KernelpackError, ValueError):
    """A config (a recipe point) has a field value kernelpack cannot build: names the field, value and what is allowed.

    The recipe reader re-raises it as a :class:`RecipeError` naming the recipe key, the manifest reader as an
    :class:`ArtifactError` naming the config."""

    def __init__(
        self, field: str, message: str, *, value: object = None, allowed: Sequence[object] | str | None = None
    ) -> None:
        self.field, self.reason, self.value, self.allowed = field, message, value, allowed
        super().__init__(f"{field}: {_describe_problem(message, value, allowed)}")


def _describe_problem(message: str, value: object, allowed: Sequence[object] | str | None) -> str:
    text = message
    if value is not None:
        text += f" (got {value!r})"
    if allowed is not None:
        text += f"; allowed: {allowed if isinstance(allowed, str) else ', '.join(map(repr, allowed))}"
    return text


class ArtifactError(KernelpackError, ValueError):
    """The artifact is corrupt, truncated, tampered with or unsafe. Nothing was installed."""

    def __init__(self, artifact: str, message: str, *, member: str | None = None) -> None:
        self.artifact, self.member = artifact, member
        where = f" (member {member!r})" if member else ""
        super().__init__(
            f"{artifact}: {message}{where}",
            hint="the artifact is not usable: download or rebuild it",
        )


class ArtifactNotFoundError(KernelpackError, FileNotFoundError):
    def __init__(self, artifact: str) -> None:
        self.artifact = artifact
        super().__init__(f"artifact not found: {artifact}", hint="check the path (kernelpack build -o DIR writes it)")


class KeyMismatchError(KernelpackError):
    """The artifact was built for another torch/triton/CUDA/GPU: installing it would not hit."""

    def __init__(self, artifact: str, differences: Sequence[tuple[str, str, str]]) -> None:
        self.artifact, self.differences = artifact, list(differences)
        lines = [f"{artifact} was built for another environment; it would not hit here:"]
        lines += [f"  {field}: artifact {built!r} != here {here!r}" for field, built, here in differences]
        super().__init__(
            "\n".join(lines),
            hint="build the artifact with this exact torch build (kernelpack build), or install it anyway, expecting "
            "misses: kernelpack install --allow-mismatch, or activate(..., allow_mismatch=True) in Python",
        )


class BuildError(KernelpackError, RuntimeError):
    """One or more configs failed to compile or to match the reference."""

    def __init__(self, message: str, *, failed: Sequence[str] = (), hint: str | None = None) -> None:
        self.failed = list(failed)
        super().__init__(message, hint=hint or "fix or drop the failing configs, or pass --keep-going to ship the rest")


class VerifyError(KernelpackError, RuntimeError):
    """The artifact does not make the recipe's first calls compile nothing."""

    def __init__(self, message: str, *, failed: Sequence[str] = (), report: Any = None) -> None:
        self.failed = list(failed)
        self.report = report  # the records.VerifyReport, when the fresh process ran to its end
        super().__init__(
            message,
            hint="rebuild the artifact with this torch build; kernelpack verify --json ARTIFACT prints every "
            "config's counters",
        )


class InstallError(KernelpackError, OSError):
    """The target cache directory could not be written. Nothing half-written was left."""

    def __init__(self, target: str, message: str, *, hint: str | None = None) -> None:
        self.target = target
        super().__init__(f"{target}: {message}", hint=hint or "check permissions and free space of the cache directory")


# A call whose nearest covered signature differs only in the device index (pytorch#170123): strict and non-strict
# refusals give this fix
DEVICE_HINT = (
    "this config is built, but for other device indices (inductor's cache keys contain cuda:N): pin each worker's GPU "
    "as cuda:0 with kernelpack.runtime.pin_local_gpu() before CUDA initializes, or build with --devices covering this "
    "one"
)


class NotPrecompiledError(KernelpackError, RuntimeError):
    """Strict mode: this call's config/device is not covered by the active artifact, so it would cold-compile."""

    def __init__(
        self,
        call: str,
        nearest: Sequence[str],
        *,
        artifact: str | None,
        only: tuple[str, object, object] | None = None,
        detail: str = "",
        hint: str | None = None,
    ) -> None:
        """``only``: (field, covered value, call's value) when the nearest covered signature differs in one field;
        ``detail``: more lines (which of the mask's values differ); ``hint``: the fix, when the caller knows it
        better (a length outside the covered range)."""
        self.call, self.nearest, self.artifact = call, list(nearest), artifact
        lines = [f"flex_attention call not precompiled by {artifact or 'any active artifact'}: {call}"]
        if nearest:  # the one field that differs needs one line, not every covered config
            lines.append("nearest covered config:" if only is not None else "nearest covered configs:")
            lines += [f"  {n}" for n in (nearest[:1] if only is not None else nearest)]
        if detail:
            lines.append(detail.strip("\n"))
        fix = (
            "add this shape to the recipe and rebuild; or activate(strict=False, warmup=False) to compile it here "
            "(slow, logged; only where no other thread runs backward meanwhile)"
        )
        field, _covered, value = only if only is not None else (None, None, None)
        if field == "device_index":
            fix = DEVICE_HINT
        elif field == "graph" and value == "fwd":
            fix = (
                "this config is built for the training graph only, and this is a forward-only call (no_grad, or "
                "inputs that do not require grad: reentrant gradient checkpointing runs its forward so): add the "
                'forward graph to the recipe, graphs = ["fwd", "fwd+bwd"], or use checkpoint(..., use_reentrant=False)'
            )
        elif field == "graph":
            fix = 'this config is built forward-only: add the training graph, graphs = ["fwd", "fwd+bwd"]'
        super().__init__("\n".join(lines), hint=hint or fix)


class NotWarmedError(KernelpackError, RuntimeError):
    """After ``activate()`` warmed the artifact, a call that Dynamo would trace: refused, in strict and non-strict
    mode. A trace during training runs make_fx (and ``torch.autograd.grad`` for a training graph) with torch.fx's
    process-global tracing flag set: it deadlocks against the autograd engine when another thread is in a backward
    that calls flex (gradient checkpointing), and it breaks other threads' compiled calls."""

    def __init__(self, call: str, reason: str, *, hint: str) -> None:
        self.call, self.reason = call, reason
        super().__init__(f"flex_attention call would be compiled during training: {call}\n{reason}", hint=hint)


class RegistryError(KernelpackError, OSError):
    """A registry could not be read or written: names the registry URL and the operation."""

    def __init__(self, registry: str, message: str, *, hint: str | None = None) -> None:
        self.registry = registry
        super().__init__(
            f"{registry}: {message}",
            hint=hint or "check the registry URL, the bucket and the credentials (fsspec options/environment)",
        )


class NoMatchingArtifactError(KernelpackError, LookupError):
    """No artifact in the registry was built for this environment; says why for every candidate."""

    def __init__(self, registry: str, recipe: str, reasons: list[str], known: Sequence[str] = ()) -> None:
        self.reasons = reasons
        lines = [f"{registry}: no artifact of recipe {recipe!r} was built for this environment"]
        shown = ", ".join(map(repr, sorted(known)[:10])) or "none"
        lines += [f"  {r}" for r in reasons] or [f"  (no artifact of this recipe; the registry's recipes: {shown})"]
        guess = None if reasons else did_you_mean(recipe, sorted(known))
        super().__init__(
            "\n".join(lines),
            hint=(f"did you mean {guess!r}? " if guess else "")
            + "build and push one with this exact torch build (kernelpack build + kernelpack push)",
        )


class LockMismatchError(KernelpackError):
    """The registry's artifact is not the one a lock file pins."""


class DenseFallbackError(KernelpackError, RuntimeError):
    """flex_attention was about to run its dense math path (uncompiled): refused instead of OOMing or crawling."""

    def __init__(self, message: str, *, score_bytes: int) -> None:
        self.score_bytes = score_bytes
        super().__init__(
            message,
            hint="call kernelpack.flex_attention (compiled), never torch's flex_attention eagerly; see README "
            "'How to make your model hit the artifact'",
        )


class RecordError(KernelpackError):
    """Recording found calls it cannot write as a recipe, or none at all (:mod:`kernelpack.record`)."""


class NotRebuildable(KernelpackError):
    """A function that cannot be named by reference (:mod:`kernelpack.closures`): why, and what to write instead."""
