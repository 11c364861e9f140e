from __future__ import annotations

import dataclasses

import pytest

from kernelpack.keys import BuildKey, differences, probe

H200 = BuildKey(
    torch_version="2.11.0+cu130",
    torch_git="70d99e998b49aaaa",
    torch_key="ab" * 32,
    cuda="13.0",
    triton="3.6.0",
    python="3.12",
    platform="linux-x86_64",
    device_type="cuda",
    gpu_name="NVIDIA H200",
    capability="9.0",
    torch_dir="none",
)


def test_str_parse_round_trip_with_awkward_values() -> None:
    key = dataclasses.replace(H200, gpu_name="NVIDIA H100 80GB HBM3; x=y", torch_dir="/a b/c")
    assert BuildKey.parse(str(key)) == key
    assert BuildKey.from_dict(key.to_dict()) == key
    with pytest.raises(ValueError):
        BuildKey.parse("garbage")


def test_identical_environments_match() -> None:
    assert differences(H200, dataclasses.replace(H200)) == []


@pytest.mark.parametrize(
    "field, here",
    [
        ("gpu_name", "NVIDIA H100 80GB HBM3"),
        ("torch_git", "cf30153c4c13"),
        ("torch_key", "cd" * 32),  # locally patched torch with the same commit
        ("triton", "3.5.1"),
        ("cuda", "12.8"),
        ("python", "3.11"),
    ],
)
def test_each_field_that_changes_keys_is_reported(field: str, here: str) -> None:
    other = dataclasses.replace(H200, **{field: here})
    assert differences(H200, other) == [(field, getattr(H200, field), here)]


def test_install_path_matters_on_cpu_only() -> None:
    assert differences(H200, dataclasses.replace(H200, torch_dir="/elsewhere")) == []
    cpu = dataclasses.replace(
        H200, device_type="cpu", gpu_name="none", capability="none", cuda="none", torch_dir="/venv/a"
    )
    assert differences(cpu, dataclasses.replace(cpu, torch_dir="/venv/b")) == [("torch_dir", "/venv/a", "/venv/b")]


def test_tag() -> None:
    """The CUDA version is in the name: one torch release's builds for CUDA 12.8, 13.0, 13.2 share a commit."""
    assert H200.tag == "torch2.11.0-70d99e998b49-cu130-h200"
    assert (
        dataclasses.replace(H200, cuda="12.8", torch_version="2.11.0+cu128").tag
        == "torch2.11.0-70d99e998b49-cu128-h200"
    )
    cpu = dataclasses.replace(H200, device_type="cpu", torch_version="2.13.0+cpu", cuda="none")
    assert cpu.tag == "torch2.13.0-70d99e998b49-cpu"
    # a CUDA wheel running on the CPU (torch 2.14 and 2.15 from PyPI): its CPU artifacts are another build too
    assert dataclasses.replace(cpu, cuda="13.2", torch_version="2.15.0").tag == "torch2.15.0-70d99e998b49-cu132-cpu"


def test_probe_here_is_cpu_and_matches_itself() -> None:
    import torch

    key = probe("cpu")
    assert key.torch_git == torch.version.git_version and key.device_type == "cpu"
    assert differences(key, probe("cpu")) == []
