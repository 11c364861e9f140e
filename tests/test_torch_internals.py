"""torch's internals live in one place: no private torch or Triton name appears in kernelpack/ outside
kernelpack/_torch/, in code, comments or docstrings; docs/torch-compat.md lists every function of kernelpack/_torch/
with the torch versions CI runs it on; and each of those functions works on the torch this suite runs on."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import sys
from pathlib import Path

import pytest
from conftest import run_json

from kernelpack.precompiled import unavailable as precompiled_unavailable

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kernelpack"
INTERNALS = PACKAGE / "_torch"
COMPAT = ROOT / "docs" / "torch-compat.md"

# A dotted torch/triton path with a private segment (torch._dynamo, torch.fx._symbolic_trace; not __version__), the
# same as a source path (torch/_inductor/codecache.py), Triton's internals, and the private names kernelpack reaches
# that carry no underscore of their own or sit on objects (guard managers, aot-compiled functions, the flex HOP).
PATTERNS = [
    re.compile(r"\b(?:torch|triton)(?:\.[A-Za-z]\w*)*\.(?!__)_\w+"),
    re.compile(r"\btorch/(?:\w+/)*_\w+"),
    re.compile(r"\btriton\.(?:knobs|backends|runtime|compiler)\b"),
    re.compile(
        r"\b(?:_symbolic_trace|_is_fx_tracing\w*|_get_is_fx_tracing|CURRENT_PATCHER|_Patcher|_artifacts|guard_manager"
        r"|check_verbose|verbose_code_parts|prepare_f_locals|disable_guard_check|guard_check|guards_state"
        r"|load_guard_manager|GlobalStateGuard|global_state_guard|py_kernels|_dispatch_cache|CompilationMetrics"
        r"|callback_handler|start_callbacks|on_compile_start|get_metrics_context|get_runtime_metrics_context"
        r"|cpp_builder|CppBuilder|_preprocessing|save_config_portable|_current_graph_task_id|cache_entry_list"
        r"|_TorchCompileInductorWrapper|TracingContext|FakeTensorMode|FakeTensor|FlexAttentionHOP|sdpa_dense"
        r"|FxGraphHashDetails|codecache|cache_dir_utils|use_duck_shape|specialize_float|enable_aot_compile"
        r"|recompile_limit|accumulated_recompile_limit|convert_frame|save_compiled_function|_convert_mask_to_block_mask"
        r"|_create_sparse_block_from_block_mask|_compile=True|_is_functional_tensor|CUDABackend|add_stages)\b"
    ),
]


def private_names(text: str) -> list[str]:
    """``line: name`` for each private torch name in a file's text."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in PATTERNS:
            found += [f"{number}: {m.group(0)}" for m in pattern.finditer(line)]
    return found


