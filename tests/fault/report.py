"""A fault-suite run's report: what happened, what verification found, the table and
the PASS/FAIL targets printed at the end.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.fault.processes import FaultRecord
from tests.fault.scenario import BEHAVIOURS, LABELS, Options

RATIO_TARGET = 5.0
EXPECTED_CAUSES = ("retry", "own crash", "deadline")
FAULT_CAUSES = ("proxy kill", "proxy exit", "consumer kill", "crash collateral", "other")


@dataclass
class Report:
    """What one run did and what the verification found."""

    options: Options
    work_dir: Path
    produced: int = 0
    behaviour_counts: dict[str, int] = field(default_factory=dict)
    faults: list[FaultRecord] = field(default_factory=list)
    proxy_kills: int = 0
    consumer_kills: int = 0
    outages: list[str] = field(default_factory=list)
    instance_crashes: int = 0
    unexpected_proxy_exits: list[str] = field(default_factory=list)
    lease_losses: list[str] = field(default_factory=list)
    """Proxy exits because the lease lapsed in a DynamoDB outage (expected; restarted)."""
    proxy_exits: list[float] = field(default_factory=list)
    """When the suite saw the proxy exit on its own (either kind above), unix time."""
    committed: int = -1
    end_offset: int = 0
    unfinished: str = ""
    """Why the run ended before the committed offset reached the end (empty: it did)."""
    wall_s: float = 0.0
    acked: int = 0
    dead_lettered: int = 0
    dead_by_behaviour: dict[str, int] = field(default_factory=dict)
    lost: list[int] = field(default_factory=list)
    unfinished_offsets: int = 0
    """Offsets at or above the committed offset still unsettled when the run stopped."""
    collateral: list[str] = field(default_factory=list)
    """Dead letters of messages whose behaviour never asked for it (attempts used up)."""
    started_at: float = 0.0
    lost_detail: list[str] = field(default_factory=list)
    crash_pills: int = 0
    crash_pills_ok: int = 0
    crash_detail: list[str] = field(default_factory=list)
    not_exact: list[int] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    produce_errors: list[str] = field(default_factory=list)
    torn_lines: int = 0
    invocations: int = 0
    unique_offsets: int = 0
    causes: Counter[str] = field(default_factory=Counter)
    duplicates_by_cause: Counter[str] = field(default_factory=Counter)
    per_kill: Counter[int] = field(default_factory=Counter)
    """Duplicates attributed to each proxy kill, by its index in time order."""

    @property
    def duplicates(self) -> int:
        return sum(self.duplicates_by_cause.values())

    @property
    def per_proxy_kill(self) -> float:
        """NaN without proxy kills."""
        kills = self.proxy_kills
        return self.duplicates_by_cause["proxy kill"] / kills if kills else math.nan

    @property
    def per_consumer_kill(self) -> float:
        kills = self.consumer_kills
        return self.duplicates_by_cause["consumer kill"] / kills if kills else math.nan

    @property
    def correct(self) -> bool:
        """Nothing lost, crash pills exact, dead letters exact, every record accounted."""
        return (
            not self.lost
            and not self.unfinished
            and self.crash_pills_ok == self.crash_pills
            and not self.not_exact
            and not self.mismatched
            and not self.produce_errors
        )


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return "inf" if math.isinf(value) else f"{value:.1f}"


def rows(report: Report) -> list[tuple[str, str]]:
    o = report.options
    counts = report.behaviour_counts
    mix = " / ".join(f"{counts.get(b, 0)} {LABELS.get(b, b)}" for b in BEHAVIOURS)
    dead = ", ".join(f"{n} {LABELS.get(b, b)}" for b, n in report.dead_by_behaviour.items())
    by_cause = report.duplicates_by_cause
    return [
        ("commit.encode_settled", "on" if o.encode_settled else "off"),
        ("messages produced", f"{report.produced} of {o.messages}"),
        ("  behaviours", mix),
        ("proxy kills (SIGKILL + restart)", str(report.proxy_kills)),
        ("consumer kills (SIGKILL)", str(report.consumer_kills)),
        ("instance crashes (crash pills)", str(report.instance_crashes)),
        ("outages (SIGSTOP)", f"{', '.join(report.outages) or 'none'} ({o.outage_s:g} s each)"),
        ("unexpected proxy exits", str(len(report.unexpected_proxy_exits))),
        ("lease lost in the DynamoDB outage (exit 3)", str(len(report.lease_losses))),
        ("committed offset / end", f"{report.committed} / {report.end_offset}"),
        ("acked (handler completed)", str(report.acked)),
        ("dead-lettered", f"{report.dead_lettered} ({dead or 'none'})"),
        ("lost", str(len(report.lost))),
        ("unsettled when the run stopped", str(report.unfinished_offsets)),
        ("dead-lettered though not asked", str(len(report.collateral))),
        ("crash pills ok (attempts == max)", f"{report.crash_pills_ok} / {report.crash_pills}"),
        ("dead letters not byte-exact", str(len(report.not_exact))),
        ("records not as produced", str(len(report.mismatched))),
        ("handler invocations / offsets", f"{report.invocations} / {report.unique_offsets}"),
        (
            "expected redeliveries",
            ", ".join(f"{report.causes[c]} {c}" for c in EXPECTED_CAUSES),
        ),
        ("duplicates", str(report.duplicates)),
        (
            "  by cause",
            ", ".join(f"{by_cause[c]} {c}" for c in FAULT_CAUSES),
        ),
        (
            "duplicates per proxy kill",
            f"{_fmt(report.per_proxy_kill)} (in-flight window {o.in_flight_window})",
        ),
        ("duplicates per consumer kill", _fmt(report.per_consumer_kill)),
        ("wall time", f"{report.wall_s:.1f} s"),
        ("finished", report.unfinished or "committed offset reached the end"),
    ]


def render(reports: list[Report]) -> str:
    table = [rows(r) for r in reports]
    names = [name for name, _ in table[0]]
    width = max(len(n) for n in names)
    cols = [max(len(v) for _, v in t) for t in table]
    lines = []
    for i, name in enumerate(names):
        cells = [f"{t[i][1]:<{w}}" for t, w in zip(table, cols, strict=True)]
        lines.append(f"  {name:<{width}}  " + "  |  ".join(cells).rstrip())
    return "\n".join(lines)


def checks(reports: list[Report]) -> list[tuple[str, bool, bool]]:
    """(description, passed, is a correctness check) for every target."""
    out: list[tuple[str, bool, bool]] = []
    for r in reports:
        tag = f"[encode {'on' if r.options.encode_settled else 'off'}]"
        out.append((f"{tag} lost == 0 (lost {len(r.lost)})", not r.lost, True))
        out.append(
            (f"{tag} committed offset reached the end {r.unfinished}", not r.unfinished, True)
        )
        out.append(
            (
                f"{tag} every crash pill dead-lettered with attempts == {r.options.max_attempts}",
                r.crash_pills_ok == r.crash_pills,
                True,
            )
        )
        out.append(
            (
                f"{tag} no healthy message dead-lettered ({len(r.collateral)})",
                not r.collateral,
                True,
            )
        )
        out.append((f"{tag} dead letters byte-exact", not r.not_exact, True))
        out.append(
            (
                f"{tag} the proxy never exited on its own, but for a lease lost in the "
                f"DynamoDB outage ({len(r.unexpected_proxy_exits)})",
                not r.unexpected_proxy_exits,
                True,
            )
        )
        out.append(
            (
                f"{tag} every record delivered as produced",
                not r.mismatched and not r.produce_errors,
                True,
            )
        )
        if r.options.encode_settled:
            out.append(
                (
                    f"{tag} duplicates per proxy kill {_fmt(r.per_proxy_kill)} <= in-flight "
                    f"window {r.options.in_flight_window}",
                    not r.unfinished and r.per_proxy_kill <= r.options.in_flight_window,
                    False,
                )
            )
    on = [r for r in reports if r.options.encode_settled]
    off = [r for r in reports if not r.options.encode_settled]
    if on and off:
        a, b = off[0].per_proxy_kill, on[0].per_proxy_kill
        ratio = a / b if b else (math.inf if a else math.nan)
        if off[0].unfinished or on[0].unfinished:
            ratio = math.nan
        out.append(
            (
                f"duplicates per proxy kill without / with the encoding = {_fmt(a)} / "
                f"{_fmt(b)} = {_fmt(ratio)}x >= {RATIO_TARGET:g}x",
                ratio >= RATIO_TARGET,
                False,
            )
        )
    return out


def details(report: Report) -> Iterator[str]:
    tag = f"[encode {'on' if report.options.encode_settled else 'off'}]"
    yield f"{tag} logs: {report.work_dir}"
    for line in report.lost_detail:
        yield f"{tag} lost {line}"
    for line in report.collateral[:10]:
        yield f"{tag} dead-lettered though not asked: {line}"
    for line in report.crash_detail:
        yield f"{tag} crash pill {line}"
    for line in report.mismatched[:10]:
        yield f"{tag} mismatch: {line}"
    for line in report.produce_errors:
        yield f"{tag} produce error: {line}"
    if report.proxy_kills:
        each = ", ".join(str(report.per_kill[i]) for i in range(report.proxy_kills))
        yield f"{tag} duplicates of each proxy kill, in order: {each}"
    for line in report.unexpected_proxy_exits:
        yield f"{tag} proxy exited on its own: {line}"
    if report.torn_lines:
        yield f"{tag} {report.torn_lines} torn log lines skipped"
    start = report.started_at
    timeline = ", ".join(
        f"{r.kind}@{r.started - start:.1f}s({r.ended - r.started:.1f}s)" for r in report.faults
    )
    yield f"{tag} faults: {timeline}"
