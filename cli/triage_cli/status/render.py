"""`triage status`'s report for people: the partitions' table, the push targets' table
and the notes under them (pure; the command prints what these return). Fits 80 columns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from triage_cli.status.report import Report

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table


def _n(value: Any) -> str:
    return "-" if value is None else str(value)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


PROXY_STYLES = {"running": "green", "down": "bold red", "standby": "yellow"}


def render_table(report: Report) -> Table:
    """The report as a rich table (pure; the caller prints it). Fits 80 columns."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title=f"{report.topic}  (group {report.group_id})  {report.generated_at}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    for name in (
        "part",
        "proxy",
        "committed",
        "log\nend",
        "lag",
        "in\nflight",
        "inst-\nances",
        "oldest\nunsettled",
        "dead\nletters",
    ):
        table.add_column(name, justify="left" if name == "proxy" else "right", no_wrap=True)
    writing = False
    for row in report.partitions:
        state = row["proxy"]
        dead = _n(row["dead_letters_pending"])
        if row["dead_letters_writing"]:
            dead += f" (+{row['dead_letters_writing']})"
            writing = True
        table.add_row(
            str(row["partition"]),
            Text(state, style=PROXY_STYLES.get(state, "")),
            _n(row["committed_offset"]),
            _n(row["log_end_offset"]),
            Text(_n(row["lag"]), style="bold" if row["lag"] else ""),
            _n(row["in_flight"]),
            _n(row["connected_instances"]),
            _age(row["oldest_unsettled_age_s"]),
            dead,
        )
    notes = []
    if not report.deployed:
        notes.append(not_deployed_note(report))
    unserved = unserved_note(report)
    if unserved:
        notes.append(unserved)
    endpoints = [
        f"{row['partition']} {row['endpoint']}" for row in report.partitions if row.get("endpoint")
    ]
    if endpoints:
        notes.append(f"endpoints (partition host:port): {', '.join(endpoints)}")
    notes.extend(served_by_notes(report.partitions))
    if writing:
        notes.append("dead letters (+n): n more the proxy is still writing")
    if report.broker_error:
        notes.append(f"broker: {report.broker_error}")
    if report.dead_letters_error:
        notes.append(f"dead letters: {report.dead_letters_error}")
    if report.legacy_partitions:
        from triage_proxy.store.migrate import legacy_warning

        notes.append(
            "warning: " + legacy_warning(report.topic, report.legacy_partitions, report.config)
        )
    for row in report.partitions:
        notes.extend(down_notes(row, deployed=report.deployed))
        notes.extend(degraded_notes(row))
    if report.deployed:
        named = {row["proxy_url"] for row in report.partitions}
        notes.extend(
            f"process {row['url']} down: {row['error']}"
            for row in report.processes
            if row["state"] == "down" and row["url"] not in named
        )
    if notes:
        table.caption = "\n".join(notes)
        table.caption_justify = "left"
    return table