def private_imports(text: str) -> list[str]:
    """Imports of private names from torch or triton (``from torch.nn.attention.flex_attention import _x``)."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "triton"):
            found += [f"{node.lineno}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return found


def outside_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if INTERNALS not in p.parents)


def test_no_private_torch_name_outside_the_internals_package() -> None:
    offenders = {
        str(p.relative_to(ROOT)): names
        for p in outside_files()
        if (names := private_names(p.read_text()) + private_imports(p.read_text()))
    }
    assert offenders == {}, "move these into kernelpack/_torch/ (one module per area) and call them from there"


def test_the_check_finds_what_it_looks_for() -> None:
    """The checker itself, on what kernelpack had before the package existed."""
    before = (
        "from torch.fx import _symbolic_trace\n"
        "    if not _symbolic_trace._is_fx_tracing_flag:\n"
        "# a recorded entry Dynamo no longer has (torch._dynamo.reset()) would not serve the call\n"
        "    inputs (torch/_inductor/codecache.py ``FxGraphHashDetails``)\n"
        "        return e.guard_manager.check(f_locals)\n"
        "        knobs.compilation.listener = listener  # triton.knobs\n"
    )
    assert sorted({n.split(": ", 1)[0] for n in private_names(before)}) == ["1", "2", "3", "4", "5", "6"]
    assert private_imports("from torch.nn.attention.flex_attention import _convert_mask_to_block_mask, create_mask\n")
    assert not private_names("import torch\nprint(torch.__version__, torch.nn.attention.flex_attention.BlockMask)\n")
    assert not private_imports("from torch.nn.attention.flex_attention import BlockMask, create_block_mask\n")


# ------------------------------------------------------------------------------------------------ the compat table


def internals_functions() -> dict[str, object]:
    """Every public function (and class) of kernelpack/_torch/, by ``module.name``."""
    found: dict[str, object] = {}
    for path in sorted(INTERNALS.glob("*.py")):
        if path.stem == "__init__":
            continue
        module = importlib.import_module(f"kernelpack._torch.{path.stem}")
        for name, obj in vars(module).items():
            if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)):
                if obj.__module__ == module.__name__:
                    found[f"{path.stem}.{name}"] = obj
    return found


def compat_rows() -> dict[str, list[str]]:
    """docs/torch-compat.md's entry-point table: ``module.name`` -> the versions CI runs it on."""
    rows = {}
    for line in COMPAT.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and (m := re.fullmatch(r"`(\w+\.\w+)`", cells[0])):
            rows[m.group(1)] = re.findall(r"\d+\.\d+", cells[1])
    return rows


def ci_versions() -> list[str]:
    """The torch releases .ci/run runs tests on, as "2.13"."""
    text = (ROOT / ".ci" / "run").read_text()
    return sorted({m for m in re.findall(r"torch==(\d+\.\d+)", text)}, key=lambda v: tuple(map(int, v.split("."))))


def test_every_entry_point_is_in_the_compat_table_with_the_versions_ci_runs() -> None:
    rows = compat_rows()
    assert sorted(rows) == sorted(internals_functions()), "docs/torch-compat.md lists exactly kernelpack/_torch's API"
    versions = ci_versions()
    assert len(versions) >= 4, versions  # 2.11, 2.13, 2.14, 2.15
    for name, listed in rows.items():
        assert listed and set(listed) <= set(versions), (name, listed, versions)


def test_every_entry_point_says_which_torch_versions_it_serves() -> None:
    vague = [name for name, obj in internals_functions().items() if not re.search(r"torch \d+\.\d+", obj.__doc__ or "")]
    # exceptions and the error helpers carry no version of their own
    assert [n for n in vague if not n.endswith(("NoInternals", "CompileFacts"))] == []


def test_the_floor_pyproject_declares_is_the_oldest_torch_ci_runs() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=(\d+\.\d+)', text)
    assert floor is not None and floor.group(1) == ci_versions()[0]


# ------------------------------------------------------------------------------------------------ on this torch


def test_the_fx_state_is_read_without_error_and_follows_a_trace_in_another_thread() -> None:
    """What the first-call gate waits for, on the torch this suite runs: idle, nothing; while another thread is
    inside ``torch.fx.symbolic_trace``, something (the flag on <= 2.13, the patcher on every release)."""
    import threading

    import torch

    from kernelpack._torch import fx

    assert fx.foreign_trace() is False
    entered, release = threading.Event(), threading.Event()

    def traced(x: torch.Tensor) -> torch.Tensor:
        entered.set()
        release.wait(30)
        return x + 1

    tracer = threading.Thread(target=lambda: torch.fx.symbolic_trace(traced))
    tracer.start()
    try:
        assert entered.wait(30)
        assert fx.foreign_trace() is True
    finally:
        release.set()
        tracer.join(30)
    assert fx.foreign_trace() is False
    thread_local = fx.tracing_state_is_thread_local()
    assert thread_local == (not hasattr(sys.modules["torch.fx._symbolic_trace"], "_is_fx_tracing_flag"))


