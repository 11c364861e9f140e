"""How the CLI shows the progress of ``build`` and ``verify``: a live table on a terminal (rich, imported only when
one is shown), plain lines in logs, JSON lines for CI (``--progress=jsonl``), or nothing (``--quiet``). The library
reports through callbacks (:class:`kernelpack.build.BuildProgress`, :class:`kernelpack.verify.VerifyProgress`) and
never prints; only the CLI imports this module. Everything goes to stderr: stdout keeps the command's result.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from .build import BuildLines, ConfigOutcome, hms
from .build import BuildProgressBase as _BuildBase
from .config import Config
from .records import VerifiedConfig, VerifyReport
from .verify import VerifyProgress

MODES = ("auto", "live", "plain", "jsonl", "none")


def _mode(mode: str) -> str:
    return ("live" if sys.stderr.isatty() else "plain") if mode == "auto" else mode


class BuildJsonl(_BuildBase):
    """One JSON object per event, for CI logs and tools."""

    def _emit(self, **event: Any) -> None:
        event["elapsed"] = round(time.perf_counter() - self.t0, 3)
        click.echo(json.dumps(event), err=True)

    def _start(self, total: int, jobs: int) -> None:
        self._emit(event="start", total=total, jobs=jobs)

    def _config_started(self, config: Config, device_index: int) -> None:
        self._emit(event="config_started", id=config.id, device=device_index, describe=config.describe())

    def _config_done(self, outcome: ConfigOutcome, seconds: float) -> None:
        left = self.eta.left()
        self._emit(
            event="config_done",
            id=outcome.config.id,
            device=outcome.device_index,
            ok=outcome.ok,
            seconds=round(seconds, 3),
            message=outcome.message,
            done=self.done,
            total=self.eta.total,
            eta=None if left is None else round(left, 1),
        )


class BuildLive(_BuildBase):
    """A table that rich redraws in place: every config's state, elapsed time and the ETA."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[tuple[str, int], list[Any]] = {}  # key -> [describe, state, seconds or start time]
        self.live: Any = None

    def __rich__(self) -> Any:
        from rich.table import Table

        now = time.perf_counter()
        with self.lock:
            table = Table(
                title=f"building {self.eta.total} config(s), {self.eta.jobs} at a time: {self.done} done, "
                f"elapsed {hms(now - self.t0)}, eta {self._eta()}",
                title_justify="left",
                box=None,
            )
            table.add_column("state")
            table.add_column("time", justify="right")
            table.add_column("config")
            # running first, then failures, then the finished: a table taller than the terminal loses its bottom
            order = {"running": 0, "FAIL": 1, "ok": 2}
            for describe, state, t in sorted(self.rows.values(), key=lambda r: order.get(r[1], 3)):
                seconds = now - t if state == "running" else t
                style = {"ok": "green", "FAIL": "bold red", "running": "yellow"}.get(state, "dim")
                table.add_row(f"[{style}]{state}[/]", "" if state == "queued" else f"{seconds:.1f}s", describe)
        return table

    def _start(self, total: int, jobs: int) -> None:
        from rich.console import Console
        from rich.live import Live

        self.live = Live(self, console=Console(stderr=True), refresh_per_second=4)
        self.live.start()

    def _config_started(self, config: Config, device_index: int) -> None:
        self.rows[(config.id, device_index)] = [config.describe(), "running", time.perf_counter()]

    def _config_done(self, outcome: ConfigOutcome, seconds: float) -> None:
        self.rows[(outcome.config.id, outcome.device_index)] = [
            outcome.config.describe(),
            "ok" if outcome.ok else "FAIL",
            seconds,
        ]

    def close(self) -> None:
        live, self.live = self.live, None
        if live is not None:
            live.stop()


def build_progress(mode: str) -> _BuildBase:
    return {"live": BuildLive, "plain": BuildLines, "jsonl": BuildJsonl, "none": _BuildBase}[_mode(mode)]()


def _tiers(config: VerifiedConfig) -> str:
    return ", ".join(f"{g} {t.tier}" for g, t in config.tiers.items())


class VerifyRender(VerifyProgress):
    """Plain lines (``plain``), JSON lines (``jsonl``) or nothing (``none``) per verified config; a terminal gets
    the same lines, redrawn under a live status line."""

    def __init__(self, mode: str) -> None:
        self.mode, self.t0, self.total, self.done = _mode(mode), time.perf_counter(), 0, 0
        self.status: Any = None

    def start(self, total: int) -> None:
        self.total = total
        if self.mode == "jsonl":
            click.echo(json.dumps({"event": "start", "total": total}), err=True)
        elif self.mode == "plain":
            click.echo(f"verifying {total} config(s) in a fresh process", err=True)
        elif self.mode == "live":
            from rich.console import Console

            self.status = Console(stderr=True).status(f"verifying {total} config(s) in a fresh process")
            self.status.start()

    def config_done(self, config: VerifiedConfig) -> None:
        self.done += 1
        ok = config.ok
        elapsed = time.perf_counter() - self.t0
        if self.mode == "jsonl":
            event = {"event": "config_done", "id": config.id, "ok": ok, "seconds": round(config.seconds, 3)}
            click.echo(json.dumps({**event, "reasons": list(config.reasons), "elapsed": round(elapsed, 3)}), err=True)
            return
        if self.mode == "none":
            return
        line = (
            f"[{self.done}/{self.total}] {'ok  ' if ok else 'FAIL'} {config.seconds:6.2f}s {config.describe} "
            f"({_tiers(config)})" + ("" if ok else f": {', '.join(config.reasons)}")
        )
        if self.status is not None:
            self.status.console.print(line, markup=False, highlight=False)
            self.status.update(f"verified {self.done} of {self.total} config(s), elapsed {hms(elapsed)}")
        else:
            click.echo(line, err=True)

    def close(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def step_summary(path: str, report: VerifyReport, artifact: str) -> None:
    """verify's per-config table for GitHub Actions' job summary ($GITHUB_STEP_SUMMARY: appended Markdown)."""
    lines = [
        f"### kernelpack verify: `{artifact}`",
        "",
        f"{len(report.configs)} config(s), {report.precompiled} graph(s) served by precompiled functions, "
        f"torch {report.torch_version} (`{report.torch_git[:12]}`)",
        "",
        "| config | first call (s) | tiers | result |",
        "|---|---|---|---|",
    ]
    for c in report.configs:
        result = "ok" if c.ok else "FAIL: " + "; ".join(c.reasons)
        lines.append(f"| {c.describe} | {c.seconds:.2f} | {_tiers(c)} | {result.replace('|', '/')} |")
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n\n")
