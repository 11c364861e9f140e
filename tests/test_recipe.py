from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kernelpack.config import Config
from kernelpack.errors import ConfigError, RecipeError
from kernelpack.recipe import load_recipe, parse_recipe

ROOT = Path(__file__).resolve().parent.parent


def base(**over: object) -> dict:
    data: dict = {
        "name": "t",
        "description": "d",
        "device": "cuda",
        "mask": "sliding_window",
        "windows": [128, 256],
        "matrix": {
            "batch": 1,
            "q_heads": 8,
            "kv_heads": 2,
            "seq_len": [1024, 2048],
            "head_dim": 64,
            "dtypes": ["bfloat16", "float16"],
            "graphs": ["fwd+bwd"],
        },
    }
    for k, v in over.items():
        if k.startswith("matrix.") and v is None:
            data["matrix"].pop(k[7:])
        elif k.startswith("matrix."):
            data["matrix"][k[7:]] = v
        elif v is None:
            data.pop(k)
        else:
            data[k] = v
    return data


def test_shipped_recipes_parse() -> None:
    smoke = load_recipe(ROOT / "recipes" / "smoke-cpu.toml")
    assert smoke.device == "cpu" and all(c.graphs == ("fwd",) for c in smoke.configs)
    drafter = load_recipe(ROOT / "recipes" / "dflash-drafter.toml")
    assert len(drafter.configs) == 6
    # the seeds' drafters use reentrant checkpointing: forward-only under no_grad, then the training graph
    assert all(c.graphs == ("fwd", "fwd+bwd") for c in drafter.configs)
    assert {(c.q_len, c.window) for c in drafter.configs} == {(s, w) for s in (4096, 8192, 16384) for w in (1024, 2048)}
    assert all(c.enable_gqa and c.q_heads == 32 and c.kv_heads == 8 and c.head_dim == 128 for c in drafter.configs)


def test_expansion_is_the_full_product_with_stable_unique_ids() -> None:
    r = parse_recipe(base())
    assert len(r.configs) == 2 * 2 * 2  # windows x seq_len x dtypes
    ids = [c.id for c in r.configs]
    assert len(set(ids)) == len(ids)
    assert ids == [c.id for c in parse_recipe(base()).configs]
    # the id is a function of the parameters alone, and changes with any of them
    c = r.configs[0]
    assert Config.from_dict(c.to_dict()).id == c.id
    assert Config.from_dict({**c.to_dict(), "window": c.window + 1}).id != c.id  # type: ignore[operator]
    assert r.sha256 == parse_recipe(base()).sha256 != parse_recipe(base(windows=[128])).sha256


def test_q_len_kv_len_and_scalar_axes() -> None:
    data = base(**{"matrix.q_len": 512, "matrix.kv_len": [1024, 2048]})
    del data["matrix"]["seq_len"]
    r = parse_recipe(data)
    assert {(c.q_len, c.kv_len) for c in r.configs} == {(512, 1024), (512, 2048)}


def test_custom_mask_import_path_without_windows() -> None:
    r = parse_recipe(base(mask="mypkg.masks:anchor_window", windows=None))
    assert {c.window for c in r.configs} == {None} and r.configs[0].mask == "mypkg.masks:anchor_window"


