"""kernelpack record: functions by reference, the [[calls]] recipe form, the recorder's stand-in, and the
proof: a user's own job recorded from its script, built, and replayed in a fresh process with 0 misses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import run_json, torch_release

from kernelpack import closures, evidence
from kernelpack.cli import main
from kernelpack.config import Config
from kernelpack.errors import BuildError, KernelpackError, NotRebuildable, RecipeError, RecordError
from kernelpack.recipe import (
    parse_recipe,
    tomllib,  # tomli on 3.10
)
from kernelpack.recipe_writer import recipe_text
from kernelpack.record import recording
from kernelpack.records import RecordedCall, RecordNote
from kernelpack.signature import mask_key, mod_graph

PROJECT = Path(__file__).parent / "data" / "record_project"
sys.path.insert(0, str(PROJECT))
import user_model  # noqa: E402  (the user's module, importable as the builder will import it)

# ------------------------------------------------------------------------------------------------ closures


def _transformers_window(window: int) -> Any:
    pytest.importorskip("transformers")
    from transformers.masking_utils import sliding_window_causal_mask_function

    return sliding_window_causal_mask_function(window)


@pytest.mark.parametrize("make", [user_model.local_window, _transformers_window], ids=["user", "transformers"])
def test_a_mask_is_named_by_reference_and_made_again_the_same(make: Any) -> None:
    fn = make(64)
    ref = closures.describe(fn)
    again = closures.rebuild(json.loads(json.dumps(ref)))  # through JSON, as a recipe carries it
    assert again is not fn and again.__code__ is fn.__code__ and closures.same_function(fn, again)
    assert mask_key(again) == mask_key(fn)  # the key the manifest records and the runtime matches
    assert mod_graph(again, "mask") == mod_graph(fn, "mask")
    other = closures.rebuild(closures.describe(make(128)))
    assert mask_key(other) != mask_key(fn) and not closures.same_function(fn, other)
    assert "64" in closures.label(ref)


def test_a_reference_names_every_module_its_functions_come_from() -> None:
    """What a background start imports in activate() for a recorded mask (masks.modules_for): the modules of the
    function and of every function in its closure, nested (transformers' and_masks of its own mask functions)."""
    pytest.importorskip("transformers")
    from transformers.masking_utils import and_masks, causal_mask_function

    assert closures.modules(closures.describe(user_model.local_window(64))) == {"user_model"}
    nested = and_masks(causal_mask_function, user_model.local_window(64))
    assert closures.modules(closures.describe(nested)) == {"transformers.masking_utils", "user_model"}


MADE = {
    "lru_cache factory": lambda: user_model.cached_window(64),
    "decorated mask": lambda: user_model.decorated_window(64),
    "sibling 1 of one name": lambda: user_model.causal_or_window(True, 64),
    "sibling 2 of one name": lambda: user_model.causal_or_window(False, 64),
    "comprehension lambda": lambda: user_model.comprehension_windows((32, 64))[1],
    "dtype in the closure": lambda: user_model.typed_window(64, __import__("torch").bfloat16),
}


@pytest.mark.parametrize("make", MADE.values(), ids=MADE.keys())
def test_masks_as_real_code_makes_them_are_made_again_with_their_key(make: Any) -> None:
    fn = make()
    again = closures.rebuild(json.loads(json.dumps(closures.describe(fn))))
    assert mask_key(again) == mask_key(fn) and mod_graph(again, "mask") == mod_graph(fn, "mask")


def test_values_that_differ_give_masks_that_differ() -> None:
    """The late-binding default (w=w) and a closed-over dtype enter the mask key: two windows are two calls."""
    import torch

    first, second = user_model.comprehension_windows((32, 64))
    assert mask_key(first) != mask_key(second)
    assert mask_key(user_model.typed_window(64, torch.float32)) != mask_key(user_model.typed_window(64, torch.int64))


def test_a_mask_over_a_tensor_is_written_by_shape_and_dtype_and_made_again_as_an_example() -> None:
    """A tensor a mask closes over is an input of the graph: the reference holds its shape and dtype, the rebuilt
    mask an example tensor (zeros) of those, with the job's mask key; other values of the tensor are the same key."""
    import torch

    fn = user_model.documents(torch.arange(256) // 100)
    ref = closures.describe(fn)
    assert ref["closure"]["doc_ids"] == {"tensor": {"shape": [256], "dtype": "int64"}}
    again = closures.rebuild(json.loads(json.dumps(ref)))
    doc_ids = again.__closure__[0].cell_contents
    assert doc_ids.shape == (256,) and doc_ids.dtype == torch.int64 and not doc_ids.any()
    assert mask_key(again) == mask_key(fn) == mask_key(user_model.documents(torch.arange(256) // 7))
    assert mask_key(user_model.documents(torch.arange(128) // 7)) != mask_key(fn)  # another shape: another graph
    assert mask_key(user_model.documents((torch.arange(256) // 7).int())) != mask_key(fn)  # another dtype


def test_what_cannot_be_named_says_what_to_write_instead() -> None:
    with pytest.raises(NotRebuildable) as opaque:
        closures.describe(user_model.local_window.__globals__["local_window"](64).__class__)  # a class: no code
    assert "not a function" in opaque.value.message and "--mask-factory" in (opaque.value.hint or "")

    script: dict[str, Any] = {"__name__": "__main__"}
    exec("def causal(b, h, q, kv):\n    return q >= kv\n", script)
    with pytest.raises(NotRebuildable, match=r"defined in the script that was run \(__main__\)"):
        closures.describe(script["causal"])

    class Masks:
        def causal(self, b: Any, h: Any, q: Any, kv: Any) -> Any:
            return q >= kv

    with pytest.raises(NotRebuildable, match="bound method"):
        closures.describe(Masks().causal)


@pytest.mark.parametrize(
    "ref, fragment",
    [
        ({"function": "no_such_module_kp:f"}, "cannot import module 'no_such_module_kp'"),
        ({"function": "user_model:gone"}, "has no gone"),
        (
            {"function": "user_model:local_window.<locals>.local_causal"},
            "closes over ['window']; the reference gives []",
        ),
        ({"function": "user_model:local_window.<locals>.nothing"}, "0 functions named 'nothing'"),
    ],
)
def test_a_reference_that_cannot_be_made_here_is_named(ref: dict, fragment: str) -> None:
    with pytest.raises(KernelpackError) as e:
        closures.rebuild(ref)
    assert fragment in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------------ [[calls]]

CALL = """
[[calls]]
mask = { function = "user_model:local_window.<locals>.local_causal", closure = { window = 64 } }
q_heads = 4
kv_heads = 2
seq_len = 256
head_dim = 16
dtype = "float32"
layout = "bshd"
score_mod = "identity"
"""


def test_calls_are_configs_beside_the_matrix_and_their_order_is_not_the_recipes() -> None:
    head = 'name = "r"\ndevice = "cpu"\n'
    one = parse_recipe(tomllib.loads(head + CALL + CALL.replace("256", "512")))
    two = parse_recipe(tomllib.loads(head + CALL.replace("256", "512") + CALL))
    assert one.sha256 == two.sha256 and {c.id for c in one.configs} == {c.id for c in two.configs}
    (c, _) = one.configs
    assert c.reference("mask") == {
        "function": "user_model:local_window.<locals>.local_causal",
        "closure": {"window": 64},
    }
    from kernelpack.masks import mask_for

    assert closures.same_function(mask_for(c), user_model.local_window(64))
    matrix = head + 'mask = "sliding_window"\nwindows = [64]\n[matrix]\nq_heads = 2\nseq_len = [256]\nhead_dim = 16\n'
    both = parse_recipe(tomllib.loads(matrix + 'dtypes = ["float32"]\n' + CALL))
    assert len(both.configs) == 2 and {x.mask for x in both.configs} == {"sliding_window", c.mask}


@pytest.mark.parametrize(
    "text, key, fragment",
    [
        (CALL.replace("q_heads = 4", "q_heads = 4\nwindows = [1]"), "calls[0].windows", "unknown key"),
        (CALL.replace("closure = {", "window = 3, closure = {"), "calls[0].mask.window", "unknown key"),
        (CALL.replace('dtype = "float32"', 'dtype = "float32"\nwindow = 64'), "calls[0].window", "closure"),
        (CALL.replace("seq_len = 256", "q_len = 256"), "calls[0].kv_len", "missing"),
        (CALL.replace('layout = "bshd"', 'layout = "sbhd"'), "calls[0].layout", "unknown layout"),
        (CALL + CALL, "calls[1]", "repeats config"),
        ('mask = "sliding_window"\n' + CALL, "mask", "applies to [matrix]"),
    ],
)
def test_a_bad_call_table_is_named(text: str, key: str, fragment: str) -> None:
    with pytest.raises(RecipeError) as e:
        parse_recipe(tomllib.loads('name = "r"\ndevice = "cpu"\n' + text), path="r.toml")
    assert e.value.key == key and fragment in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------------ the recorder


def test_recording_stands_in_for_the_call_and_refuses_what_cpu_cannot_build(tmp_path: Path) -> None:
    """compute="skip": kernelpack's entry returns zeros of the real call's shapes, dtypes and layout (the lse too),
    with gradients, and compiles nothing. A CPU training call cannot be built (no compiled backward on CPU): the
    recording fails, naming the call and the reason, and writes nothing."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    import kernelpack

    q = torch.randn(1, 256, 4, 16).transpose(1, 2).requires_grad_()
    k = torch.randn(1, 2, 256, 16, requires_grad=True)
    mask = create_block_mask(user_model.local_window(64), None, None, 256, 256, device="cpu")
    out_path = tmp_path / "r.toml"
    mark = evidence.next_seq()
    with pytest.raises(RecordError) as e, recording(out_path):
        out, lse = kernelpack.flex_attention(q, k, k, block_mask=mask, enable_gqa=True, return_lse=True)
        assert out.shape == q.shape and out.stride() == q.stride() and not out.any()
        assert lse.shape == (1, 4, 256) and lse.dtype == torch.float32
        (out.sum() + lse.sum()).backward()
        assert q.grad is not None and k.grad is not None and q.grad.shape == q.shape and not q.grad.any()
    assert evidence.compile_records(mark) == []
    assert "compiled flex_attention has no backward on CPU" in e.value.message and "alias=k=v" in e.value.message
    assert not out_path.exists()


def _event(device_index: int = 0, **over: Any) -> RecordedCall:
    base = dict(device="cuda", mask="sliding_window", window=1024, batch=1, q_heads=32, kv_heads=8, q_len=4096)
    config = Config(**{**base, "kv_len": 4096, "head_dim": 128, "dtype": "bfloat16", **over})
    return RecordedCall("", "kernelpack.flex_attention", "x", config.to_dict(), device_index)


def test_a_calls_graphs_and_devices_merge_into_one_entry() -> None:
    """Reentrant checkpointing makes the same call under no_grad (fwd) and again in backward (fwd+bwd): one entry
    with both graphs, and a call at another length joins it: lengths that are multiples of one m >= 64 (a job that
    pads) become buckets of m, and lengths that are not, one dynamic range (widened: half the smallest to twice the
    largest length). A call on cuda:1 asks for --devices."""
    events = [_event(graphs=("fwd",)), _event(1, graphs=("fwd+bwd",)), _event(graphs=("fwd",), q_len=8192)]
    text = recipe_text(events, name="r")
    recipe = parse_recipe(tomllib.loads(text))
    both = ("fwd", "fwd+bwd")
    assert sorted((c.q_len, c.graphs, c.dynamic) for c in recipe.configs) == [(4096, both, False), (8192, both, False)]
    ranged = recipe_text([*events[:2], _event(graphs=("fwd",), q_len=6000)], name="r")
    assert [(c.q_range, c.graphs, c.dynamic) for c in parse_recipe(tomllib.loads(ranged)).configs] == [
        ((2048, 12000), both, True)
    ]
    exact = recipe_text(events[:2], name="r")  # one length: the call as it was made
    assert [(c.q_len, c.q_range, c.graphs) for c in parse_recipe(tomllib.loads(exact)).configs] == [
        (4096, None, ("fwd", "fwd+bwd"))
    ]
    assert "build with --devices 0,1" in text
    with pytest.raises(RecordError, match="no flex_attention call was recorded"):
        recipe_text([RecordNote("n")], name="r")


# ------------------------------------------------------------------------------------------------ the proof


def _user_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's project on the path of the recorded job, the builder and its workers, as they would install it."""
    monkeypatch.chdir(PROJECT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PROJECT), os.environ.get("PYTHONPATH", "")]))


def _record(tmp_path: Path, mode: str) -> Path:
    recipe = tmp_path / f"{mode}.toml"
    assert main(["record", "-o", str(recipe), "--", sys.executable, "train.py", mode]) == 0
    return recipe


def _replay(artifact: Path, mode: str, tmp_path: Path) -> dict:
    cmd = [sys.executable, "train.py", mode, "--artifact", str(artifact), "--cache", str(tmp_path / f"cache-{mode}")]
    # every thread's Python stack on a fatal signal: one replay died at interpreter exit with SIGABRT (CI, 2026-12-05;
    # "terminate called without an active exception", not reproduced since): its stderr then says where
    return run_json(cmd, env={"PYTHONFAULTHANDLER": "1"})


# slow: two records, a build and two replays, about a minute; the README's test command keeps record -> build ->
# replay of a script (the drafter job in test_dynamic_masks)
@pytest.mark.slow
def test_a_users_block_recorded_from_its_script_builds_and_replays_with_no_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's block (its own mask closure, transposed-view q/k/v, a score_mod closure, GQA, a scale) at two
    lengths: recorded through kernelpack.flex_attention as one table of buckets (both lengths are multiples of 256),
    and as its own torch.compile(flex_attention, dynamic=False) as one static table per length (kernelpack cannot
    change the user's compile): the same configs; built with no hand edit; replayed in fresh processes after
    activate(): 0 misses on both paths."""
    from kernelpack.build import build_recipe

    _user_env(monkeypatch)
    recipe = _record(tmp_path, "block")
    text = recipe.read_text()
    assert text.count("[[calls]]") == 1 and '"user_model:local_window.<locals>.local_causal"' in text, text
    assert "seq_len = { min = 256, max = 512, multiple = 256 }" in text and "user_model.py" in text, text
    assert "seen: kernelpack.flex_attention at" in text
    own = _record(tmp_path, "own")
    own_recipe = tomllib.loads(own.read_text())
    assert [c["seq_len"] for c in own_recipe["calls"]] == [256, 512] and "dynamic" not in own_recipe["calls"][0]
    assert "seen: torch.compile(flex_attention)" in own.read_text()
    assert {c.id for c in parse_recipe(own_recipe).configs} == {c.id for c in parse_recipe(tomllib.loads(text)).configs}
    built = build_recipe(recipe, tmp_path / "out")
    assert built.artifact is not None and not built.failed
    for mode in ("block", "own"):
        out = _replay(built.artifact, mode, tmp_path)
        assert out["missed"] == 0 and out["refused"] == [], out
        # kernelpack's own: the warm-up's, a precompiled function's load at its first call (KERNELPACK_LOAD=lazy)
        assert set(out["paths"]) <= {"kernelpack warm-up", "kernelpack load", "torch.compile(flex_attention)"}, out


# slow: a record, a build and a replay, about 35 s; the README's test command keeps the record of a job's script
# (test_dynamic_masks' drafter job) and a transformers model served with no compile (test_runtime)
@pytest.mark.slow
def test_a_transformers_model_recorded_from_its_script_builds_and_replays_with_no_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    from kernelpack.build import build_recipe

    _user_env(monkeypatch)
    recipe = _record(tmp_path, "transformers")
    text = recipe.read_text()
    assert '"transformers.masking_utils:and_masks.<locals>.and_mask"' in text and "sliding_window = 64" in text, text
    built = build_recipe(recipe, tmp_path / "out")
    assert built.artifact is not None and not built.failed
    out = _replay(built.artifact, "transformers", tmp_path)
    assert out["missed"] == 0 and out["refused"] == [] and out["paths"] == ["kernelpack warm-up"], out


def test_record_fails_before_the_job_and_writes_nothing_when_it_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _user_env(monkeypatch)
    ran = tmp_path / "ran"
    job = [sys.executable, "-c", f"open({str(ran)!r}, 'w')"]
    assert main(["record", "-o", str(tmp_path / "missing" / "r.toml"), "--", *job]) == 1
    assert not ran.exists() and "its directory does not exist" in capsys.readouterr().err
    assert main(["record", "-o", str(tmp_path / "r.toml"), "--", sys.executable, "-c", "raise SystemExit(3)"]) == 1
    assert "exited with status 3: no recipe written" in capsys.readouterr().err
    assert main(["record", "-o", str(tmp_path / "r.toml"), "--", sys.executable, "train.py", "script"]) == 1
    err = capsys.readouterr().err
    assert "defined in the script that was run (__main__)" in err and "move causal into a module" in err
    assert "Traceback" not in err and not (tmp_path / "r.toml").exists()


PROBE_FIRST = """
import importlib.util
assert importlib.util.find_spec("torch") is not None  # transformers' is_torch_available() does this on import
import torch
import kernelpack
from kernelpack.masks import block_mask, sliding_window

q, k, v = (torch.randn(1, 2, 256, 64) for _ in range(3))
kernelpack.flex_attention(q, k, v, block_mask=block_mask(sliding_window(64), 256, 256, "cpu"))
"""


def test_a_job_that_probes_for_torch_before_importing_it_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multi-line `python -c` (a newline in the command) whose first act is find_spec("torch")."""
    _user_env(monkeypatch)
    recipe = tmp_path / "probe.toml"
    assert main(["record", "-o", str(recipe), "--", sys.executable, "-c", PROBE_FIRST]) == 0
    assert parse_recipe(tomllib.loads(recipe.read_text())).configs[0].window == 64


MY_MASKS = """
import torch
from user_model import documents  # what makes the job's mask, as the job calls it


def make_documents(config):
    doc_ids = torch.zeros((config.q_len,), dtype=torch.int64, device=config.device)  # example values
    return documents(doc_ids)


def wrong(config):
    doc_ids = torch.zeros((config.q_len,), dtype=torch.int64)

    def same_document(b, h, q_idx, kv_idx):
        return doc_ids[q_idx] == doc_ids[kv_idx]

    return same_document
"""


# slow: the factory route, now the exception (a mask over tensors records without one: test_dynamic_masks); the
# README's test command keeps a factory's mask served with each step's values (test_runtime)
@pytest.mark.slow
def test_a_mask_over_a_tensor_records_through_the_factory_the_error_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The template's factory (calling the job's own mask maker with example tensors) makes a recipe whose artifact
    covers the job's call; a factory that makes another function (same graph, another name) is refused at record
    time, not at replay."""
    from kernelpack.build import build_recipe

    _user_env(monkeypatch)
    (tmp_path / "my_masks.py").write_text(MY_MASKS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]]))
    job = ["--", sys.executable, "train.py", "documents"]
    wrong = ["--mask-factory", "documents.<locals>.same_document=my_masks:wrong"]
    assert main(["record", "-o", str(tmp_path / "wrong.toml"), *wrong, *job]) == 1
    assert "would never cover this call" in capsys.readouterr().err
    right = ["--mask-factory", "documents.<locals>.same_document=my_masks:make_documents"]
    recipe = tmp_path / "docs.toml"
    assert main(["record", "-o", str(recipe), *right, *job]) == 0
    assert 'mask = "my_masks:make_documents"' in recipe.read_text()
    try:
        built = build_recipe(recipe, tmp_path / "out")
    except BuildError as e:
        # torch 2.11's CPU flex kernel has no lowering for q and k in one buffer: the build fails naming it
        if torch_release() < (2, 13) and "same buffer" in str(e):
            pytest.skip("torch 2.11 cannot compile q and k in one buffer on the CPU; the build says so")
        raise
    assert built.artifact is not None and not built.failed
    out = _replay(built.artifact, "documents", tmp_path)
    assert out["missed"] == 0 and out["refused"] == [], out


def test_the_stand_in_keeps_the_querys_layout_with_another_value_head_dim() -> None:
    import torch

    from kernelpack.record import _stand_in

    q = torch.randn(1, 256, 4, 16).transpose(1, 2)
    v = torch.randn(1, 4, 256, 32)
    out = _stand_in({"query": q, "key": q, "value": v})
    assert out.shape == (1, 4, 256, 32) and out.transpose(1, 2).is_contiguous()


def test_text_from_the_job_cannot_break_the_recipe() -> None:
    """A closure string with a quote, a backslash, a newline, an emoji and an escape, and a command with a newline:
    the recipe still reads back as recorded."""
    odd = 'a "b" \\ c\nd 🙂 \x1b[31m'
    closure = json.dumps({"closure": {"window": odd}})
    mask = "user_model:local_window.<locals>.local_causal"
    config = Config(
        device="cpu", mask=mask, mask_closure=closure, window=None, batch=1, q_heads=2, kv_heads=2, q_len=256,
        kv_len=256, head_dim=16, dtype="float32",
    )  # fmt: skip
    event = RecordedCall("", "p", "s\nx", config.to_dict())
    text = recipe_text([event], name="r", source="`python -c 'a\nb'`")
    (again,) = parse_recipe(tomllib.loads(text)).configs
    assert again.reference("mask") == {"function": config.mask, "closure": {"window": odd}}


def test_a_recorded_string_that_is_not_utf8_is_a_record_error() -> None:
    # os.fsdecode's escape for a non-UTF-8 byte (a file name) in a closure value: TOML has no string for it, and
    # the recipe's own parse raised TOMLDecodeError
    closure = json.dumps({"closure": {"tag": "data\udcffset"}})
    event = _event(mask="mypkg.masks:by_tag", mask_closure=closure, window=None)
    with pytest.raises(RecordError, match="holds the byte 0xff, which is not UTF-8"):
        recipe_text([event], name="r")


def test_record_dir_set_outside_record_is_refused_by_activate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # activate() installs and refuses nothing while a job is recorded: a variable left set outside record made it a
    # silent no-op, the dense path included
    from kernelpack.errors import SettingError
    from kernelpack.runtime import activate

    monkeypatch.setenv("KERNELPACK_RECORD_DIR", str(tmp_path))
    with pytest.raises(SettingError, match=r"KERNELPACK_RECORD_DIR=.* is not the directory of a running"):
        activate(strict=False)


OUTLIVES = """
import os, subprocess, sys
if len(sys.argv) > 2:  # the detached child: waits for record to end, then calls flex as a job would
    import time
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.1)
    q = torch.randn(1, 1, 128, 16)
    try:
        out = flex_attention(q, q, q)  # eager: record notes it, and then it wrote into a directory that was gone
        result = "ok" if out.abs().sum() > 0 else "zeros"
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
    open(sys.argv[1], "w").write(result)
else:
    import torch  # this process records (and ends at once)
    import time
    child = subprocess.Popen([sys.executable, __file__, sys.argv[1], sys.argv[1] + ".go"], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=open(sys.argv[1] + ".err", "w"))
    calls = os.path.join(os.environ["KERNELPACK_RECORD_DIR"], f"calls-{child.pid}.jsonl")
    while not os.path.exists(calls):  # the child records too, before this process (and record) ends
        time.sleep(0.1)
"""


def test_a_process_that_outlives_record_is_never_raised_into(tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(OUTLIVES)
    result = tmp_path / "result"
    r = subprocess.run(
        [sys.executable, "-m", "kernelpack", "record", "-o", str(tmp_path / "r.toml"), "--", sys.executable,
         str(job), str(result)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert r.returncode == 1 and "no flex_attention call was recorded" in r.stderr, r.stderr  # the parent made none
    Path(f"{result}.go").write_text("")  # record has ended and removed its directory
    deadline = time.monotonic() + 120
    while not result.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert result.exists() and result.read_text() == "ok", Path(f"{result}.err").read_text()
    assert "kernelpack record: stopped recording this process" in Path(f"{result}.err").read_text()


def test_a_closure_value_of_the_wrong_type_is_refused_before_any_worker_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a closure value its function cannot use failed in every build worker, or at activate(), with the function's
    # own TypeError: the builder calls each reference once first, as flex does
    recipe = tmp_path / "bad.toml"
    recipe.write_text('name = "bad"\ndevice = "cpu"\n' + CALL.replace("window = 64", 'window = "64"'))
    start = time.perf_counter()
    assert main(["build", str(recipe), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "mask: the function user_model:local_window.<locals>.local_causal fails with these closure values" in err
    assert "TypeError" in err and "{'window': '64'}" in err and "started " not in err, err
    assert time.perf_counter() - start < 30 and not (tmp_path / "out").exists()
