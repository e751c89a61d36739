"""What `triage dlq` prints: the dead-letter table, one dead letter (text or JSON),
the replay and indexing summaries, and one JSON object per line for --json."""

from __future__ import annotations

import json
from typing import Any

import typer


def show_selection(items: list[dict[str, Any]], json_: bool, would_be: str) -> None:
    """What a --dry-run selected: one JSON line per item, or a table."""
    from triage_cli.render import item_summary

    if json_:
        for item in items:
            json_line(item_summary(item))
    else:
        print_table(items, f"{len(items)} dead letters would be {would_be}")


def print_table(items: list[dict[str, Any]], title: str) -> None:
    """The table on stdout: cut to the terminal's width in a terminal; whole cells, each
    line as long as it needs, when stdout is a file or a pipe (`grep`, `less`, a log)."""
    from rich.console import Console

    console = Console(highlight=False)
    full = not console.is_terminal
    if full:
        console = Console(highlight=False, width=UNCUT_WIDTH)
    console.print(dead_letter_table(items, title, full=full))


UNCUT_WIDTH = 1_000_000
"""The console width when stdout is not a terminal: wide enough that nothing is cut (a
rich table is only as wide as its cells)."""

TERMINAL_REASON = 80
"""Characters of a reason shown in a terminal (`triage dlq show` or --json give it all)."""


