"""The build key: every fact about the environment that decides whether a cache entry can hit.

Probing the environment (:func:`probe`) is the only impure step; matching (:func:`differences`) is a pure function of
two keys, tested with made-up environments.
"""

from __future__ import annotations

import dataclasses
import platform
import re
import sys
from dataclasses import dataclass
from urllib.parse import quote, unquote

NONE = "none"
_SAFE_FIELDS = {
    "torch_version": re.compile(r"[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}"),
    "torch_git": re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"),
    "device_type": re.compile(r"[a-z][a-z0-9_]{0,31}"),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class BuildKey:
    torch_version: str
    torch_git: str  # torch.version.git_version: no inductor key contains it, so we check it ourselves
    torch_key: str  # inductor's hash of torch's sources: catches a locally patched torch with the same commit
    cuda: str
    triton: str
    python: str
    platform: str
    device_type: str
    gpu_name: str  # inductor's keys include the GPU *name*: an H200 artifact misses on an H100
    capability: str
    # C++ (CPU) kernel keys contain the absolute -I/-L paths of the torch install; Triton (GPU) keys do not.
    torch_dir: str

    def __post_init__(self) -> None:
        # Parts of these name registry directories and artifact files (tag, store.key_id): a key read from an
        # artifact or a registry entry must not be able to name a path outside them ("../../x", "/abs").
        for name, pattern in _SAFE_FIELDS.items():
            value = getattr(self, name)
            if not isinstance(value, str) or not pattern.fullmatch(value):
                raise ValueError(f"build key {name} {value!r} is not allowed (expected {pattern.pattern})")

    def __str__(self) -> str:
        return ";".join(f"{f.name}={quote(getattr(self, f.name), safe='')}" for f in dataclasses.fields(self))

    @classmethod
    def parse(cls, text: str) -> BuildKey:
        values = {}
        for part in text.split(";"):
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"not a build key: {text!r}")
            values[name] = unquote(value)
        return cls(**values)

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, str]) -> BuildKey:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - d.keys()
        if missing:
            raise ValueError(f"build key lacks {sorted(missing)}")
        return cls(**{k: str(d[k]) for k in names})

    @property
    def tag(self) -> str:
        """``torch<version>-<commit12>[-cu<XYZ>]-<gpu-or-cpu>``, the variable part of an artifact's file name.

        One torch release ships builds for several CUDA versions (2.14: cu128, cu130; 2.15: cu130, cu132) from one
        commit; their kernels and keys differ, so the CUDA version is in the name (``cu130``), as in the wheel's local
        version. A CPU build of torch has none."""
        version = self.torch_version.split("+")[0]
        cuda = f"-{cuda_tag(self.cuda)}" if self.cuda != NONE else ""
        return f"torch{version}-{self.torch_git[:12]}{cuda}-{device_slug(self)}"


def cuda_tag(cuda: str) -> str:
    """``torch.version.cuda`` as the wheels name it: "13.0" -> "cu130", "12.8" -> "cu128"."""
    return "cu" + re.sub(r"[^0-9]", "", cuda)


def device_slug(key: BuildKey) -> str:
    if key.device_type != "cuda":
        return key.device_type
    name = re.sub(r"^nvidia\s+", "", key.gpu_name.lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cuda"


def differences(built: BuildKey, here: BuildKey, *, every_field: bool = False) -> list[tuple[str, str, str]]:
    """(field, artifact value, value here) for every field that would make the artifact miss here.

    ``every_field`` also compares the fields that cannot cause a miss (merging needs identical builders)."""
    diffs = []
    for f in dataclasses.fields(BuildKey):
        if f.name == "torch_dir" and built.device_type != "cpu" and not every_field:
            continue  # Triton kernels carry no install paths
        a, b = getattr(built, f.name), getattr(here, f.name)
        if a != b:
            diffs.append((f.name, a, b))
    return diffs


def probe(device_type: str, device_index: int = 0, *, expected_torch_key: str | None = None) -> BuildKey:
    """The build key of this process for ``device_type`` ("cuda" or "cpu"). Imports torch; CUDA is initialized.
    ``expected_torch_key`` (the artifact's): a torch_key that differs from it is inductor's own, not kernelpack's
    reading of torch's sources (:func:`kernelpack._torch.inductor.torch_key`)."""
    import os

    import torch

    from ._torch.inductor import torch_key

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = NONE
    gpu_name = capability = NONE
    # no CUDA here (CPU-only torch, no device): "none", so that a GPU artifact is refused field by field
    if device_type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device_index)
        gpu_name = props.name
        capability = f"{props.major}.{props.minor}"
    return BuildKey(
        torch_version=torch.__version__,
        torch_git=torch.version.git_version or NONE,
        torch_key=torch_key(expected_torch_key),
        cuda=torch.version.cuda or NONE,
        triton=triton_version,
        python=f"{sys.version_info.major}.{sys.version_info.minor}",
        platform=f"{sys.platform}-{platform.machine()}",
        device_type=device_type,
        gpu_name=gpu_name,
        capability=capability,
        torch_dir=os.path.dirname(torch.__file__) if device_type == "cpu" else NONE,
    )