@pytest.mark.parametrize(
    "over, key, fragment",
    [
        ({"colour": "red"}, "colour", "unknown key"),
        ({"matrix.heads": 4}, "matrix.heads", "unknown key"),
        ({"device": "tpu"}, "device", "'tpu'"),
        ({"mask": "causal"}, "mask", "unknown mask"),
        ({"windows": []}, "windows", "must not be empty"),
        ({"windows": [0]}, "windows", "positive integer"),
        ({"windows": ["128"]}, "windows", "'128'"),
        ({"matrix.seq_len": []}, "matrix.seq_len", "must not be empty"),
        ({"matrix.head_dim": 64.0}, "matrix.head_dim", "64.0"),
        ({"matrix.dtypes": ["bf16"]}, "matrix.dtypes", "'bf16'"),
        ({"matrix.graphs": ["bwd"]}, "matrix.graphs", "unknown graph"),
        ({"matrix.kv_heads": 3}, "matrix.kv_heads", "not a multiple"),
        ({"device": "cpu"}, "matrix.graphs", "no backward on CPU"),
        ({"name": ""}, "name", "must not be empty"),
        ({"compile": {"mode": "fast"}}, "compile.mode", "'fast'"),
        ({"compile": {"dynamic": "no"}}, "compile.dynamic", "boolean"),
        ({"kernel_options": {"BLOCK_M": [64]}}, "kernel_options.BLOCK_M", "scalar"),
        ({"kernel_options": {"BACKEND": "flash"}}, "kernel_options.BACKEND", "CuTe DSL kernels outside"),
        ({"call": {"layout": "bsdh"}}, "call.layout", "'bsdh'"),
        ({"call": {"layout": "bshd(row=16)"}}, "call.layout", "q's layout 'bshd(row=16)': row=16 is narrower"),
        ({"call": {"layout": "bshd(row=512)"}}, "call.layout", "row=512 is dense: write 'bshd'"),
        ({"call": {"layout": "bshd(head=64,row=1024)"}}, "call.layout", "write bshd(row=1024)"),
        ({"call": {"layout": "q=bshd k=bshd v=bshd(head=8,row=512)"}}, "call.layout", "head=8 is narrower"),
        ({"call": {"layout": "bhsd(head=64,row=64)"}}, "call.layout", "unknown layout"),
        ({"call": {"scale": 0}}, "call.scale", "positive"),
        ({"call": {"scale": "1/8"}}, "call.scale", "'1/8'"),
        ({"call": {"return_lse": 1}}, "call.return_lse", "boolean"),
        ({"call": {"enable_gqa": False}}, "call.enable_gqa", "must be true when q_heads=8 != kv_heads=2"),
        ({"call": {"block_size": [128, 64, 32]}}, "call.block_size", "two of them"),
        ({"call": {"block_size": 0}}, "call.block_size", "positive"),
        ({"call": {"lse": True}}, "call.lse", "unknown key"),
        ({"call": {"score_mod": "softcap"}}, "call.score_mod", "'softcap'"),
        ({"device": "cpu", "matrix.graphs": ["fwd"], "call": {"return_lse": True}}, "call.return_lse", "CPU"),
        ({"call": {"return_aux": "max"}}, "call.return_aux", "'max'"),
        ({"call": {"return_aux": "lse", "return_lse": True}}, "call.return_aux", "together with return_aux"),
        ({"device": "cpu", "matrix.graphs": ["fwd"], "call": {"return_aux": "lse"}}, "call.return_aux", "CPU"),
        ({"call": {"mask_dims": "per-sample"}}, "call.mask_dims", "'per-sample'"),
        ({"call": {"alias": "k=q"}}, "call.alias", "'k=q'"),
        ({"call": {"alias": "q=k=v"}}, "call.alias", "q_heads == kv_heads"),
    ],
)
def test_validation_names_file_key_value_and_allowed(over: dict, key: str, fragment: str) -> None:
    with pytest.raises(RecipeError) as exc:
        parse_recipe(base(**over), path="r.toml")
    msg = str(exc.value)
    assert msg.startswith(f"r.toml: {key}: "), msg
    assert fragment in msg
    assert exc.value.key == key


def test_graphs_normalize_to_one_order_and_backward_is_no_key() -> None:
    both = parse_recipe(base(**{"matrix.graphs": ["fwd+bwd", "fwd"]}))
    assert all(c.graphs == ("fwd", "fwd+bwd") and c.backward for c in both.configs)  # normalized to one order
    assert both.normalized["matrix"]["graphs"] == ["fwd", "fwd+bwd"]
    train = parse_recipe(base())  # graphs = ["fwd+bwd"]
    assert all(c.graphs == ("fwd+bwd",) for c in train.configs)
    fwd = parse_recipe(base(**{"matrix.graphs": ["fwd"]}))
    assert all(c.graphs == ("fwd",) and not c.backward for c in fwd.configs)
    # a config is one point with its graphs; its signatures are one per graph
    c = both.configs[0]
    assert [s.graph for s in c.signatures(0)] == ["fwd", "fwd+bwd"]
    assert {s.graph for s in c.signatures(0)} == {"fwd", "fwd+bwd"} and c.id != train.configs[0].id
    # `backward = true` was a spelling of graphs before 0.1.0 shipped: now an unknown key, and the manifest's
    # config has no such field
    with pytest.raises(RecipeError, match="unknown key") as exc:
        parse_recipe(base(**{"matrix.backward": True}))
    assert exc.value.key == "matrix.backward"
    old = {k: v for k, v in train.configs[0].to_dict().items() if k != "graphs"}
    with pytest.raises(ConfigError, match="unknown field"):
        Config.from_dict({**old, "backward": True})


def test_a_config_id_hashes_every_parameter() -> None:
    """No parameter is left out of the id at its default (a shim for artifacts that never shipped): the id is the
    hash of the whole normalized form, defaults included, and reads back from it."""
    import hashlib

    from kernelpack.config import canonical_json

    for c in parse_recipe(base()).configs[:3]:
        d = c.to_dict()
        assert {"padded", "q_range", "mask_dims", "alias", "return_aux"} <= d.keys()
        assert c.id == hashlib.sha256(canonical_json(d).encode()).hexdigest()[:12]
        assert Config.from_dict(d).id == c.id


