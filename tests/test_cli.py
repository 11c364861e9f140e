"""The CLI as a new user meets it: up-front checks, progress, hints that match the cause, usage errors as
``error:``/``hint:`` with exit 1. Real builds and verifies on CPU; each test fails without its fix."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SMOKE

from kernelpack.cli import main
from kernelpack.errors import KernelpackError

ROOT = Path(__file__).resolve().parent.parent


def kp(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    import os

    cmd = [sys.executable, "-m", "kernelpack.cli", *args]
    env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def kp_cpu(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """:func:`kp`, and the CPU seconds its process tree spent. A "before any compile" bound holds on a machine whose
    cores other tests keep busy (pytest-xdist's other worker, CI's other stream), where a wall clock would also count
    the waits for a core: 5.9 s of wall for a refusal that spends 2 s of CPU, in CI beside two other processes."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = kp(*args)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def one_config_recipe(tmp_path: Path, extra: str = "") -> Path:
    recipe = tmp_path / "one.toml"
    recipe.write_text(
        'name = "one"\ndevice = "cpu"\nmask = "sliding_window"\nwindows = [32]\n'
        f"[matrix]\nq_heads = 2\nhead_dim = 16\nseq_len = 128\ndtypes = ['float32']\n{extra}"
    )
    return recipe


def test_a_cuda_recipe_without_cuda_fails_up_front(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc, seconds = kp_cpu("build", str(ROOT / "recipes/dflash-drafter.toml"), "-o", str(tmp_path / "out"))
    assert proc.returncode == 1 and seconds < 5, (seconds, proc.stderr)
    assert "is for CUDA, but torch" in proc.stderr and proc.stderr.count("hint: ") == 1, proc.stderr
    if torch.version.cuda is None:  # a CPU build of torch (CI's); a CUDA build without a GPU gets the driver hint
        assert "hint: build CUDA recipes on a GPU machine" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("error: ") == 1, proc.stderr
    assert not (tmp_path / "out").exists()


def test_an_unwritable_output_and_an_unimportable_factory_fail_before_any_compile(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc, seconds = kp_cpu("build", str(SMOKE), "-o", str(blocker / "out"))
    assert proc.returncode == 1 and seconds < 5, (seconds, proc.stderr)
    assert f"cannot write the artifact in {blocker / 'out'}" in proc.stderr and "is not a directory" in proc.stderr
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        'name = "r"\ndevice = "cpu"\nmask = "no_such_module_kp:factory"\nwindows = [32, 64, 96]\n'
        "[matrix]\nq_heads = 2\nhead_dim = 16\nseq_len = 128\ndtypes = ['float32']\n"
    )
    proc, seconds = kp_cpu("build", str(recipe), "-o", str(tmp_path / "out"))
    assert proc.returncode == 1 and seconds < 5, (seconds, proc.stderr)
    # once, not once per config, and before any worker ran
    assert proc.stderr.count("cannot import module 'no_such_module_kp'") == 1, proc.stderr
    assert "building" not in proc.stderr and not (tmp_path / "out").exists()


def test_build_progress_as_json_lines_and_a_timeout_that_says_so(tmp_path: Path) -> None:
    proc = kp("build", str(one_config_recipe(tmp_path)), "-o", str(tmp_path / "out"), "--progress", "jsonl")
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events] == ["start", "config_started", "config_done"], proc.stderr
    assert events[0]["total"] == 1 and events[0]["jobs"] == 1
    assert events[2]["ok"] is True and events[2]["seconds"] > 0 and events[2]["eta"] == 0
    assert "wrote " in proc.stdout
    # a worker stopped by --timeout: its FAIL line shows how long it ran, and the hint names --timeout, not
    # --keep-going (nothing built, so --keep-going would ship nothing)
    proc = kp("build", str(one_config_recipe(tmp_path)), "-o", str(tmp_path / "t"), "--timeout", "2", "--keep-going")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines()[1].startswith("started "), proc.stderr  # a log shows what compiles, as it starts
    fail = next(line for line in proc.stderr.splitlines() if "FAIL" in line)
    assert float(fail.split("FAIL", 1)[1].split("s", 1)[0]) >= 2.0, fail
    hint = next(line for line in proc.stderr.splitlines() if line.startswith("hint:"))
    assert "raise --timeout (now 2 s per config)" in hint and "pass --keep-going" not in hint, hint