def _latency(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    return f"{seconds:g}s"


def _counts(counts: Mapping[str, int] | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted((counts or {}).items()) if v) or "-"


def render_push_table(report: Report) -> Table | None:
    """The push targets, one row per target per process (pure); None when there are none.
    Latencies are bucket bounds (p50/p99 of the round trips that got an answer). The state
    column holds its first word ("ok", "outage", ...); why a target waits, in full, is a
    note under the table, so the table fits 80 columns."""
    if not report.push:
        return None
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title="push targets",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    for name in ("target", "part", "state", "limit", "in\nflight", "p50", "p99", "errors"):
        left = name in ("target", "state")
        table.add_column(name, justify="left" if left else "right", no_wrap=True)
    table.add_column("responses")
    notes: list[str] = []
    for row in report.push:
        state = str(row.get("state", "-"))
        parts = ",".join(str(p) for p in row.get("partitions") or []) or "-"
        if state != "ok":
            notes.append(f"{row.get('name')} (partitions {parts}): {state}")
        table.add_row(
            str(row.get("name")),
            parts,
            Text(state.split(":", 1)[0], style="green" if state == "ok" else "bold yellow"),
            _n(row.get("limit")),
            _n(row.get("in_flight")),
            _latency(row.get("latency_p50_s")),
            _latency(row.get("latency_p99_s")),
            Text(_n(row.get("errors")), style="bold red" if row.get("errors") else ""),
            _counts(row.get("responses")),
        )
    if notes:
        table.caption = "\n".join(notes)
        table.caption_justify = "left"
    return table


def render_report(report: Report) -> RenderableType:
    """What the command prints: the partitions, then the push targets when there are any."""
    from rich.console import Group

    push = render_push_table(report)
    table = render_table(report)
    return table if push is None else Group(table, "", push)


def served_by_notes(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Which process serves which partitions, one line per process (pure); nothing when
    every process serves one partition (the layout of one process per partition)."""
    by: dict[tuple[Any, Any], list[int]] = {}
    for row in rows:
        served = row.get("served_by")
        if served and row["proxy"] == "running":
            by.setdefault((served.get("pid"), served.get("endpoint")), []).append(row["partition"])
    if all(len(parts) == 1 for parts in by.values()):
        return []
    return [
        f"process pid {pid} ({endpoint}) serves partitions {', '.join(map(str, parts))}"
        for (pid, endpoint), parts in sorted(by.items(), key=lambda kv: kv[1])
    ]


def degraded_notes(row: Mapping[str, Any]) -> list[str]:
    """What a row's proxy reports as degraded, in words (pure); unwritable dead letters
    name their offset and the fix."""
    partition = row["partition"]
    notes: list[str] = []
    others = [part for part in row.get("degraded", []) if part != "dead_letters_unwritable"]
    if others:
        notes.append(f"partition {partition} degraded: {', '.join(others)} (retrying)")
    count = row.get("dead_letters_unwritable") or 0
    shown = row.get("unwritable_dead_letters", [])
    if count and shown:
        first = shown[0]
        more = f" (and {count - 1} more)" if count > 1 else ""
        notes.append(
            f"partition {partition}: the dead letter at offset {first['offset']}{more} cannot "
            f"be written ({first['size']:,} bytes, over the {first['limit']:,} item limit); "
            f"the commit cannot pass it. Fix: {first['fix']}"
        )
    return notes


def not_deployed_note(report: Report) -> str:
    """The plain sentence for a deployment no process of which answers (pure)."""
    note = (
        f"nothing is deployed for group {report.group_id!r} (topic {report.topic!r}, table "
        f"{report.table!r}): no proxy of this deployment answers (or every one is down). "
        f"Start it with `triage deploy --config {report.config}`"
    )
    if report.foreign:
        note += "; the ports answer for another deployment: " + "; ".join(report.foreign)
    return note


JOINING_STATES = ("new", "starting")
"""Process states (`/status` `state`) of a fleet process that has not yet joined its group."""


def unserved_note(report: Report) -> str | None:
    """Why partitions are down while this deployment's processes answer (pure): they
    serve none of them. In a fleet a process that lost its group session (`member`
    false: the broker was unreachable for the session timeout) drains every partition and
    rejoins once the broker answers; that is a broker outage, not a missing deployment,
    and the note says so. When none answers but the supervisor is alive, the note says
    that. None when no partition is down for want of a serving process."""
    down = [
        row["partition"]
        for row in report.partitions
        if row["proxy"] == "down" and row["proxy_url"] is None and row["proxy_error"]
    ]
    answering = report.answering
    if down and not answering and report.supervisor_pid is not None:
        return (
            f"partition(s) {', '.join(map(str, down))} not served: the supervisor (pid "
            f"{report.supervisor_pid}) of this deployment is alive, but none of its processes "
            f"answers /status"
        )
    if not down or not answering:
        return None
    outside = [row for row in answering if row.get("member") is False]
    # A process that has not started yet (a restarted one, joining the group) is not one
    # that lost its session: that would send the reader after a broker outage.
    joining = [row for row in outside if row.get("state") in JOINING_STATES]
    lost = [row for row in outside if row.get("state") not in JOINING_STATES]
    parts = ", ".join(map(str, down))
    note = (
        f"partition(s) {parts} not served, though {len(answering)} process(es) of this "
        f"deployment answer"
    )
    if joining:
        pids = ", ".join(str(row.get("pid")) for row in joining)
        note += (
            f"; {len(joining)} (pid {pids}) started and is joining the consumer group: "
            f"partitions move to it once the group assigns them and their leases lapse"
        )
    if lost:
        pids = ", ".join(str(row.get("pid")) for row in lost)
        note += (
            f"; {len(lost)} (pid {pids}) lost the consumer group session and serve "
            f"nothing until they rejoin"
        )
    if report.broker_error:
        note += f"; the broker is unreachable ({report.broker_error}): they rejoin once it answers"
    return note


def down_notes(row: Mapping[str, Any], *, deployed: bool) -> list[str]:
    """Why a row's partition is down, in words (pure). Pinned, a partition's proxy is its
    slot's process, named with its URL; in a fleet no one process is a partition's. When
    nothing is deployed `not_deployed_note` says it once, not a line per partition."""
    if row["proxy"] != "down" or not deployed:
        return []
    if row["proxy_url"] is None:
        return [f"partition {row['partition']} down: {row['proxy_error']}"]
    return [f"proxy {row['partition']} down ({row['proxy_url']}): {row['proxy_error']}"]
