"""Every error kernelpack raises on purpose.

Each carries the facts a user needs (file, field, value, what was expected) and a ``hint``; the CLI prints
``error: <message>`` and ``hint: <hint>`` and exits non-zero. Subclasses also inherit the matching stdlib type
so callers can catch them the usual way.
"""

from __future__ import annotations

from collections.abc import Sequence


class KernelpackError(Exception):
    """Base class. ``hint`` says what to do about it."""

    hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint


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
    ) -> None:
        self.path, self.key, self.value, self.allowed = path, key, value, allowed
        text = f"{path}: {key}: {message}"
        if value is not None:
            text += f" (got {value!r})"
        if allowed is not None:
            allowed_text = allowed if isinstance(allowed, str) else ", ".join(map(repr, allowed))
            text += f"; allowed: {allowed_text}"
        super().__init__(text, hint="fix the recipe; the README's 'Recipe format' section lists every key")


class ArtifactError(KernelpackError, ValueError):
    """The artifact is corrupt, truncated, tampered with or unsafe. Nothing was installed."""

    def __init__(self, artifact: str, message: str, *, member: str | None = None) -> None:
        self.artifact, self.member = artifact, member
        where = f" (member {member!r})" if member else ""
        super().__init__(
            f"{artifact}: {message}{where}",
            hint="the artifact is not usable: download or rebuild it; the target cache was left untouched",
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
            hint="build the artifact with this exact torch build (kernelpack build), "
            "or pass --allow-mismatch to install it anyway",
        )


class BuildError(KernelpackError, RuntimeError):
    """One or more configs failed to compile or to match the reference."""

    def __init__(self, message: str, *, failed: Sequence[str] = ()) -> None:
        self.failed = list(failed)
        super().__init__(message, hint="fix or drop the failing configs, or pass --keep-going to ship the rest")


class VerifyError(KernelpackError, RuntimeError):
    """The artifact does not make the recipe's first calls compile nothing."""

    def __init__(self, message: str, *, failed: Sequence[str] = ()) -> None:
        self.failed = list(failed)
        super().__init__(
            message,
            hint="rebuild the artifact with this torch build; run with -v for the per-config counters",
        )


class InstallError(KernelpackError, OSError):
    """The target cache directory could not be written. Nothing half-written was left."""

    def __init__(self, target: str, message: str) -> None:
        self.target = target
        super().__init__(f"{target}: {message}", hint="check permissions and free space of the cache directory")


class NotPrecompiledError(KernelpackError, RuntimeError):
    """Strict mode: this call's config/device is not covered by the active artifact, so it would cold-compile."""

    def __init__(self, call: str, nearest: Sequence[str], *, artifact: str | None, device_only: bool = False) -> None:
        self.call, self.nearest, self.artifact = call, list(nearest), artifact
        lines = [f"flex_attention call not precompiled by {artifact or 'any active artifact'}: {call}"]
        if nearest:
            lines.append("nearest covered configs:")
            lines += [f"  {n}" for n in nearest]
        hint = "add this shape to the recipe and rebuild; or activate(strict=False) to compile it here (slow, logged)"
        if device_only:
            hint = (
                "this config is built, but for other device indices (inductor's cache keys contain cuda:N): pin each "
                "worker's GPU as cuda:0 with kernelpack.runtime.pin_local_gpu() before CUDA initializes, or build "
                "with --devices covering this one"
            )
        super().__init__("\n".join(lines), hint=hint)


class DenseFallbackError(KernelpackError, RuntimeError):
    """flex_attention was about to run its dense math path (uncompiled): refused instead of OOMing or crawling."""

    def __init__(self, message: str, *, score_bytes: int) -> None:
        self.score_bytes = score_bytes
        super().__init__(
            message,
            hint="call kernelpack.flex_attention (compiled), never torch's flex_attention eagerly; see README "
            "'How to make your model hit the artifact'",
        )
