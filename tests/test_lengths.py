"""One artifact serves every length a training job meets, as static buckets (the job pads to them) or as
one dynamic graph (any length in the range, in a fresh process)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_json
from test_runtime import scenario

from kernelpack.artifact import read_manifest
from kernelpack.build import build_recipe
from kernelpack.cli import main
from kernelpack.config import Config
from kernelpack.errors import RecipeError
from kernelpack.recipe import load_recipe, parse_recipe
from kernelpack.records import RecordedCall, record_event
from kernelpack.verify import verify_artifact

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DATA = Path(__file__).parent / "data"
HEAD = 'name = "r"\ndevice = "cpu"\nmask = "sliding_window"\nwindows = [64]\n'


def _recipe(matrix: str, extra: str = "") -> list[Config]:
    text = HEAD + "[matrix]\nq_heads = 2\nhead_dim = 16\ndtypes = ['float32']\n" + matrix + "\n" + extra
    return list(parse_recipe(tomllib.loads(text), path="r.toml").configs)


# ------------------------------------------------------------------------------------------------ the recipe


def test_buckets_cover_the_range_from_the_first_multiple_at_or_above_min_to_the_one_at_or_above_max() -> None:
    configs = _recipe("seq_len = { min = 1000, max = 3000, multiple = 512 }")
    assert [(c.q_len, c.kv_len) for c in configs] == [
        (1024, 1024),
        (1536, 1536),
        (2048, 2048),
        (2560, 2560),
        (3072, 3072),
    ]
    assert all(c.q_range is None and not c.dynamic for c in configs)


def test_kv_len_is_tied_to_q_len_by_offsets_not_a_product() -> None:
    configs = _recipe("q_len = { min = 256, max = 512, multiple = 256 }\nkv_len = { offset = [0, 128] }")
    assert [(c.q_len, c.kv_len) for c in configs] == [(256, 256), (256, 384), (512, 512), (512, 640)]


def test_a_dynamic_range_is_one_config_traced_inside_it() -> None:
    (c,) = _recipe("seq_len = { min = 200, max = 1000 }", "[compile]\ndynamic = true\n")
    assert c.dynamic and c.q_range == c.kv_range == (200, 1000) and 200 <= c.q_len == c.kv_len <= 1000
    assert c.covers_lengths(201, 201) and c.covers_lengths(1000, 1000) and not c.covers_lengths(1001, 1001)
    assert not c.covers_lengths(1000, 999)  # a seq_len range: q_len == kv_len
    assert "q_len 200..1000 kv_len 200..1000" in c.describe()
    assert Config.from_dict(c.to_dict()) == c  # the manifest's JSON round trip
    (q,) = _recipe("q_len = { min = 300, max = 900 }\nkv_len = { min = 400, max = 2000 }", "[compile]\ndynamic = true")
    assert (q.q_range, q.kv_range) == ((300, 900), (400, 2000))


def test_old_recipes_keep_their_configs_ids_and_sha256() -> None:
    """A length list and the recipes in the repository read as before ranges existed (their artifacts' ids)."""
    (c,) = _recipe("seq_len = [256]")
    assert "q_range" not in json.dumps(c.to_dict()) or c.to_dict()["q_range"] is None
    for path in sorted((DATA.parent.parent / "recipes").glob("*.toml")):
        recipe = load_recipe(path)
        assert all(x.q_range is None and not x.padded for x in recipe.configs)
        assert "lens" in recipe.normalized["matrix"] and all(len(p) == 2 for p in recipe.normalized["matrix"]["lens"])


@pytest.mark.parametrize(
    "matrix, extra, key, fragment",
    [
        ("seq_len = { min = 200, max = 1000 }", "", "matrix.seq_len", "needs [compile] dynamic = true"),
        (
            "seq_len = { min = 200, max = 1000, multiple = 64 }",
            "[compile]\ndynamic = true",
            "matrix.seq_len.multiple",
            "makes static buckets",
        ),
        ("seq_len = { min = 100, max = 1000 }", "[compile]\ndynamic = true", "matrix.seq_len", "above the block size"),
        ("seq_len = { min = 900, max = 100, multiple = 64 }", "", "matrix.seq_len.max", "below min"),
        ("seq_len = { min = 100, max = 900, step = 64 }", "", "matrix.seq_len.step", "unknown key"),
        ("seq_len = { min = 1, max = 900000, multiple = 1 }", "", "matrix.seq_len.multiple", "buckets (at most"),
        (
            "q_len = { min = 256, max = 512, multiple = 256 }\nkv_len = { min = 256, max = 512, multiple = 256 }",
            "",
            "matrix.kv_len",
            "tie kv_len to q_len",
        ),
        (
            "q_len = { min = 256, max = 512 }\nkv_len = { offset = 0 }",
            "[compile]\ndynamic = true",
            "matrix.kv_len.offset",
            "takes a kv_len range",
        ),
        (
            "q_len = { min = 256, max = 512 }\nkv_len = [256]",
            "[compile]\ndynamic = true",
            "matrix.kv_len",
            "both ranges",
        ),
        ("q_len = [256]\nkv_len = { offset = -256 }", "", "matrix.kv_len.offset", "gives kv_len 0"),
    ],
)
def test_a_bad_range_is_named_with_what_to_write(matrix: str, extra: str, key: str, fragment: str) -> None:
    with pytest.raises(RecipeError) as e:
        _recipe(matrix, extra)
    assert e.value.key == key and fragment in str(e.value), str(e.value)


def test_calls_tables_take_ranges_too() -> None:
    table = '[[calls]]\nmask = "sliding_window"\nwindow = 64\nq_heads = 2\nhead_dim = 16\ndtype = "float32"\n'
    text = 'name = "r"\ndevice = "cpu"\n' + table + "seq_len = { min = 300, max = 2000 }\ndynamic = true\n"
    text += table + "seq_len = { min = 300, max = 800, multiple = 256 }\n"
    configs = parse_recipe(tomllib.loads(text)).configs
    assert sorted((c.q_len, c.q_range) for c in configs) == [
        (512, None),
        (768, None),
        (1024, None),
        (1150, (300, 2000)),
    ]


# ------------------------------------------------------------------------------------------------ built, then served


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from conftest import build_once

    return {kind: build_once(tmp_path_factory, DATA / f"lengths-{kind}.toml") for kind in ("buckets", "dynamic")}


def test_a_dynamic_graph_traced_at_one_length_covers_the_range_in_a_fresh_process(built: dict[str, Path]) -> None:
    """verify: a fresh process, an empty cache, the artifact installed; the traced length, both ends and 20 random
    lengths that are not multiples of 128: one Dynamo frame, no miss of any kind."""
    data = verify_artifact(built["dynamic"], seed=3).to_dict()
    (c,) = data["configs"]
    assert len(c["lengths"]) >= 20 and sum(n % 128 != 0 for n, _ in c["lengths"]) >= 18, c["lengths"]
    assert c["reasons"] == [] and c["counters"]["frames.ok"] == 1, c
    # its precompiled function (traced at the middle, dynamic) served every one of those lengths too
    assert [t["tier"] for t in c["tiers"].values()] == ["precompiled"], c["tiers"]
    assert c["counters"]["inductor.fxgraph_cache_miss"] == 0 and c["counters"]["aot_autograd.autograd_cache_miss"] == 0
    manifest = read_manifest(built["dynamic"])
    (entry,) = manifest.configs
    assert manifest.covers(_sig(entry, 777)).entry is entry and manifest.covers(_sig(entry, 1001)).entry is None
    # what a served call asks: the entry, and the signature its precompiled function and warm-up are keyed by
    (traced,) = entry.signatures(0)
    assert manifest.resolve(_sig(entry, 777)) == (entry, traced) and manifest.resolve(traced) == (entry, traced)
    assert manifest.resolve(_sig(entry, 199)) is None and manifest.resolve(_sig(entry, 1001)) is None
    assert manifest.resolve(dataclasses.replace(_sig(entry, 777), head_dim=traced.head_dim * 2)) is None
    (near,) = manifest.covers(_sig(entry, 1001), nearest=1).nearest
    assert near.differences == (("q_len", "200..1000", 1001), ("kv_len", "200..1000", 1001)), near.differences


def _sig(entry, n: int):  # type: ignore[no-untyped-def]
    import dataclasses

    (traced,) = entry.signatures(0)
    return dataclasses.replace(traced, q_len=n, kv_len=n, dynamic=False)  # as kernelpack.flex_attention names it


@pytest.mark.parametrize("kind", ["buckets", "dynamic"])
def test_random_real_lengths_are_served_with_no_fx_miss(kind: str, built: dict[str, Path], tmp_path: Path) -> None:
    """The issue's CPU proof: a fresh process, strict mode, 24 random real lengths (none a multiple of 128): the
    dynamic graph serves each as it is, the buckets serve each padded through padded_length (the padded keys masked
    out over a 0-d tensor): outputs equal the reference at the real length, nothing compiles after the warm-up,
    and a length past the range is refused naming it."""
    out = scenario("random_lengths", built[kind], tmp_path)
    assert len(set(out["lengths"])) >= 20 and all(n % 128 for n in out["lengths"]), out
    assert out["fx_misses"] == 0 and out["missed"] == 0 and out["compiles"] == 0, out
    assert out["max_error"] < 1e-4, out
    assert "no bucket or range that holds" in out["refused_length"], out
    assert {s["tier"] for s in out["served"]} == {"precompiled"}, out["served"]  # buckets and range alike
    if kind == "dynamic":
        assert out["padded_to"] == out["lengths"], out
        (served,) = out["served"]
        assert served["dynamic"] and served["calls"] == 24, served
        assert served["q_len"] == [min(out["lengths"]), max(out["lengths"])], served
        # after the warm-up the dynamic graph's guards would take 1001 (no upper bound): strict mode refuses it,
        # and the one difference it names is the length
        assert "200..1000" in out["beyond"] and "differs in: q_len '200..1000' vs 1001, kv_len" in out["beyond"], out
    else:
        assert set(out["padded_to"]) <= {256, 512, 768} and len(set(out["padded_to"])) == 3, out
        assert all(0 <= p - n < 256 for n, p in zip(out["lengths"], out["padded_to"], strict=True)), out
        assert sum(s["calls"] for s in out["served"]) == 24 and not any(s["dynamic"] for s in out["served"]), out
        assert "seq=768" in out["beyond"] and "differs in: q_len 768 vs 769, kv_len 768 vs 769)" in out["beyond"], out


def test_padded_length_needs_an_active_artifact() -> None:
    from kernelpack import runtime
    from kernelpack.errors import KernelpackError

    runtime.deactivate()
    with pytest.raises(KernelpackError, match="none is active"):
        runtime.padded_length(300)


def test_padding_leaves_outputs_and_gradients_of_the_real_rows_unchanged() -> None:
    """The documented padding: pad q, k, v at the end with anything, mask the padded keys with masks.padded over a
    0-d tensor, drop the padded query rows. The output and every gradient of the real tokens equal the unpadded
    call's, for a bidirectional window (whose real rows would otherwise see the padding). Gradients through
    attention written out in float64 over the mask the mask_mod makes (torch's flex has no backward on CPU);
    outputs through torch's flex_attention too."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

    from kernelpack import masks

    def attention(q, k, v, mask_mod):  # type: ignore[no-untyped-def]
        allowed = create_mask(mask_mod, None, None, q.shape[2], k.shape[2], device="cpu")
        # finite: a row with no key (a padded query past the window) is then defined, and dropped
        scores = (q @ k.transpose(-1, -2) / 4.0).masked_fill(~allowed, -1e30)
        return scores.softmax(-1) @ v

    torch.manual_seed(0)
    n, length = 300, 512
    base = masks.sliding_window_bidirectional(48)
    mask = masks.padded(base, torch.tensor(n, dtype=torch.int32))
    real = [torch.randn(1, 2, n, 16, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    out = attention(*real, base)
    grads = torch.autograd.grad((out * out).sum(), real)
    padded_in = [torch.cat([t, 100 * torch.randn(1, 2, length - n, 16, dtype=torch.float64)], dim=2) for t in real]
    out_p = attention(*padded_in, mask)[:, :, :n]
    grads_p = torch.autograd.grad((out_p * out_p).sum(), real)
    torch.testing.assert_close(out_p, out)
    for g, gp in zip(grads, grads_p, strict=True):
        torch.testing.assert_close(gp, g)
    assert not torch.allclose(attention(*padded_in, base)[:, :, :n], out)  # unmasked, the padding leaks in
    with torch.no_grad():  # torch's flex, forward
        flex = flex_attention(
            *(t.detach() for t in padded_in),
            block_mask=create_block_mask(mask, None, None, length, length, device="cpu"),
            scale=0.25,
        )
    torch.testing.assert_close(flex[:, :, :n], out.detach())
    assert masks.padded(base, 7).kernelpack_mask == "padded(sliding_window_bidirectional(48))"  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="0-d integer tensor"):
        masks.padded(base, torch.tensor([1, 2]))


# ------------------------------------------------------------------------------------------------ record


JOB = """
import random, sys
import torch
import kernelpack
from kernelpack import masks, runtime
seed, steps, lo, hi = map(int, sys.argv[1:5])
if len(sys.argv) > 5:
    runtime.activate(sys.argv[5], cache_dir=sys.argv[6])
rng = random.Random(seed)
for _ in range(steps):
    n = rng.randint(lo, hi)
    q, k, v = (torch.randn(1, 2, n, 16) for _ in range(3))
    with torch.no_grad():
        kernelpack.flex_attention(q, k, v, block_mask=masks.block_mask(masks.sliding_window(48), n, n, "cpu"))
if len(sys.argv) > 5:
    print(runtime.report().summary())
"""


# slow: a record, a build and a replay; the README's test command keeps the drafter job recorded at many lengths
# into one range per mask and served at others (test_dynamic_masks)
@pytest.mark.slow
def test_a_job_recorded_at_many_lengths_gets_one_range_that_serves_other_lengths(tmp_path: Path) -> None:
    """`kernelpack record` of a job whose length changes every step writes one dynamic range, not a table per
    length; built, it serves the job at lengths it never recorded, with no compile."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    recipe = tmp_path / "r.toml"
    assert main(["record", "-o", str(recipe), "--", sys.executable, str(job), "1", "8", "300", "900"]) == 0
    text = recipe.read_text()
    assert text.count("[[calls]]") == 1 and "dynamic = true" in text and "8 lengths were recorded" in text, text
    (config,) = load_recipe(recipe).configs
    # widened beyond what was seen (record's default: half the smallest to twice the largest length)
    assert config.q_range is not None and config.q_range[0] < 300 and config.q_range[1] > 900, config.q_range
    built = build_recipe(recipe, tmp_path / "out", jobs=1)
    assert built.artifact is not None
    lo, hi = config.q_range
    replay = subprocess.run(
        [sys.executable, str(job), "2", "10", str(lo), str(hi), str(built.artifact), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert replay.returncode == 0, replay.stderr[-3000:]
    assert replay.stdout.strip().startswith("0 of 1 compiles missed"), replay.stdout


def _event(q: int, kv: int, **over: object) -> RecordedCall:
    """A recorded call event of a small CPU call at these lengths, as a recording process writes and record reads
    it (one JSON line)."""
    fields = dict(device="cpu", mask="sliding_window", window=64, batch=1, q_heads=2, kv_heads=2, head_dim=16)
    c = Config(**fields, q_len=q, kv_len=kv, dtype="float32", **over)  # type: ignore[arg-type]
    event = RecordedCall("", "kernelpack.flex_attention", "x", c.to_dict())
    assert record_event(json.loads(json.dumps(event.to_dict()))) == event  # the JSON line reads back as written
    return event


def test_lengths_a_job_already_pads_to_are_written_as_its_buckets() -> None:
    from kernelpack.recipe_writer import recipe_text

    def event(n: int) -> dict:
        return _event(n, n)

    text = recipe_text([event(n) for n in (512, 1024, 2560, 4096)], name="r")
    assert "seq_len = { min = 512, max = 4096, multiple = 512 }" in text and "dynamic" not in text.split("[[calls]]")[1]
    configs = parse_recipe(tomllib.loads(text)).configs
    assert {c.q_len for c in configs} == {512 * i for i in range(1, 9)}
    few = recipe_text([event(n) for n in (512, 1000)], name="r")  # not one multiple: one dynamic range, widened
    assert few.count("[[calls]]") == 1 and "seq_len = { min = 256, max = 2000 }" in few and "dynamic = true" in few


ANCHOR_JOB = """
import json, random, sys
import torch
import anchors
import kernelpack
from kernelpack import evidence, masks, runtime
runtime.activate(sys.argv[1], cache_dir=sys.argv[2]).wait()  # the records after the mark are the job's
dev = sys.argv[3] if len(sys.argv) > 3 else "cpu"
mark = evidence.next_seq()
rng = random.Random(0)
errors, lengths = [], []
for _ in range(10):
    n = 16 * rng.randint(16, 64)  # the drafter's length: a whole number of draft blocks
    length = runtime.padded_length(n)  # its bucket; the anchors of the padded blocks are 0
    a = torch.randint(0, n, (n // 16,), dtype=torch.int32, device=dev)  # this step's anchors
    padded_anchors = torch.cat([a, torch.zeros((length - n) // 16, dtype=torch.int32, device=dev)])
    q, k, v = (torch.randn(1, 2, length, 16, device=dev) for _ in range(3))
    mask_mod = anchors.make_mask(padded_anchors)  # no real query sees a padded key: no padded() needed
    out = kernelpack.flex_attention(q, k, v, block_mask=masks.block_mask(mask_mod, length, length, dev))[:, :, :n]
    real = anchors.make_mask(a)
    allowed = torch.nn.attention.flex_attention.create_mask(real, None, None, n, n, device=dev)
    scores = (q[:, :, :n] @ k[:, :, :n].transpose(-1, -2)) / 4.0
    ref = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v[:, :, :n]
    errors.append(float((out - ref).norm() / ref.norm()))
    lengths.append(n)
records = evidence.compile_records(mark)
print(json.dumps({"lengths": lengths, "max_error": max(errors), "compiles": len(records),
                  "missed": len(runtime.report().misses), "served": runtime.report().to_dict()["served"]}))
"""


# slow: 4 static buckets built, about a minute; the README's test command keeps a factory mask over a tensor
# served with each step's values (test_runtime) and padding to buckets (the buckets arm above)
@pytest.mark.slow
def test_a_drafters_mask_over_per_step_anchors_is_served_at_every_length(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mask closing over a tensor whose length follows the batch's (DFlash's anchors, one per draft block): the
    recipe's factory makes it over example anchors of each bucket's length; a fresh process pads each step to its
    bucket (anchors too) and is served the job's own mask, with this step's anchors, at 10 lengths."""
    project = DATA / "lengths_project"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(project), os.environ.get("PYTHONPATH", "")]))
    built = build_recipe(DATA / "lengths-anchors.toml", tmp_path / "out", jobs=2)
    assert built.artifact is not None and not built.failed
    job = tmp_path / "job.py"
    job.write_text(ANCHOR_JOB)
    out = run_json([sys.executable, str(job), str(built.artifact), str(tmp_path / "cache")])
    assert len(set(out["lengths"])) >= 8 and out["compiles"] == 0 and out["missed"] == 0, out
    assert out["max_error"] < 1e-4, out
    assert sum(s["calls"] for s in out["served"]) == 10 and len(out["served"]) >= 2, out


# ------------------------------------------------------------------------------------------------ review findings


def test_a_calls_recipe_normalizes_every_field_and_a_new_value_changes_its_sha256() -> None:
    """A [[calls]] recipe's normalized form holds every field of each call, defaults included (no field is left out
    at its default: that was a shim for recipes that never shipped), and a field set otherwise is another recipe."""
    text = 'name = "r"\ndevice = "cpu"\n[[calls]]\nmask = "sliding_window"\nwindow = 64\nq_heads = 2\nseq_len = 256\n'
    text += 'head_dim = 16\ndtype = "float32"\n'
    recipe = parse_recipe(tomllib.loads(text))
    assert recipe.normalized["calls"][0] == recipe.configs[0].to_dict()
    assert {"padded", "q_range", "kv_range"} <= set(recipe.normalized["calls"][0])
    padded = parse_recipe(tomllib.loads(text + "padded = true\n"))
    assert padded.normalized["calls"][0]["padded"] is True and padded.sha256 != recipe.sha256


@pytest.mark.parametrize(
    "text, key, fragment",
    [
        ("seq_len = { min = 1, max = 1000000, multiple = 1 }", "matrix.seq_len.multiple", "buckets (at most"),
        ("seq_len = { min = 1, max = 1000000000000, multiple = 1 }", "matrix.seq_len.max", "from 1 to 2147483647"),
        ('seq_len = { min = 200, max = 1000 }\n[compile]\ndynamic = "yes"', "compile.dynamic", "must be a boolean"),
    ],
)
def test_more_bad_ranges(text: str, key: str, fragment: str) -> None:
    with pytest.raises(RecipeError) as e:
        parse_recipe(tomllib.loads(HEAD + "[matrix]\nq_heads = 2\nhead_dim = 16\ndtypes = ['float32']\n" + text))
    assert e.value.key == key and fragment in str(e.value), str(e.value)


def test_two_ranges_of_one_call_traced_at_one_length_are_refused() -> None:
    table = '[[calls]]\nmask = "sliding_window"\nwindow = 64\nq_heads = 2\nhead_dim = 16\ndtype = "float32"\n'
    text = 'name = "r"\ndevice = "cpu"\n' + table + "seq_len = { min = 200, max = 1000 }\ndynamic = true\n"
    text += table + "seq_len = { min = 500, max = 700 }\ndynamic = true\n"  # both traced at 600: one graph
    with pytest.raises(RecipeError) as e:
        parse_recipe(tomllib.loads(text))
    assert e.value.key == "calls" and "traced at the same lengths" in str(e.value), str(e.value)


def test_a_repeated_call_names_its_table_not_its_bucket() -> None:
    table = '[[calls]]\nmask = "sliding_window"\nwindow = 64\nq_heads = 2\nhead_dim = 16\ndtype = "float32"\n'
    text = 'name = "r"\ndevice = "cpu"\n' + table + "seq_len = { min = 256, max = 1024, multiple = 256 }\n"
    text += table + "seq_len = 768\n"
    with pytest.raises(RecipeError) as e:
        parse_recipe(tomllib.loads(text))
    assert e.value.key == "calls[1]", str(e.value)


def test_a_seq_len_range_covers_equal_lengths_and_independent_ranges_any_pair() -> None:
    (tied,) = _recipe("seq_len = { min = 300, max = 900 }", "[compile]\ndynamic = true")
    both = "q_len = { min = 300, max = 900 }\nkv_len = { min = 300, max = 900 }"
    (free,) = _recipe(both, "[compile]\ndynamic = true")
    assert tied.tied and tied.covers_lengths(400, 400) and not tied.covers_lengths(400, 500)
    assert not free.tied and free.q_len != free.kv_len and free.covers_lengths(400, 500)
    from kernelpack.workload import range_lengths

    assert all(q == kv for q, kv in range_lengths(tied, 10, 0))
    assert {(300, 900), (900, 300)} <= set(range_lengths(free, 10, 0))  # corners of independent ranges


def test_record_keeps_what_no_range_serves_as_tables_of_their_own() -> None:
    """Decode (q_len 1, fixed: one dynamic range over kv_len), lengths of one block (a table of their own), offsets
    that would give kv_len <= 0 in other buckets, and calls made through guarded(dynamic=True) (served by dynamic
    graphs only): record still writes a recipe that serves every recorded call (recipe_text replays each)."""
    from kernelpack.recipe_writer import recipe_text

    event = _event
    cases = {
        "decode": ([event(1, n) for n in (300, 301, 302, 303)], 1),
        "short": ([event(n, n) for n in (100, 150, 300, 450)], 2),
        "offsets": ([event(256, 256), event(512, 512), event(768, 768), event(1024, 128)], 2),
    }
    for name, (events, tables) in cases.items():
        text = recipe_text(events, name="r")  # checks that it serves every call
        assert text.count("[[calls]]") == tables, (name, text)
    decode = parse_recipe(tomllib.loads(recipe_text(cases["decode"][0], name="r"))).configs[0]
    assert (decode.q_range, decode.kv_range, decode.dynamic) == ((1, 1), (150, 606), True)
    dynamic = recipe_text([event(n, n, dynamic=True) for n in (512, 1024, 1536, 2048)], name="r")
    assert "seq_len = { min = 256, max = 4096 }" in dynamic and "dynamic = true" in dynamic, dynamic


def test_padded_accepts_an_int_or_any_integer_tensor_and_makes_the_builders_tensor() -> None:
    import torch

    from kernelpack import masks

    base = masks.sliding_window(64)
    for n in (300, torch.tensor(300), torch.tensor(300, dtype=torch.int64)):
        mask = masks.padded(base, n)
        (kv_len,) = [c.cell_contents for c in mask.__closure__ if isinstance(c.cell_contents, torch.Tensor)]  # type: ignore[union-attr]
        assert kv_len.dtype == torch.int32 and kv_len.device.type == "cpu" and int(kv_len) == 300
    for bad in (300.0, True, torch.tensor([300])):
        with pytest.raises(Exception, match="padded"):
            masks.padded(base, bad)


def test_record_names_a_padded_builtin_mask(tmp_path: Path) -> None:
    """A job that pads through masks.padded(sliding_window(W), n) is recorded as the built-in mask with
    [call] padded, which builds the very same mask."""
    import torch

    import kernelpack
    from kernelpack import masks
    from kernelpack.record import recording

    out_path = tmp_path / "r.toml"
    with recording(out_path):
        for n, length in ((300, 384), (350, 384)):
            mask = masks.padded(masks.sliding_window(64), n)
            q = torch.randn(1, 2, length, 16)
            with torch.no_grad():
                kernelpack.flex_attention(q, q, q, block_mask=masks.block_mask(mask, length, length, "cpu"))
    (config,) = load_recipe(out_path).configs
    assert config.padded and config.mask == "sliding_window" and config.window == 64, out_path.read_text()