def test_make_fx_in_another_thread_is_waited_for_only_where_its_flag_is_process_global() -> None:
    """make_fx patches nn.Module's attributes, not math.*: on torch >= 2.14 it no longer reaches other threads'
    compiled calls (docs/BENCHMARKS.md, 0 errors in 2,366 calls), on <= 2.13 its process-global flag does."""
    import threading

    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from kernelpack._torch import fx

    entered, release = threading.Event(), threading.Event()

    def traced(x: torch.Tensor) -> torch.Tensor:
        entered.set()
        release.wait(30)
        return x + 1

    tracer = threading.Thread(target=lambda: make_fx(traced)(torch.zeros(2)))
    tracer.start()
    try:
        assert entered.wait(30)
        assert fx.foreign_trace() is (not fx.tracing_state_is_thread_local())
    finally:
        release.set()
        tracer.join(30)


def test_a_torch_without_what_kernelpack_needs_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch that moved a name again gets a refusal naming the version and what is missing, not an AttributeError."""
    import torch.fx._symbolic_trace as st

    from kernelpack._torch import fx
    from kernelpack.errors import TorchUnsupportedError

    for name in ("_is_fx_tracing_flag", "_get_is_fx_tracing"):
        monkeypatch.delattr(st, name, raising=False)
    with pytest.raises(TorchUnsupportedError) as e:
        fx.foreign_trace()
    import torch

    assert torch.__version__ in str(e.value) and "2.11 through 2.15" in str(e.value)


def test_a_marked_trace_keeps_exactly_the_marks_symbolic_and_leaves_no_mark_behind() -> None:
    """One graph for every kv length and context (the marked dimension and closure int), a new one for another head
    count (not marked: static, as in torch's automatic-dynamic graph); the tensors carry no mark afterwards, so that
    eager flex_attention's own compile of the same tensors still passes its guards (torch 2.13 checks the flag).
    In a fresh process: after this file's FX-tracing threads, torch 2.11's Dynamo segfaults in FakeTensorMode."""
    out = run_json([sys.executable, __file__, "marked_trace"])
    assert out["left"] == [], "a mark was left on a tensor"
    assert out["entries"] == 2, out  # the three contexts at 2 heads: one entry; 4 heads: another


def _marked_trace() -> dict[str, object]:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from kernelpack._torch.dynamo import cache_entries, marked_trace

    def mask_for(context: int):  # type: ignore[no-untyped-def]
        def mask(b, h, q, kv):  # type: ignore[no-untyped-def]
            return (kv < context) | (q >= kv - context)

        return mask

    compiled = torch.compile(flex_attention, dynamic=None, backend="eager")
    before = len(cache_entries(flex_attention.__code__))
    left: list[str] = []
    # the context, and the BlockMask's kv length (flex checks it against the key's: unmarked, it pins the key's)
    sources = ["L['block_mask'].mask_mod.__closure__[0].cell_contents", "L['block_mask'].seq_lengths[1]"]
    for heads, context in ((2, 256), (2, 384), (2, 320), (4, 256)):
        bm = create_block_mask(mask_for(context), 1, None, 128, context + 128, device="cpu")
        q, k, v = (
            torch.randn(1, heads, 128, 16),
            torch.randn(1, heads, context + 128, 16),
            torch.randn(1, heads, context + 128, 16),
        )
        blocks = [(getattr(bm, a), (3,)) for a in ("kv_indices", "full_kv_indices")]
        blocks += [(getattr(bm, a), (2,)) for a in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")]
        with marked_trace([(k, (2,)), (v, (2,)), *blocks], sources):
            compiled(q, k, v, block_mask=bm)
        left += [a for t in (k, v) for a in vars(t) if "dynamo" in a]
        flex_attention(q, k, v, block_mask=bm)  # eager, after the marks are gone
    return {"left": left, "entries": len(cache_entries(flex_attention.__code__)) - before}


if __name__ == "__main__":
    print(json.dumps({"marked_trace": _marked_trace}[sys.argv[1]]()))


POOL = """
import json
from kernelpack._torch import dynamo, inductor
before = inductor.compile_workers(), dynamo.imported()
from torch._inductor import async_compile
workers = inductor.compile_workers()
started = async_compile.AsyncCompile.process_pool.cache_info().currsize
print(json.dumps({"before": before, "workers": workers, "started": started, "dynamo": dynamo.imported()}))
"""


def test_the_compile_pool_is_read_without_starting_it() -> None:
    out = run_json([sys.executable, "-c", POOL])
    assert out == {"before": [0, False], "workers": 0, "started": 0, "dynamo": True}, out


TORCH_KEY = """
import json, sys
import torch
from kernelpack._torch import inductor
ours = inductor.torch_key(expected=sys.argv[1])  # an artifact's key that differs: inductor decides, importing it
before = "torch._inductor.codecache" in sys.modules or "torch._dynamo" in sys.modules
ours_again = inductor.torch_key(expected=ours)
print(json.dumps({"ours": ours, "imported_inductor": before, "torch": inductor.inductor_torch_key(),
                  "after": inductor.torch_key(), "again": ours_again, "read_as": inductor.read_as(sys.argv[1]),
                  "read_as_other": inductor.read_as("00" * 32)}))
"""
MISREAD = """
import json, sys
import torch
from kernelpack._torch import inductor
inductor._source_key = lambda: "00" * 32  # a torch whose sources kernelpack would misread
print(json.dumps({"no_artifact": inductor.torch_key(), "against_an_artifact": inductor.torch_key(expected="ab" * 32),
                  "inductor": inductor.inductor_torch_key()}))
"""


def test_torch_key_is_read_as_inductor_computes_it_without_importing_inductor() -> None:
    """activate() checks the artifact's torch_key before Dynamo and inductor are imported (1.5-5 s of a
    job's start); kernelpack's reading must be inductor's on every torch version, or every artifact is refused."""
    first = run_json([sys.executable, "-c", TORCH_KEY, "00" * 32])  # differs: inductor's own is read
    out = run_json([sys.executable, "-c", TORCH_KEY, first["torch"]])
    assert out["imported_inductor"] is False, out
    assert len(out["ours"]) == 64 and out["ours"] == out["torch"] == out["after"] == out["again"], out
    # read_as: what lets a background start skip inductor's own computation (only where kernelpack's reading matched)
    assert out["read_as"] is True and out["read_as_other"] is False and first["read_as"] is False, (out, first)
    assert first["imported_inductor"] is True and first["ours"] == out["torch"], first
    # a misreading never refuses an artifact: inductor's own value is what the artifact is compared with then
    misread = run_json([sys.executable, "-c", MISREAD])
    assert misread["no_artifact"] == "00" * 32 and misread["against_an_artifact"] == misread["inductor"], misread


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
def test_compile_options_give_the_backend_of_the_mode(mode: str) -> None:
    """torch.compile takes a mode or options: kernelpack's options (its guard filter, the mode spelled out) must give
    the backend torch.compile(mode=mode) gives, or no entry of the one serves a call of the other and their inductor
    configs (cache keys) differ. (What the filter drops: test_precompiled's late model import, on both tiers.)"""
    import torch

    from kernelpack._torch import dynamo

    for dyn in (None, False):
        options = dynamo.compile_options(mode, dyn)
        assert callable(options.pop("guard_filter_fn"))
        ours = torch._TorchCompileInductorWrapper(None, options, dyn)
        assert ours == dynamo.inductor_backend(None if mode == "default" else mode, dyn), (mode, dyn, ours.config)


TRITON_KEY = """
import json, sys, time
from kernelpack._torch import triton
thread = triton.prefetch_key() if sys.argv[1] == "prefetch" else None
if thread is not None:
    thread.join(300)
found = thread is not None
try:
    from triton.runtime.cache import triton_key
except ImportError:
    from triton.compiler.compiler import triton_key
t = time.perf_counter()
key = triton_key()
print(json.dumps({"thread": found, "seconds": time.perf_counter() - t, "key": key}))
"""


def test_triton_key_is_computed_ahead_in_a_thread_of_its_own_where_triton_is_installed() -> None:
    """A background start computes Triton's source key (hashing libtriton.so) beside the compiler imports; the
    first precompiled load then reads it from Triton's cache instead of computing it: in a fresh process, after
    prefetch_key(), the key comes at once, against what it costs computed, and it is the same key."""
    if importlib.util.find_spec("triton") is None:  # the 2.13 CPU wheel
        from kernelpack._torch import triton

        assert triton.prefetch_key() is None
        return
    ahead = run_json([sys.executable, "-c", TRITON_KEY, "prefetch"])
    cold = run_json([sys.executable, "-c", TRITON_KEY, "cold"])
    assert ahead["thread"] and not cold["thread"] and ahead["key"] == cold["key"], (ahead, cold)
    assert ahead["seconds"] < 0.01 and cold["seconds"] > 10 * ahead["seconds"], (ahead, cold)


VEC_ISA = """
import json, os, sys, threading, time
from pathlib import Path
from kernelpack.installer import install_artifact
from kernelpack._torch.inductor import import_compiler, prefetch_vec_isa
cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
install_artifact(sys.argv[1], cache)
import_compiler()
from torch._inductor import cpu_vec_isa
def builds():  # the probes' sources and libraries (their locks are made each time)
    return {str(p) for p in cache.rglob("*") if p.suffix in (".cpp", ".so")}
files = builds()
out = {}
if sys.argv[2] in ("ahead", "twice", "unwanted"):
    installed = threading.Event()
    check_build, out["checked_after_the_event"] = cpu_vec_isa.VecISA.check_build, []
    def counted(self, code):
        out["checked_after_the_event"].append(installed.is_set())
        return check_build(self, code)
    cpu_vec_isa.VecISA.check_build = counted
    before = set(sys.modules)
    thread = prefetch_vec_isa(installed, lambda: sys.argv[2] != "unwanted")
    if sys.argv[2] == "twice":  # a second start while the first's check runs: its thread, not a second check
        other = threading.Event()
        out["second_is_the_first"] = prefetch_vec_isa(other, lambda: True) is thread
        other.set()
    time.sleep(0.2)
    imported_here = set(sys.modules) - before
    installed.set()
    thread.join(120)
    out["imported_by_the_thread"] = sorted(set(sys.modules) - before - imported_here)
    if sys.argv[2] == "unwanted":
        out["checked"] = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize
        out["probes_by_the_thread"] = len(out["checked_after_the_event"])
    else:  # checked: nothing to run
        out["after_it"] = prefetch_vec_isa(installed, lambda: True) is None
t = time.perf_counter()
out["isa"] = str(cpu_vec_isa.pick_vec_isa())
out["seconds"] = time.perf_counter() - t
out["files_added"] = sorted(builds() - files)
print(json.dumps(out))
"""


def test_the_cpus_vector_isa_check_runs_ahead_once_its_probes_are_installed(
    smoke_artifact: Path, tmp_path: Path
) -> None:
    """A CPU function's first load checks which vector instruction sets the CPU has (pick_vec_isa: a probe per set,
    dlopen-ed in a child Python; 83 % of the load under cProfile, torch 2.13). A background start runs it in a thread
    of its own once the first part is installed (the artifact ships the builder's probes: nothing is compiled), and
    the thread imports nothing beside the start's imports; the load then finds the answer cached. On every torch CI
    runs."""

    def run(mode: str) -> dict:
        env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / mode)}
        return run_json([sys.executable, "-c", VEC_ISA, str(smoke_artifact), mode], env=env)

    ahead, cold = run("ahead"), run("cold")
    # it waits for the install, then probes (on x86: at least AVX2's)
    assert ahead["checked_after_the_event"] and all(ahead["checked_after_the_event"]), ahead
    assert ahead["imported_by_the_thread"] == [] and ahead["files_added"] == [], ahead
    assert ahead["isa"] == cold["isa"] and cold["files_added"] == [], (ahead, cold)
    assert ahead["seconds"] < 0.01 and cold["seconds"] > 10 * ahead["seconds"], (ahead, cold)
    assert ahead["after_it"], ahead
    # two starts in one process run one check: two at once build probes under flags the other has half-changed
    # (VecAVX512.__bool__), which the artifact never shipped (CI, 2026-12-05)
    twice = run("twice")
    assert twice["second_is_the_first"] and twice["files_added"] == [] and twice["isa"] == cold["isa"], twice
    # where the install failed (wanted() is false then) the thread checks nothing
    unwanted = run("unwanted")
    assert unwanted["probes_by_the_thread"] == 0 and unwanted["checked"] == 0, unwanted


