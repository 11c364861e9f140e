"""kernelpack._imports: hooks that run when a module finishes importing, and evidence's watches attached that way
(install_hooks() no longer imports Dynamo or inductor)."""

from __future__ import annotations

import sys
from pathlib import Path

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


# Two modules that import each other, as torch._dynamo and torch._inductor do through many modules, and that import
# fine in one thread (cyc.a defines A before it imports cyc.b). One thread imports cyc.a, which reaches cyc.b after a
# pause; meanwhile another imports cyc.b, which needs cyc.a. Each holds one module's import lock and waits for the
# other's; Python breaks the cycle by handing one of them a partly initialized module: "cannot import name ... from
# partially initialized module".
CYCLE = {
    "cyc/__init__.py": "",
    "cyc/a.py": "import time\nA = 1\ntime.sleep(0.5)\nfrom cyc.b import B\n",
    "cyc/b.py": "from cyc.a import A\nB = 2\n",
}
ALONE = """
import json, sys, threading, time
sys.path.insert(0, sys.argv[1])
from kernelpack import _imports
gated = sys.argv[2] == "gated"
result = {}
started = threading.Event()

def background():
    import contextlib
    with (_imports.importing_alone(("cyc",)) if gated else contextlib.nullcontext()):
        started.set()
        try:
            import cyc.a
            result["background"] = cyc.a.A + 0 * cyc.a.B
        except ImportError as e:
            result["background"] = str(e)

t = threading.Thread(target=background)
t.start()
started.wait()
time.sleep(0.2)  # the background thread is inside cyc.a now
begin = time.perf_counter()
try:
    from cyc.b import B
    result["main"] = B
except ImportError as e:
    result["main"] = str(e)
result["main_waited"] = time.perf_counter() - begin
t.join()
late = {}
# a thread the importing thread starts (and one that thread starts) is not held: the importing thread may wait for it
with _imports.importing_alone(("colorsys", "sched")) as outer:
    def later(name):
        begin = time.perf_counter()
        __import__(name)
        late[name] = time.perf_counter() - begin
    def helper():
        grandchild = threading.Thread(target=later, args=("sched",))
        grandchild.start()
        grandchild.join()
        later("colorsys")
    th = threading.Thread(target=helper)
    th.start()
    th.join()
    with _imports.importing_alone(("x",)) as inner:
        late["nested"] = inner is None
import builtins, importlib
late["restored"] = (builtins.__import__ is _imports._original_import
                    and importlib.import_module is _imports._original_import_module
                    and threading.Thread.start is _imports._original_start)
print(json.dumps({"result": result, "late": late}))
"""


def _package(tmp_path: Path) -> Path:
    for rel, text in CYCLE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_without_the_gate_two_threads_importing_a_cycle_get_a_partial_module(tmp_path: Path) -> None:
    """What the gate is for, reproduced: the failure of a background start's inductor import beside the job's."""
    out = run_json([sys.executable, "-c", ALONE, str(_package(tmp_path)), "plain"])
    errors = [v for v in out["result"].values() if isinstance(v, str)]
    assert errors and "partially initialized module" in errors[0], out


def test_importing_alone_holds_the_other_threads_before_they_import_and_no_thread_it_starts(tmp_path: Path) -> None:
    out = run_json([sys.executable, "-c", ALONE, str(_package(tmp_path)), "gated"])
    assert out["result"]["background"] == 1 and out["result"]["main"] == 2, out
    assert out["result"]["main_waited"] > 0.2, out  # it waited for cyc.a's import, which sleeps 0.5 s
    assert out["late"]["colorsys"] < 0.2 and out["late"]["sched"] < 0.2, out
    assert out["late"]["nested"] and out["late"]["restored"], out
