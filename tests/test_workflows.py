"""The workflows agree with the repository: the test command and torch pin of .ci/run, the shard count, the torch
builds of each stage, pinned actions. (Syntax and security are .ci/lint's job: actionlint and zizmor.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def run_lines(job: dict[str, Any]) -> list[str]:
    return [line.strip() for step in job["steps"] for line in step.get("run", "").splitlines() if line.strip()]


def test_ci_runs_what_ci_run_runs() -> None:
    ci = load("ci.yml")
    local = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    tests = run_lines(ci["jobs"]["test"])
    pytest_lines = [line for line in tests if "pytest" in line]
    assert pytest_lines and all(line in local for line in pytest_lines), (pytest_lines, "not in .ci/run")
    assert "bash .ci/lint" in run_lines(ci["jobs"]["lint"]) and "bash .ci/lint" in local
    pin = ci["env"]["TORCH_SPEC"]
    assert any(f'"{pin}"' in line for line in local), f"{pin} is not the torch .ci/run installs"
    assert ci["jobs"]["test"]["strategy"]["matrix"]["python"] == ["3.10", "3.11", "3.12"]


def test_build_kernels_stages_agree() -> None:
    wf = load("build-kernels.yml")
    build, publish = wf["jobs"]["build"], wf["jobs"]["publish"]
    shards = build["strategy"]["matrix"]["shard"]
    assert shards == list(range(1, int(wf["env"]["SHARDS"]) + 1))
    assert f"/{len(shards)}" in build["name"]
    assert build["strategy"]["matrix"]["torch"] == publish["strategy"]["matrix"]["torch"]
    assert wf["jobs"]["lock"]["needs"] == "publish" and publish["needs"] == "build"
    # secrets only reach the steps that talk to the registry, never the build or a whole job's env
    for name, job in wf["jobs"].items():
        assert "secrets." not in str(job.get("env", {})), name
        for step in job["steps"]:
            if "secrets." in str(step):
                assert "kernelpack push" in step.get("run", "") or "kernelpack lock" in step.get("run", ""), step


def test_every_action_is_pinned_by_commit_with_its_version() -> None:
    for path in sorted(WORKFLOWS.glob("*.yml")):
        for line in path.read_text().splitlines():
            if "uses:" in line:
                assert re.search(r"uses: [\w.-]+/[\w.-]+@[0-9a-f]{40} # v\d+(\.\d+)*$", line), f"{path.name}: {line}"