def dead_letter_table(items: list[dict[str, Any]], title: str, *, full: bool) -> Any:
    """`triage dlq list`'s table (pure): one line per dead letter, control characters
    escaped visibly (a newline in a reason is `\\n`). In a terminal (`full` false) the
    wide columns are cut with an ellipsis; `full` keeps topic and reason whole."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from triage_cli.render import item_summary, one_line, short_text

    # One line per dead letter at any width: the wide columns are cut with an ellipsis
    # (never folded: a folded cell in a narrow terminal grew every row by empty lines);
    # `triage dlq show` or --json give the whole text.
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, collapse_padding=True)
    for name, justify, flexible in (
        ("topic", "left", True),
        ("part", "right", False),
        ("offset", "right", False),
        ("status", "left", False),
        ("att", "right", False),
        ("dead-lettered at", "left", False),
        ("key", "left", True),
        ("reason", "left", True),
    ):
        table.add_column(
            name,
            justify=justify,  # type: ignore[arg-type]
            # Only the flexible columns give way when the terminal is narrow (rich shrinks
            # wrappable columns first); their cells never wrap, see `cut` below.
            no_wrap=not flexible,
            overflow="ellipsis",
            min_width=6 if flexible else None,
        )

    def cut(text: str) -> Text:
        return Text(text, no_wrap=True, overflow="ellipsis")

    for item in items:
        info = item_summary(item)
        if info["payload_s3"] is not None:
            key = "(in S3)"
        else:
            key = short_text(bytes(item["key"]["B"]) if "key" in item else None, 24)
        reason = one_line(info["reason"] or "")
        if not full and len(reason) > TERMINAL_REASON:
            reason = reason[: TERMINAL_REASON - 1] + "…"
        table.add_row(
            cut(one_line(info["topic"] or "")),
            str(info["partition"]),
            str(info["offset"]),
            Text(info["status"] or ""),
            str(info["attempts"]),
            Text((info["dead_lettered_at"] or "")[:19].replace("T", " ")),  # to the second
            cut(key),
            cut(reason),
        )
    return table


def json_line(value: Any) -> None:
    typer.echo(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def show_json(item: dict[str, Any], dl: Any) -> dict[str, Any]:
    import base64

    from triage_cli.render import item_summary, render_bytes

    def blob(data: bytes | None) -> dict[str, Any]:
        shown = render_bytes(data)
        encoded = None if data is None else base64.b64encode(data).decode("ascii")
        return {"kind": shown.kind, "text": shown.text, "base64": encoded}

    out = item_summary(item)
    out["key"] = blob(dl.record.key)
    out["value"] = blob(dl.record.value)
    out["headers"] = [{"name": name, **blob(value)} for name, value in dl.record.headers]
    return out


def show_text(item: dict[str, Any], dl: Any) -> str:
    from triage_cli.render import item_summary, one_line, render_bytes

    info = item_summary(item)
    record = dl.record
    rows = [
        ("dead letter", f"{record.topic}/{record.partition}/{record.offset}"),
        ("status", info["status"]),
        ("reason", info["reason"]),
        ("attempts", info["attempts"]),
        ("consumer", info["consumer_id"] or "-"),
        ("dead-lettered at", info["dead_lettered_at"]),
        ("kafka timestamp", f"{record.timestamp_ms} ms"),
    ]
    if info["payload_s3"]:
        rows.append(("payload", f"{info['payload_s3']} ({info['payload_bytes']} bytes)"))
    for name in ("replayed_at", "replayed_to", "replay_id", "replay_count", "discarded_at"):
        if info[name] is not None:
            rows.append((name.replace("_", " "), info[name]))
    if info["expires_at"] is not None:
        rows.append(("expires at (epoch s)", info["expires_at"]))
    if info["replay_claim"] is not None:
        rows.append(("being replayed by", info["replay_claim"]))
    width = max(len(name) for name, _ in rows)
    # One line per field: a newline or a control character in a reason is escaped
    # visibly (\\n, \\x1b), never printed as extra lines or sent to the terminal.
    lines = [f"{name:<{width}}  {one_line(str(value))}" for name, value in rows]

    def block(title: str, data: bytes | None) -> None:
        shown = render_bytes(data)
        size = "" if data is None else f", {len(data)} bytes"
        lines.append(f"{title} ({shown.kind}{size}):")
        lines.extend(f"  {line}" for line in shown.text.split("\n"))

    block("key", record.key)
    lines.append(f"headers ({len(record.headers)}):")
    for name, value in record.headers:
        shown = render_bytes(value)
        size = "" if value is None else f", {len(value)} bytes"
        lines.append(f"  {one_line(name) or '(empty name)'} ({shown.kind}{size}):")
        lines.extend(f"    {line}" for line in shown.text.split("\n"))
    block("value", record.value)
    return "\n".join(lines)


def coords(key: tuple[str, int, int]) -> str:
    """topic/partition/offset, how a dead letter is named in output."""
    return "/".join(map(str, key))


def report_replay(
    result: Any,
    selected: int,
    json_: bool,
    replay_id: str | None = None,
    *,
    interrupted: bool = False,
) -> None:
    """The summary line (or JSON line); an interrupted run also says so on stderr, with
    how many selected items it did not get to (still pending: a rerun replays them)."""
    replayed = len(result.replayed) if result else 0
    skipped = len(result.skipped) if result else 0
    failed = len(result.failed) if result else 0
    in_doubt = len(result.in_doubt) if result else 0
    remaining = max(0, selected - replayed - skipped - failed - in_doubt)
    if json_:
        json_line(
            {
                "replay_id": replay_id,
                "selected": selected,
                "replayed": replayed,
                "skipped": skipped,
                "failed": failed,
                "failures": [
                    {"dead_letter": coords(key), "why": why}
                    for key, why in (result.failed if result else [])
                ],
                "in_doubt": in_doubt,
                "doubts": [
                    {"dead_letter": coords(key), "why": why}
                    for key, why in (result.in_doubt if result else [])
                ],
                "interrupted": interrupted,
                "remaining": remaining,
            }
        )
    else:
        suffix = f" (replay id {replay_id})" if replay_id else ""
        typer.echo(
            f"selected {selected}, replayed {replayed}, skipped {skipped}, failed {failed}, "
            f"in doubt {in_doubt}{suffix}"
        )
    if interrupted:
        typer.secho(
            f"interrupted: replayed {replayed} of {selected}; {remaining} not reached and still "
            "pending. Run the same command again to replay them (what was replayed is not "
            "replayed twice).",
            err=True,
            fg=typer.colors.YELLOW,
        )


def indexing_summary(indexing: Any, dry_run: bool) -> str:
    """One line on the by-state index: what was (or would be) indexed, and whether
    listings use the index now."""
    from triage_proxy.store.items import STATE_INDEX

    if dry_run:
        return f"dry run: {indexing.indexed} dead letters would be indexed ({STATE_INDEX})"
    if indexing.complete:
        return f"indexed {indexing.indexed} dead letters; listings use the {STATE_INDEX} index"
    why = (
        f"{indexing.changed} changed while being indexed"
        if indexing.changed
        else f"the {STATE_INDEX} index is not ACTIVE yet"
    )
    return (
        f"indexed {indexing.indexed} dead letters, not complete: {why}; rerun "
        "(listings scan until it is complete)"
    )