def test_quiet_build_prints_only_the_result(tmp_path: Path) -> None:
    proc = kp("build", str(one_config_recipe(tmp_path)), "-o", str(tmp_path / "out"), "--quiet")
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr
    assert proc.stdout.startswith("wrote ")


def test_verify_progress_check_and_the_github_step_summary(smoke_artifact: Path, tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    proc = kp(
        "verify", str(smoke_artifact), "--check", "--progress", "plain", env={"GITHUB_STEP_SUMMARY": str(summary)}
    )
    assert proc.returncode == 0, proc.stderr
    done = [line for line in proc.stderr.splitlines() if line.startswith("[")]
    assert len(done) == 2 and all(" ok " in line for line in done), proc.stderr
    # --check shows the reference errors it computed, per config and graph
    assert "reference check" in proc.stdout and proc.stdout.count("fwd:out") == 2, proc.stdout
    table = summary.read_text()
    assert "### kernelpack verify" in table and table.count("| ok |") == 2, table
    proc = kp("verify", str(smoke_artifact), "--progress", "jsonl")
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events] == ["start", "config_done", "config_done"], proc.stderr


def test_the_eta_accounts_for_parallel_jobs() -> None:
    from kernelpack.build import Eta

    serial, parallel = Eta(5, 1), Eta(5, 4)
    for eta in (serial, parallel):
        eta.durations = [10.0]  # one config finished in 10 s, none running, 4 queued
    assert serial.left() == 40.0 and parallel.left() == 10.0


def test_the_live_display_ends_when_the_last_config_is_done(smoke_artifact: Path) -> None:
    """The live table's refresh thread and the callbacks share a lock: stopping the display under it hung."""
    import threading

    from kernelpack import artifact as art
    from kernelpack._render import BuildLive
    from kernelpack.build import ConfigOutcome

    configs = [c.config for c in art.read_manifest(smoke_artifact).configs]
    live = BuildLive()
    live.start(len(configs), 2)

    def run() -> None:
        for c in configs:
            live.config_started(c, 0)
        time.sleep(0.6)  # a refresh or two
        for c in configs:
            live.config_done(ConfigOutcome(c, True, 0, seconds=1.0))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "the live display deadlocked"
    assert live.live is None


def test_usage_errors_are_error_and_hint_with_exit_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["build", str(SMOKE), "--jobs", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: Invalid value for '-j' / '--jobs'") and "hint: see kernelpack build --help" in err
    assert main(["verify", "a.kpack", "a.shard-1-of-2.kpack"]) == 1  # what a too-wide glob expands to
    err = capsys.readouterr().err
    assert "error: Got unexpected extra argument" in err and "shell glob" in err, err
    assert main(["bulid"]) == 1
    assert "error: No such command 'bulid'" in capsys.readouterr().err
    assert main([]) == 0  # a bare `kernelpack` is a request for help, not an error
    assert "Usage: kernelpack" in capsys.readouterr().out
    # -v after the command is the group's -v (the hints say `kernelpack verify -v`): verbose mode raises the error
    # with its traceback instead of a usage error
    with pytest.raises(KernelpackError, match=r"missing\.kpack"):
        main(["verify", "-v", str(tmp_path / "missing.kpack")])


def test_a_missing_recipe_file_says_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["build", str(tmp_path / "nope.toml")]) == 1
    err = capsys.readouterr().err
    assert "recipe file not found" in err and f"hint: check the path: no file {tmp_path / 'nope.toml'}" in err, err


