"""The typed JSON records (kernelpack.records): each reads back what it writes, computes what the old dicts stored,
and refuses a malformed record naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernelpack.errors import KernelpackError
from kernelpack.records import (
    BuiltFunction,
    GraphTier,
    Lock,
    Pin,
    RecordedCall,
    RecordNote,
    RecordProblem,
    VerifiedConfig,
    VerifyReport,
    WorkerResult,
    record_event,
)
from kernelpack.store import read_lock


def _verified(id: str, *, reasons: tuple[str, ...] = (), precompiled: bool = True) -> VerifiedConfig:
    tier = GraphTier("precompiled", "", 0.25, True, 0.0) if precompiled else GraphTier("inductor-cache", "no function")
    return VerifiedConfig(
        id=id,
        device="cpu",
        describe=f"{id} [cpu]",
        seconds=0.5,
        errors={"fwd": 1e-6},
        counters={"inductor.fxgraph_cache_hit": 1, "inductor.fxgraph_cache_miss": int(bool(reasons))},
        lengths=((300, 300), (511, 511)),
        tiers={"fwd": tier},
        reasons=reasons,
    )


def test_a_verify_report_reads_back_what_it_writes_and_sums_its_configs() -> None:
    report = VerifyReport(
        artifact="/a/smoke.kpack",
        seed=7,
        configs=(_verified("aaa"), _verified("bbb", reasons=("1 FX-graph miss",), precompiled=False)),
        torch_version="2.13.0+cpu",
        torch_git="0123456789abcdef",
        triton_detection="not installed",
        install_seconds=0.1,
        installed_files=12,
    )
    d = json.loads(json.dumps(report.to_dict()))  # through JSON, as it crosses from verify's fresh process
    assert VerifyReport.from_dict(d) == report
    assert d["totals"] == {"inductor.fxgraph_cache_hit": 2, "inductor.fxgraph_cache_miss": 1}
    assert d["precompiled"] == 1 and d["first_step_seconds"] == 1.0
    assert [c.id for c in report.failures] == ["bbb"]
    assert d["configs"][1]["tiers"] == {"fwd": {"tier": "inductor-cache", "why": "no function"}}
    assert d["configs"][0]["tiers"]["fwd"] == {"tier": "precompiled", "seconds": 0.25, "equal": True, "rel_error": 0.0}


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda d: d.pop("seed"), "seed"),
        (lambda d: d["configs"][0].update(seconds="fast"), "seconds"),
        (lambda d: d["configs"][0]["tiers"]["fwd"].update(tier="tier-3"), "tier"),
        (lambda d: d["configs"][0].update(lengths=[[1, 2, 3]]), "lengths"),
        (lambda d: d["configs"][0].update(reasons="compiled"), "reasons"),
        (lambda d: d["configs"][0]["counters"].update(frames=True), "counters"),
    ],
)
def test_a_malformed_verify_report_is_refused_naming_the_field(edit: object, named: str) -> None:
    d = VerifyReport("a", 1, (_verified("aaa"),), "2.13.0", "", "", 0.0, 0).to_dict()
    edit(d)  # type: ignore[operator]
    with pytest.raises((TypeError, ValueError, KeyError), match=named):
        VerifyReport.from_dict(d)


def test_a_worker_result_reads_back_what_it_writes() -> None:
    result = WorkerResult(
        seconds=1.5,
        errors={"fwd": 2e-7, "fwd+bwd": 3e-6},
        counters={"inductor.fxgraph_cache_miss": 2},
        build_key={"torch_version": "2.13.0"},
        mask_key="sliding_window(w=64)",
        mask_free=("S",),
        marks=("q_len",),
        score_key="identity",
        key_settings={"inductor.max_autotune": "False"},
        problem="",
        functions={"fwd": BuiltFunction("kernelpack-precompiled/x.bin", "ab" * 32, 0.4)},
        missing="fwd+bwd on device 0: aot_compile failed: ...",
    )
    assert WorkerResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    # an early refusal (rows_guaranteed_safe) carries only its problem and build key
    early = WorkerResult.from_dict(WorkerResult(problem="NaN rows", build_key={"k": "v"}).to_dict())
    assert early.problem == "NaN rows" and early.functions == {} and early.seconds == 0.0
    bad = result.to_dict()
    bad["precompiled"]["graphs"]["fwd"]["sha256"] = 5
    with pytest.raises(TypeError, match="sha256"):
        WorkerResult.from_dict(bad)


def test_a_lock_reads_back_what_it_writes_and_refuses_a_malformed_pin(tmp_path: Path) -> None:
    lock = Lock("s3://team/registry", "smoke-cpu", (Pin("k1", {"torch_version": "2.13.0"}, "p/a.kpack", "ab", 10),))
    path = tmp_path / "kernelpack.lock"
    path.write_text(json.dumps(lock.to_dict()))
    assert read_lock(path) == lock and lock.pinned("k1") == lock.pins[0] and lock.pinned("k2") is None
    for edit, named in (
        (lambda d: d["artifacts"][0].update(sha256=None), "sha256"),
        (lambda d: d["artifacts"].append(dict(d["artifacts"][0])), "pinned twice"),
        (lambda d: d.update(format=2), "unsupported lock format 2"),
    ):
        d = lock.to_dict()
        edit(d)
        path.write_text(json.dumps(d))
        with pytest.raises(KernelpackError, match="not a kernelpack lock file") as e:
            read_lock(path)
        assert named in str(e.value), str(e.value)


def test_record_events_read_back_what_they_write_and_a_malformed_one_is_refused(tmp_path: Path) -> None:
    """The events a recording process writes, one JSON line each, and what `kernelpack record` reads of them: a line
    cut short by a killed process is skipped, a line of another shape is refused naming the file and line."""
    from kernelpack.errors import RecordError
    from kernelpack.record import read_events

    events = [
        RecordedCall("[cpu sliding_window(64) ...]", "kernelpack.flex_attention", "job.py:12", {"q_len": 256}, None),
        RecordedCall("[cuda ...]", "torch.compile(flex_attention)", None, {"q_len": 512}, 3),
        RecordProblem("[cpu ...]", "kernelpack.flex_attention", "job.py:20", "a mask record cannot rebuild", "a hint"),
        RecordNote("an eager flex_attention call at job.py:30 ran the dense math path"),
    ]
    for e in events:
        assert record_event(json.loads(json.dumps(e.to_dict()))) == e
    assert events[1].seen == "torch.compile(flex_attention) at an unknown site"
    lines = [json.dumps(e.to_dict()) for e in events]
    (tmp_path / "calls-1.jsonl").write_text("\n".join(lines) + "\n" + lines[0][:17] + "\n")  # the last cut short
    assert read_events(tmp_path) == events
    for bad, named in [
        ({"call": {"path": "p", "config": {}, "device_index": "0"}}, "device_index"),
        ({"call": {"config": {}}}, "path"),
        ({"problem": {"path": "p"}}, "reason"),
        ({"other": 1}, "call, problem, note"),
        ({"call": {"path": "p", "config": []}}, "config"),
    ]:
        with pytest.raises((TypeError, KeyError), match=named):
            record_event(bad)
        (tmp_path / "calls-2.jsonl").write_text(json.dumps(bad) + "\n")
        with pytest.raises(RecordError, match=r"calls-2\.jsonl:1 is not an event"):
            read_events(tmp_path)
