"""kernelpack._imports: hooks that run when a module finishes importing, and evidence's watches attached that way
(issue 36: install_hooks() no longer imports Dynamo or inductor)."""

from __future__ import annotations

import sys

from conftest import run_json

HOOKS = """
import json, sys
from kernelpack import _imports
seen = []
assert "colorsys" not in sys.modules
_imports.after_import("colorsys", lambda m: seen.append(("later", m.__name__, m.hsv_to_rgb(0, 0, 1))))
import colorsys
import colorsys  # imported once: the hook ran once
_imports.after_import("colorsys", lambda m: seen.append(("now", m.__name__)))
try:
    _imports.after_import("colorsys", lambda m: 1 / 0)  # a module imported already: the caller's error
    raised = None
except ZeroDivisionError as e:
    raised = type(e).__name__
print(json.dumps({"seen": seen, "raised": raised, "loader": type(colorsys.__loader__).__name__,
                  "spec_loader": type(colorsys.__spec__.loader).__name__}))
"""

EVIDENCE = """
import json, sys
import torch
from kernelpack import evidence
assert "torch._dynamo" not in sys.modules and "torch._inductor" not in sys.modules
evidence.install_hooks()
evidence.watch_compiles()
before = {"dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules,
          "detection": evidence.compile_detection}
import torch._inductor.cpp_builder as cpp_builder  # imports Dynamo too
print(json.dumps({"before": before, "detection": evidence.compile_detection,
                  "cpp_watched": hasattr(cpp_builder.CppBuilder.build, "__wrapped__"),  # functools.wraps
                  "per_compile": evidence.per_compile_counts()}))
"""


def test_a_hook_runs_once_when_its_module_is_imported_and_at_once_when_it_is() -> None:
    out = run_json([sys.executable, "-c", HOOKS])
    assert out["seen"] == [["later", "colorsys", [1.0, 1.0, 1.0]], ["now", "colorsys"]], out
    assert out["raised"] == "ZeroDivisionError", out
    assert out["loader"] == out["spec_loader"] == "SourceFileLoader", out  # the wrapper is gone after the import


def test_evidence_watches_dynamo_and_inductor_from_their_import_without_importing_them() -> None:
    out = run_json([sys.executable, "-c", EVIDENCE])
    assert out["before"] == {"dynamo": False, "inductor": False, "detection": "when Dynamo is imported"}, out
    assert out["detection"] == "torch's per-compile metrics" and out["per_compile"] and out["cpp_watched"], out