def test_verify_of_a_damaged_artifact_says_so_once(smoke_artifact: Path, tmp_path: Path) -> None:
    half = tmp_path / "half.kpack"
    half.write_bytes(smoke_artifact.read_bytes()[: smoke_artifact.stat().st_size // 2])
    proc, seconds = kp_cpu("verify", str(half))
    assert proc.returncode == 1 and seconds < 10, (seconds, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), proc.stderr
    assert proc.stderr.count(str(half)) == 1 and "truncated" in lines[0] and "this torch build" not in lines[1]


def test_a_factory_beside_the_recipe_passes_the_up_front_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers run as `python -m` (the working directory on sys.path), the `kernelpack` script does not have it:
    the up-front import must find what the workers will find."""
    from kernelpack.build import preflight
    from kernelpack.recipe import load_recipe

    (tmp_path / "beside_kp.py").write_text(
        "from kernelpack.masks import sliding_window\n\ndef make(config):\n    return sliding_window(32)\n"
    )
    recipe = one_config_recipe(tmp_path).read_text().replace('"sliding_window"', '"beside_kp:make"')
    (tmp_path / "one.toml").write_text(recipe)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    r = load_recipe(tmp_path / "one.toml")
    try:
        preflight(r, r.configs, [0], tmp_path / "out")
    finally:
        sys.modules.pop("beside_kp", None)
    assert str(tmp_path) not in sys.path  # put back as it was


def test_a_worker_is_killed_when_its_parent_stops_polling(tmp_path: Path) -> None:
    """_worker.run with on_event polls; a callback that raises (a closed pipe under `| head`) must not leave the
    worker running, and a timeout still stops it."""
    import os

    from kernelpack import _worker

    (tmp_path / "slow_kp.py").write_text(
        "import os, sys, time\nfrom kernelpack import _worker\n\n"
        "def work(payload):\n"
        "    open(payload['pid'], 'w').write(str(os.getpid()))\n"
        "    _worker.emit({'event': 'start'})\n"
        "    time.sleep(60)\n    return {}\n\n"
        "if __name__ == '__main__':\n    sys.exit(_worker.child_main(work, sys.argv[1:]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}

    def boom(event: dict) -> None:
        raise BrokenPipeError("stdout closed")

    pid_file = tmp_path / "pid"
    with pytest.raises(BrokenPipeError):
        _worker.run("slow_kp", {"pid": str(pid_file)}, workdir=tmp_path / "w", env=env, timeout=120, on_event=boom)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
    events: list[dict] = []
    start = time.perf_counter()
    outcome = _worker.run(
        "slow_kp", {"pid": str(pid_file)}, workdir=tmp_path / "w2", env=env, timeout=3, on_event=events.append
    )
    assert outcome.error is not None and "timed out after 3 s" in outcome.error and time.perf_counter() - start < 30
    assert events == [{"event": "start"}]
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_hostile_options_and_paths_are_refused_before_any_work(
    smoke_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Options without ranges failed late (``--level`` at pack time, after compiling everything) or
    meant something else (a nan ``--timeout``: none); ``ls`` of a file listed nothing, exit 0; hints named options
    and targets the command does not have. Each is refused at once here, in the error:/hint: form."""
    out = tmp_path / "out"
    for argv, fragment in (
        (["build", str(SMOKE), "-o", str(out), "--level", "99"], "'--level': 99 is not in the range 1<=x<=22"),
        (["build", str(SMOKE), "-o", str(out), "--level", "0"], "'--level': 0 is not in the range"),
        (["build", str(SMOKE), "-o", str(out), "--timeout", "nan"], "nan is not a number of seconds"),
        (["build", str(SMOKE), "-o", str(out), "--timeout", "inf"], "'--timeout': inf is not in the range"),
        (["build", str(SMOKE), "-o", str(out), "--timeout", "0"], "'--timeout': 0.0 is not in the range"),
        (["install", str(smoke_artifact), "--device-index", "-1"], "'--device-index': -1 is not in the range"),
    ):
        start = time.process_time()  # this process's CPU: what a core busy with another test does not inflate
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert fragment in err and err.startswith("error: ") and "hint: " in err, (argv, err)
        assert time.process_time() - start < 5 and not out.exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["ls", str(afile)]) == 1
    assert "is a file, not a registry directory" in capsys.readouterr().err
    assert main(["inspect", str(afile)]) == 1
    err = capsys.readouterr().err
    assert "corrupt or truncated" in err and "cache" not in err  # inspect has no target to leave untouched
    reg = tmp_path / "reg"
    assert main(["push", str(smoke_artifact), str(reg)]) == 0
    recipe = json.loads(kp("inspect", str(smoke_artifact), "--json").stdout)["recipe"]["name"]
    capsys.readouterr()
    typo = recipe[:-1] + "x"
    for command in (["pull", str(reg), "--recipe", typo], ["lock", str(reg), "--recipe", typo, "-o", "k.lock"]):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert f"did you mean {recipe!r}?" in err and f"the registry's recipes: {recipe!r}" in err, err
    # what the filesystem says reaches the user as an error and a hint, never a traceback
    long = tmp_path / ("b" * 300 + ".toml")
    for argv in (["build", str(long)], ["record", "-o", str(long), "--", "true"], ["inspect", str(long)],
                 ["lock", str(reg), "--recipe", recipe, "-o", str(long)]):  # fmt: skip
        r = kp(*argv)
        assert r.returncode == 1 and "File name too long" in r.stderr and "Traceback" not in r.stderr, r.stderr