def test_call_keys_expand_and_enter_the_id() -> None:
    r = parse_recipe(base(call={"layout": ["bhsd", "bshd"], "scale": 1, "return_lse": True, "block_size": 64}))
    assert len(r.configs) == 2 * 8 and {c.layout for c in r.configs} == {"bhsd", "bshd"}  # layout is an axis
    c = r.configs[0]
    assert (c.scale, c.return_lse, c.enable_gqa, c.block_size) == (1.0, True, True, (64, 64))
    assert Config.from_dict(c.to_dict()) == c and c.id not in {x.id for x in parse_recipe(base()).configs}
    assert r.normalized["call"] == {
        "layout": ["bhsd", "bshd"],
        "scale": 1.0,
        "return_lse": True,
        "block_size": [64, 64],
        "score_mod": "none",
        "return_aux": "none",
        "mask_dims": "broadcast",
        "alias": "none",
        "padded": False,
    }
    with pytest.raises(ConfigError, match="block_size: must be a positive integer or two of them"):
        dataclasses.replace(c, block_size=64)  # type: ignore[arg-type]
    plain = parse_recipe(base()).configs[0]
    assert (plain.layout, plain.scale, plain.return_lse, plain.block_size) == ("bhsd", None, False, (128, 128))
    assert plain.enable_gqa  # 8 q heads, 2 kv heads
    # a parameter left out is at its default: the canonical call
    old = {k: v for k, v in plain.to_dict().items() if k not in ("layout", "scale", "return_lse", "enable_gqa")}
    assert Config.from_dict(old) == plain


def test_unknown_dtype_lists_allowed_values() -> None:
    with pytest.raises(RecipeError, match=r"allowed: 'bfloat16', 'float16', 'float32'"):
        parse_recipe(base(**{"matrix.dtypes": ["float64"]}))


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(RecipeError, match=r"bad.toml: <toml>: not valid TOML"):
        load_recipe(bad)