LOAD_IMPORTS = """
import json, os, sys
import torch
from kernelpack import precompiled
from kernelpack.artifact import read_manifest
from kernelpack.installer import install_artifact
from kernelpack._torch.inductor import import_compiler, import_loader
cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
install_artifact(sys.argv[1], cache)
built = read_manifest(sys.argv[1]).configs[0]
entry = built.precompiled_for(0, built.config.graphs[0])
import_compiler()
if sys.argv[2] == "ahead":
    import_loader({built.config.device})
before = set(sys.modules)
precompiled.load(os.path.join(cache, entry.path), built.config.device, entry.sha256)
print(json.dumps({"imported_by_the_load": sorted(set(sys.modules) - before)}))
"""
# What a first load may still import once import_loader() ran: the module of its own generated code, and on CPU
# the C++ toolchain's probe (torch.utils.cpp_extension, setuptools: what inductor's CPU kernels need alone)
STILL_LOADED = ("torch._inductor.runtime.compile_tasks.", "torch.utils.", "torch._appdirs", "torch.fx.experimental.")


@pytest.mark.skipif(precompiled_unavailable(), reason="no aot_compile in this torch")
def test_what_a_first_load_imports_can_be_imported_ahead(smoke_artifact: Path, tmp_path: Path) -> None:
    """A background start imports what the first precompiled load would (inductor's lowering and kernel templates,
    jinja2, networkx) while the install writes the warm-up's files, instead of inside the load after them. On every
    torch CI runs: without import_loader() the load imports them; with it, none of torch's compiler is left to it."""

    def imported(mode: str) -> list[str]:
        env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / mode)}
        out = run_json([sys.executable, "-c", LOAD_IMPORTS, str(smoke_artifact), mode], env=env)
        return [m for m in out["imported_by_the_load"] if m.startswith(("torch.", "jinja2", "networkx", "sympy"))]

    alone = imported("alone")
    assert "torch._inductor.select_algorithm" in alone and "jinja2" in alone, alone
    ahead = imported("ahead")
    assert [m for m in ahead if not m.startswith(STILL_LOADED)] == [], ahead


def test_the_kernel_option_defaults_kernelpack_drops_are_torchs() -> None:
    """kernelpack keys an option at torch's default as no option (kernelpack.signature.KERNEL_OPTION_DEFAULTS, a
    table, since a manifest's signatures are made without torch): it must be what this torch fills in."""
    import torch
    from torch.nn.attention import flex_attention as flex

    from kernelpack.signature import KERNEL_OPTION_DEFAULTS

    q = torch.zeros(1, 1, 16, 8, device="meta")
    filled = flex._apply_kernel_options(q, q, q, False, None)
    assert {k: filled[k] for k in KERNEL_OPTION_DEFAULTS} == dict(KERNEL_OPTION_DEFAULTS)
    # what a caller may set and torch defaults, beyond the table, is either output-only or absent
    assert set(filled) - set(KERNEL_OPTION_DEFAULTS) <= {"OUTPUT_LOGSUMEXP", "OUTPUT_MAX"}