def test_cli_reports_recipe_errors_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kernelpack.cli import main

    bad = tmp_path / "r.toml"
    bad.write_text(
        'name = "x"\ndevice = "cpu"\nmask = "sliding_window"\nwindows = [64]\n'
        "[matrix]\nq_heads = 2\nhead_dim = 64\nseq_len = 128\ndtypes = ['float32']\ngraphs = ['fwd+bwd']\n"
    )
    assert main(["build", str(bad), "-o", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "error: " in err and "matrix.graphs" in err and "hint: " in err and "Traceback" not in err
    assert not list(tmp_path.glob("*.kpack"))


def test_non_utf8_recipe_is_a_recipe_error(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('name = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(RecipeError, match=r"latin1\.toml: <toml>"):
        load_recipe(bad)


def test_new_call_keys_enter_the_id_only_when_set() -> None:
    """return_aux, mask_dims and alias (added after artifacts were shipped) leave the ids of configs that do not set
    them unchanged; set, each is another config. A per-batch mask of one batch element is the broadcast one."""
    plain = parse_recipe(base()).configs[0]
    legacy = {k: v for k, v in plain.to_dict().items() if k not in ("return_aux", "mask_dims", "alias")}
    assert Config.from_dict(legacy).id == plain.id
    for key, value in (("return_aux", "lse"), ("mask_dims", "per-head"), ("alias", "k=v")):
        assert parse_recipe(base(call={key: value})).configs[0].id != plain.id, key
    one = parse_recipe(base(call={"mask_dims": "per-batch+per-head"}, **{"matrix.batch": 1})).configs[0]
    assert one.mask_dims == "per-head"


@pytest.mark.parametrize(
    ("over", "key", "guess"),
    [
        ({"matrix.seq_lne": 128, "matrix.seq_len": None}, "matrix.seq_lne", "seq_len"),
        ({"descripton": "d"}, "descripton", "description"),
        ({"call": {"layuot": "bshd"}}, "call.layuot", "layout"),
        ({"matrix.dtypes": ["bfloat61"]}, "matrix.dtypes", "bfloat16"),
        ({"matrix.graphs": ["fwd+bdw"]}, "matrix.graphs", "fwd+bwd"),
        ({"mask": "sliding_windw"}, "mask", "sliding_window"),
        ({"call": {"layout": "bshdd"}}, "call.layout", "bshd"),
    ],
)
def test_typos_get_did_you_mean(over: dict, key: str, guess: str) -> None:
    with pytest.raises(RecipeError) as e:
        parse_recipe(base(**over))
    assert f": {key}: " in e.value.message
    assert e.value.hint is not None and f"did you mean {guess!r}?" in e.value.hint


def test_cli_recipe_typo_says_did_you_mean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kernelpack.cli import main

    bad = tmp_path / "r.toml"
    bad.write_text(
        'name = "x"\ndevice = "cpu"\nmask = "sliding_window"\nwindows = [64]\n'
        "[matrix]\nq_heads = 2\nhead_dim = 64\nseq_lne = 128\ndtypes = ['float32']\n"
    )
    assert main(["build", str(bad), "-o", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "error: " in err and "matrix.seq_lne" in err and "hint: did you mean 'seq_len'?" in err
    # no guess when nothing is close
    with pytest.raises(RecipeError) as e:
        parse_recipe(base(**{"matrix.zzzzzz": 1}))
    assert e.value.hint is not None and "did you mean" not in e.value.hint


def test_a_recipe_is_bounded_before_its_configs_are_made(tmp_path: Path) -> None:
    import time

    # axes of 20 values each: 20**6 = 64 million configs from a recipe of a few hundred bytes (the parser
    # was still at it after 60 s under 3 GiB)
    many = list(range(1, 21))
    start = time.perf_counter()
    with pytest.raises(RecipeError, match=r"matrix: makes 64000000 configs .* over the limit of 10000"):
        parse_recipe(
            base(
                **{
                    "windows": many,
                    "matrix.batch": many,
                    "matrix.q_heads": many,
                    "matrix.kv_heads": 1,
                    "matrix.head_dim": many,
                    "matrix.seq_len": many,
                    "matrix.dtypes": ["float32"] * 20,
                }
            )
        )
    # lengths: a list of q_len times a list of kv_len, buckets tied by offsets, and [[calls]] of buckets
    with pytest.raises(RecipeError, match=r"matrix.kv_len: makes 4096000 \(q_len, kv_len\) points"):
        parse_recipe(
            base(
                **{
                    "matrix.seq_len": None,
                    "matrix.q_len": {"min": 1, "max": 4096, "multiple": 1},
                    "matrix.kv_len": list(range(1, 1001)),
                }
            )
        )
    with pytest.raises(RecipeError, match=r"matrix.kv_len: makes 4096000 \(q_len, kv_len\) points"):
        parse_recipe(
            base(
                **{
                    "matrix.seq_len": None,
                    "matrix.q_len": {"min": 1, "max": 4096, "multiple": 1},
                    "matrix.kv_len": {"offset": list(range(1000))},
                }
            )
        )
    call = {
        "mask": "mypkg:m",
        "q_heads": 1,
        "head_dim": 64,
        "dtype": "float32",
        "seq_len": {"min": 1, "max": 4096, "multiple": 1},
    }
    with pytest.raises(RecipeError, match=r"calls\[2\]: brings the recipe to 12288 configs"):
        parse_recipe({"name": "t", "device": "cpu", "calls": [call, call, call]})
    assert time.perf_counter() - start < 5
    # the largest allowed expands
    assert (
        len(
            parse_recipe(
                base(
                    **{
                        "windows": [1, 2, 3, 4, 5],
                        "matrix.seq_len": list(range(1, 1001)),
                        "matrix.dtypes": ["float32", "bfloat16"],
                    }
                )
            ).configs
        )
        == 10_000
    )


@pytest.mark.parametrize(
    "over, key, fragment",
    [
        ({"call": {"scale": float("nan")}}, "call.scale", "positive number"),
        ({"call": {"scale": float("inf")}}, "call.scale", "positive number"),
        ({"kernel_options": {"BLOCK_M": float("inf")}}, "kernel_options.BLOCK_M", "finite"),
        ({"matrix.seq_len": 2**40}, "matrix.seq_len", "from 1 to 2147483647"),
        ({"matrix.head_dim": 2**31}, "matrix.head_dim", "from 1 to 2147483647"),
        ({"windows": [2**63]}, "windows", "from 1 to 2147483647"),
        ({"call": {"block_size": 2**32}}, "call.block_size", "from 1 to 2147483647"),
    ],
)
def test_non_finite_and_unbounded_numbers_are_refused_naming_the_key(over: dict, key: str, fragment: str) -> None:
    with pytest.raises(RecipeError) as e:
        parse_recipe(base(**over))
    assert e.value.key == key and fragment in str(e.value), str(e.value)


def test_deep_nesting_is_a_recipe_error_not_a_traceback(tmp_path: Path) -> None:
    deep = tmp_path / "deep.toml"
    deep.write_text('name = "t"\ndevice = "cpu"\nx = ' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(RecipeError, match="nested too deeply"):
        load_recipe(deep)
    closure: dict = {}
    inner = closure
    for _ in range(5000):
        inner["a"] = {}
        inner = inner["a"]
    call = {
        "mask": {"function": "mypkg:m", "closure": closure},
        "q_heads": 1,
        "head_dim": 64,
        "dtype": "float32",
        "seq_len": 128,
    }
    with pytest.raises(RecipeError, match="nested too deeply"):
        parse_recipe({"name": "t", "device": "cpu", "calls": [call]})
