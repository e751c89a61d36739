"""`triage dlq`: find out why messages died, then put them back or let them go.

Why a CLI next to the Spark job: most incidents are a handful of dead letters that a
person wants to read, fix the cause of, and replay, using the same config file the
proxy runs from (the one `triage dev` writes works as is). The selection, rendering
and replay protocol live in the `triage_proxy.store` package (`query.py`, `replay.py`;
`pages.py` and `bulk.py` for paged reads and bulk actions; the console uses them too),
shared with the Spark job, so the two never disagree about which items a filter selects
or whether an item was replayed; rendering for people is `render.py`.

    triage dlq list    --config F [filters] [--json] [--limit N] [--cursor C]
    triage dlq show    --config F TOPIC PARTITION OFFSET [--json]
    triage dlq replay  --config F (filters | --offset N | --all) [--to-topic T] [--dry-run]
    triage dlq discard --config F (filters | --offset N | --all) [--dry-run]
    triage dlq migrate --config F [--dry-run] [--json]

Every command acts on one deployment's dead letters: those of the config's
`kafka.group_id`, or of `--group G` (another app reading the same topic into the same
table has its own, which these commands never touch). `migrate` moves the dead letters
written before deployment keys (no group) of the config's topic to that deployment
(`triage_proxy.store.migrate`).

Filters: --topic, --partition, --status (list only; replay and discard act on
pending items), --reason SUBSTRING (case-insensitive), --since/--until (ISO-8601 or an
age like 30m, 1h, 2d; on dead_lettered_at, since inclusive, until exclusive).

Exit codes (`exitcodes.ExitCode`): 0 ok; 1 some items failed to replay or are in doubt
(maybe delivered, still claimed); 2 bad config or bad arguments (malformed time range,
a cursor this listing did not hand out ...); 3 DynamoDB, S3 or Kafka unreachable; 4 the
table or the item does not exist; 130 interrupted (SIGINT or SIGTERM: a replay finishes
and marks the chunk in flight, then stops).

Heavy modules (boto3, confluent-kafka, rich) are imported inside the commands.
"""

from __future__ import annotations

import contextlib
import enum
import json
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from triage_cli.exitcodes import CommandFailed, ExitCode, exit_on_errors
from triage_cli.helptext import plain
from triage_cli.signals import stop_on_signals as _stop_on_signals

if TYPE_CHECKING:
    from triage_proxy.config.settings import Settings
    from triage_proxy.store.bulk import Count
    from triage_proxy.store.query import DeadLetterTable, Filters

dlq_app = typer.Typer(
    name="dlq",
    help="Inspect, replay and discard dead letters (the table the proxy writes).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class Status(enum.StrEnum):
    pending = "pending"
    replayed = "replayed"
    discarded = "discarded"


ConfigOption = Annotated[
    Path, typer.Option("--config", "-c", help="The proxy's TOML config file.", show_default=False)
]
TopicOption = Annotated[str | None, typer.Option(help="Only this source topic.")]
PartitionOption = Annotated[int | None, typer.Option(help="Only this source partition.")]
ReasonOption = Annotated[
    str | None, typer.Option(help="Only reasons containing this text (case-insensitive).")
]
SinceOption = Annotated[
    str | None,
    typer.Option(help="Dead-lettered at or after: ISO-8601 or an age (30m, 1h, 2d)."),
]
UntilOption = Annotated[
    str | None, typer.Option(help="Dead-lettered before: ISO-8601 or an age (30m, 1h, 2d).")
]
OffsetOption = Annotated[
    int | None, typer.Option(help="Only this offset (with --topic and --partition).")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
GroupOption = Annotated[
    str | None,
    typer.Option(
        help=plain(
            "The deployment (a Kafka group id) whose dead letters to act on "
            "[default: the config's kafka.group_id]."
        ),
        show_default=False,
    ),
]


def _open(config: Path, group: str | None = None) -> tuple[Settings, DeadLetterTable]:
    """Settings from the config file and the deployment's view of the table (`group`, or
    the config's group id), checked to exist and answer."""
    from triage_proxy.config.loader import load_settings
    from triage_proxy.store.aws import read_secret
    from triage_proxy.store.query import DeadLetterTable

    settings = load_settings(config, fetch_secret=read_secret)
    table = DeadLetterTable(settings.dead_letters, group=group or settings.kafka.group_id)
    try:
        table.check()
    except BaseException:
        table.close()
        raise
    return settings, table


def _filters(
    *,
    topic: str | None,
    partition: int | None,
    offset: int | None = None,
    status: str | None = None,
    reason: str | None = None,
    since: str | None = None,
    until: str | None = None,
) -> Filters:
    import time

    from triage_proxy.store.query import Filters, parse_time

    if offset is not None and (topic is None or partition is None):
        raise CommandFailed(ExitCode.BAD_INPUT, "--offset needs --topic and --partition")
    now_ms = int(time.time() * 1000)
    times: dict[str, int | None] = {"since": None, "until": None}
    for name, text in (("since", since), ("until", until)):
        if text is not None:
            try:
                times[name] = parse_time(text, now_ms)
            except ValueError as exc:
                raise CommandFailed(ExitCode.BAD_INPUT, f"malformed --{name}: {exc}") from None
    try:
        return Filters(
            topic=topic,
            partition=partition,
            offset=offset,
            status=status,
            reason=reason,
            since_ms=times["since"],
            until_ms=times["until"],
        )
    except ValueError as exc:
        raise CommandFailed(ExitCode.BAD_INPUT, str(exc)) from None


def _show_selection(items: list[dict[str, Any]], json_: bool, would_be: str) -> None:
    """What a --dry-run selected: one JSON line per item, or a table."""
    from triage_cli.render import item_summary

    if json_:
        for item in items:
            _json_line(item_summary(item))
    else:
        _print_table(items, f"{len(items)} dead letters would be {would_be}")


def _print_table(items: list[dict[str, Any]], title: str) -> None:
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


def _sorted(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from triage_proxy.store.items import item_key

    return sorted(items, key=item_key)


def _json_line(value: Any) -> None:
    typer.echo(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


# --- list -----------------------------------------------------------------------------


@dlq_app.command("list")
def list_(
    config: ConfigOption,
    topic: TopicOption = None,
    partition: PartitionOption = None,
    status: Annotated[Status | None, typer.Option(help="Only this status.")] = None,
    reason: ReasonOption = None,
    since: SinceOption = None,
    until: UntilOption = None,
    json_: JsonOption = False,
    limit: Annotated[int | None, typer.Option(min=1, help="Show at most this many.")] = None,
    cursor: Annotated[
        str | None,
        typer.Option(help="Go on where a --limit listing stopped (it prints the cursor)."),
    ] = None,
    group: GroupOption = None,
) -> None:
    """List dead letters (a table, or one JSON object per line with --json).

    Read a page at a time (store/pages.py): by partition in offset order with --topic and
    --partition, otherwise newest first per status (pending, replayed, discarded) once
    the table is indexed (`triage dlq migrate` indexes an older table). With --limit, a
    cursor to the rest is printed on stderr.
    """
    from triage_cli.render import item_summary
    from triage_proxy.store.pages import MAX_PAGE_SIZE, page

    with exit_on_errors():
        filters = _filters(
            topic=topic,
            partition=partition,
            status=status.value if status else None,
            reason=reason,
            since=since,
            until=until,
        )
        settings, table = _open(config, group)
        with table:
            rows: list[dict[str, Any]] = []  # for the table; --json streams instead
            count = 0
            scanned = False
            while True:
                size = MAX_PAGE_SIZE if limit is None else min(MAX_PAGE_SIZE, limit - count)
                got = page(table, filters, cursor, size)
                scanned = scanned or got.mode == "scan"
                cursor = got.next_cursor
                count += len(got.items)
                if json_:
                    for item in got.items:
                        _json_line(item_summary(item))
                else:
                    rows.extend(got.items)
                if cursor is None or (limit is not None and count >= limit):
                    break
            if not json_:
                more = " (more: see below)" if cursor is not None else ""
                _print_table(
                    rows, f"{count} dead letters of {table.group!r} in {table.table}{more}"
                )
            if cursor is not None:
                typer.echo(f"more dead letters: --cursor {cursor}", err=True)
            if scanned:
                typer.echo(
                    "note: this table is not indexed yet, so listing scans it: "
                    f"triage dlq migrate --config {config}",
                    err=True,
                )
            _warn_legacy(config, settings, table, topic, partition)


def _warn_legacy(
    config: Path,
    settings: Settings,
    table: DeadLetterTable,
    topic: str | None,
    partition: int | None,
) -> None:
    """On stderr: the topic's dead letters from before deployment keys, which no command
    shows until `triage dlq migrate` moves them (a Query per partition, Limit 1)."""
    from triage_proxy.errors import TriageError
    from triage_proxy.store.migrate import legacy_partitions, legacy_warning

    topic = topic or settings.kafka.topic
    if partition is not None:
        partitions: list[int] = [partition]
    else:
        count = settings.kafka.partitions if topic == settings.kafka.topic else None
        partitions = list(range(count if count is not None else _partition_count(settings, topic)))
    with contextlib.suppress(TriageError):  # the listing worked; the hint is a bonus
        found = legacy_partitions(table, topic, partitions)
        if found:
            typer.echo(f"warning: {legacy_warning(topic, found, str(config))}", err=True)


LEGACY_METADATA_TIMEOUT_S = 3.0


def _partition_count(settings: Settings, topic: str) -> int:
    """The topic's partition count from the broker; 1 (partition 0 only) when it does not
    answer in LEGACY_METADATA_TIMEOUT_S (dlq works without a broker)."""
    from confluent_kafka.admin import AdminClient

    from triage_proxy.errors import BrokerUnavailable
    from triage_proxy.kafka.errors import kafka_errors

    config = {**settings.kafka.librdkafka_config(), "logger": _quiet_kafka_logger()}
    try:
        with kafka_errors(f"reading the metadata of {topic}"):
            meta = AdminClient(config).list_topics(topic, timeout=LEGACY_METADATA_TIMEOUT_S)
    except BrokerUnavailable:
        return 1
    found = meta.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        return 1
    return len(found.partitions)


# --- show -----------------------------------------------------------------------------


@dlq_app.command()
def show(
    config: ConfigOption,
    topic: Annotated[str, typer.Argument(help="Source topic.")],
    partition: Annotated[int, typer.Argument(help="Source partition.", min=0)],
    offset: Annotated[int, typer.Argument(help="Offset of the message.", min=0)],
    json_: JsonOption = False,
    group: GroupOption = None,
) -> None:
    """Show one dead letter with its key, headers and value rendered safely."""
    with exit_on_errors():
        _, table = _open(config, group)
        with table:
            item = table.get((topic, partition, offset))
            try:
                dl = table.load(item)
            except ValueError as exc:
                raise CommandFailed(ExitCode.FAILURE, str(exc)) from None
            if json_:
                _json_line(_show_json(item, dl))
            else:
                typer.echo(_show_text(item, dl))


def _show_json(item: dict[str, Any], dl: Any) -> dict[str, Any]:
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


def _show_text(item: dict[str, Any], dl: Any) -> str:
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


# --- replay and discard ---------------------------------------------------------------


@contextlib.contextmanager
def _pending(
    config: Path, filters: Filters, everything: bool, *, what: str, group: str | None
) -> Iterator[tuple[Settings, DeadLetterTable, Count]]:
    """The settings, the open table and how many pending items replay and discard act on
    (`store.bulk.count_pending`; one `get` first for --offset, to say why not)."""
    from triage_proxy.store.bulk import Count, count_pending
    from triage_proxy.store.items import STATUS_PENDING

    settings, table = _open(config, group)
    with table:
        _require_filter(filters, everything, what)
        if filters.offset is not None:
            assert filters.topic is not None
            assert filters.partition is not None
            item = table.get((filters.topic, filters.partition, filters.offset))
            status = item["status"]["S"]
            if status != STATUS_PENDING:
                typer.echo(f"nothing to {what}: that dead letter is {status}", err=True)
                yield settings, table, Count(0, True, frozenset())
                return
        yield settings, table, count_pending(table, filters)


def _dry_run(table: DeadLetterTable, filters: Filters, json_: bool, would_be: str) -> None:
    """What a bulk action would act on, listed (sorted by topic, partition, offset)."""
    from triage_proxy.store.bulk import pending_filters
    from triage_proxy.store.pages import select

    _show_selection(_sorted(list(select(table, pending_filters(filters)))), json_, would_be)


def _coords(key: tuple[str, int, int]) -> str:
    """topic/partition/offset, how a dead letter is named in output."""
    return "/".join(map(str, key))


def _require_filter(filters: Filters, everything: bool, what: str) -> None:
    if not filters.narrows and not everything:
        raise CommandFailed(
            ExitCode.BAD_INPUT,
            f"refusing to {what} every pending dead letter: give a filter or --all",
        )


@dlq_app.command()
def replay(
    config: ConfigOption,
    topic: TopicOption = None,
    partition: PartitionOption = None,
    offset: OffsetOption = None,
    reason: ReasonOption = None,
    since: SinceOption = None,
    until: UntilOption = None,
    to_topic: Annotated[
        str | None,
        typer.Option(help="Produce here instead of back to each message's source partition."),
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="Only list what would be replayed.")] = False,
    everything: Annotated[
        bool, typer.Option("--all", help="Replay every pending dead letter (no filter).")
    ] = False,
    json_: JsonOption = False,
    spark: Annotated[
        bool,
        typer.Option(
            "--spark", help="Run the PySpark job instead (parallel scan; for many items)."
        ),
    ] = False,
    master: Annotated[
        str,
        typer.Option(
            help="Spark master of --spark: local[N], or spark://HOST:PORT (its executors "
            "run this interpreter unless PYSPARK_PYTHON names another)."
        ),
    ] = "local[*]",
    group: GroupOption = None,
) -> None:
    """Produce pending dead letters again and mark them replayed.

    Same key, value and headers plus the provenance headers triage-replay-of,
    triage-replay-reason and triage-replay-id. Items are marked replayed only once the
    broker confirmed them, so a rerun (or a concurrent run) replays nothing twice; one
    that may have been delivered stays claimed and is reported in doubt. With --spark
    the Spark job (triage_replay) does the same at scale; --dry-run still lists
    without Spark.
    """
    from triage_proxy.kafka.producer import never_written
    from triage_proxy.store.bulk import replay_matching
    from triage_proxy.store.replay import new_replay_id

    with exit_on_errors():
        filters = _filters(
            topic=topic, partition=partition, offset=offset, reason=reason, since=since, until=until
        )
        if to_topic is not None and (not to_topic or "#" in to_topic):
            raise CommandFailed(ExitCode.BAD_INPUT, f"not a Kafka topic name: {to_topic!r}")
        if spark and not dry_run:
            _require_filter(filters, everything, "replay")
            _spark_replay(config, filters, to_topic, master, json_, group)
            return
        with _pending(config, filters, everything, what="replay", group=group) as (
            settings,
            table,
            count,
        ):
            if dry_run:
                if count.selected:
                    _dry_run(table, filters, json_, "replayed")
                else:
                    _show_selection([], json_, "replayed")
                return
            if not count.selected:
                _report_replay(None, 0, json_)
                return
            producer = _producer(settings, to_topic, count.topics)
            replay_id = new_replay_id()
            with _stop_on_signals() as stop:
                result = replay_matching(
                    table,
                    producer,
                    filters,
                    replay_id=replay_id,
                    never_written=never_written,
                    to_topic=to_topic,
                    stop=stop,
                    expected=count.selected,
                )
            if not json_:
                for key in result.replayed:
                    typer.echo(f"replayed  {_coords(key)}")
                for key, why in result.skipped:
                    typer.echo(f"skipped   {_coords(key)}: {why}")
                for key, why in result.failed:
                    typer.echo(f"FAILED    {_coords(key)}: {why}", err=True)
                for key, why in result.in_doubt:
                    typer.echo(f"IN DOUBT  {_coords(key)}: {why}", err=True)
            interrupted = result.interrupted or stop.is_set()
            _report_replay(result, count.selected, json_, replay_id, interrupted=interrupted)
            if interrupted:
                raise typer.Exit(int(ExitCode.INTERRUPTED))
            if result.failed or result.in_doubt:
                raise typer.Exit(int(ExitCode.FAILURE))


def _spark_replay(
    config: Path,
    filters: Filters,
    to_topic: str | None,
    master: str,
    json_: bool,
    group: str | None,
) -> None:
    """Run the Spark job on this config and filters in this process; print its summary."""
    import dataclasses
    import importlib.util

    from triage_proxy.config.loader import load_settings
    from triage_proxy.store.aws import read_secret
    from triage_replay import ReplayOptions, run_replay

    if importlib.util.find_spec("pyspark") is None:  # an extra: triage[spark]
        raise CommandFailed(
            ExitCode.BAD_INPUT, "--spark needs pyspark: pip install 'triage[spark]'"
        )
    settings = load_settings(config, fetch_secret=read_secret)
    options = ReplayOptions.from_settings(
        settings,
        filters=filters,
        to_topic=to_topic,
        master=master,
        group=group or settings.kafka.group_id,
    )
    summary = run_replay(options)  # its session sets PYSPARK_PYTHON for any master
    if json_:
        _json_line({**dataclasses.asdict(summary), "ok": summary.ok})
    else:
        typer.echo(str(summary))
    if not summary.ok:
        raise typer.Exit(int(ExitCode.FAILURE))


def _report_replay(
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
        _json_line(
            {
                "replay_id": replay_id,
                "selected": selected,
                "replayed": replayed,
                "skipped": skipped,
                "failed": failed,
                "failures": [
                    {"dead_letter": _coords(key), "why": why}
                    for key, why in (result.failed if result else [])
                ],
                "in_doubt": in_doubt,
                "doubts": [
                    {"dead_letter": _coords(key), "why": why}
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


def producer_config(settings: Settings) -> dict[str, Any]:
    """The replay producer every tool shares (`kafka.producer`), on this config's broker;
    a broker that does not answer fails the command in 10 s, quietly."""
    from triage_proxy.kafka.producer import replay_producer_config

    return {
        **replay_producer_config(settings.kafka.librdkafka_config()),
        "socket.connection.setup.timeout.ms": 10_000,
        "logger": _quiet_kafka_logger(),
    }


def _producer(settings: Settings, to_topic: str | None, topics: Collection[str]) -> Any:
    """A confluent-kafka producer, after checking the broker answers and the targets
    (`to_topic`, or the dead letters' source `topics`) exist."""
    from confluent_kafka import Producer

    from triage_proxy.kafka.errors import kafka_errors

    producer = Producer(producer_config(settings))
    unreachable = f"cannot reach Kafka at {settings.kafka.bootstrap_servers}"
    with kafka_errors(unreachable, lambda why: CommandFailed(ExitCode.UNAVAILABLE, why)):
        metadata = producer.list_topics(timeout=10)
    wanted = {to_topic} if to_topic else set(topics)
    missing = sorted(t for t in wanted if t not in metadata.topics)
    if missing:
        raise CommandFailed(ExitCode.NOT_FOUND, f"topic {', '.join(missing)} does not exist")
    return producer


def _quiet_kafka_logger() -> Any:
    """librdkafka's own log lines go to a logger that only shows errors."""
    import logging

    log = logging.getLogger("triage_cli.dlq.kafka")
    log.setLevel(logging.ERROR)
    return log


@dlq_app.command()
def discard(
    config: ConfigOption,
    topic: TopicOption = None,
    partition: PartitionOption = None,
    offset: OffsetOption = None,
    reason: ReasonOption = None,
    since: SinceOption = None,
    until: UntilOption = None,
    dry_run: Annotated[bool, typer.Option(help="Only list what would be discarded.")] = False,
    everything: Annotated[
        bool, typer.Option("--all", help="Discard every pending dead letter (no filter).")
    ] = False,
    json_: JsonOption = False,
    group: GroupOption = None,
) -> None:
    """Mark pending dead letters discarded (never replayed; expire with TTL if it is on)."""
    from triage_proxy.store.bulk import discard_matching

    with exit_on_errors():
        filters = _filters(
            topic=topic, partition=partition, offset=offset, reason=reason, since=since, until=until
        )
        with _pending(config, filters, everything, what="discard", group=group) as (
            _,
            table,
            count,
        ):
            if dry_run:
                if count.selected:
                    _dry_run(table, filters, json_, "discarded")
                else:
                    _show_selection([], json_, "discarded")
                return
            with _stop_on_signals() as stop:
                result = (
                    discard_matching(table, filters, stop=stop, expected=count.selected)
                    if count.selected
                    else None
                )
            discarded = len(result.discarded) if result else 0
            skipped = len(result.skipped) if result else 0
            if result is not None and not json_:
                for key in result.discarded:
                    typer.echo(f"discarded {_coords(key)}")
                for key, why in result.skipped:
                    typer.echo(f"skipped   {_coords(key)}: {why}")
            if json_:
                _json_line({"selected": count.selected, "discarded": discarded, "skipped": skipped})
            else:
                typer.echo(f"selected {count.selected}, discarded {discarded}, skipped {skipped}")
            if stop.is_set() or (result is not None and result.interrupted):
                raise typer.Exit(int(ExitCode.INTERRUPTED))


# --- migrate --------------------------------------------------------------------------


@dlq_app.command()
def migrate(
    config: ConfigOption,
    group: GroupOption = None,
    dry_run: Annotated[
        bool, typer.Option(help="Only say what would be moved; change nothing.")
    ] = False,
    drop_conflicts: Annotated[
        bool,
        typer.Option(
            help="Delete a legacy dead letter whose offset this deployment already replayed "
            "or discarded (a conflict), keeping the deployment's."
        ),
    ] = False,
    json_: JsonOption = False,
) -> None:
    """Move the topic's dead letters written before deployment keys to this deployment,
    and index the table for paged listing.

    Tables written before dead letters were keyed by deployment (group id) hold them
    under the topic and partition only; no command sees them until they are moved. Each
    is moved in one transaction (copy, then delete the old item), so a crash loses
    nothing and a rerun continues. Items being replayed, or whose offset this deployment
    already replayed or discarded (conflicts), are left and reported (exit 1); with
    --drop-conflicts a conflict is deleted instead, the deployment's settlement standing.
    Stop every proxy that predates deployment keys first (it would write more of them);
    run with --dry-run to see the plan.

    Then it adds the by-state index to a table created before it and gives every dead
    letter (of every deployment) the attribute that index is keyed on; until that is
    done, listings scan the table. Idempotent and resumable too.
    """
    from triage_proxy.store.migrate import Indexing, Migration, Move

    labels = {
        Move.MOVED: "moved",
        Move.REPLACED: "replaced",
        Move.IN_USE: "IN USE",
        Move.CONFLICT: "CONFLICT",
        Move.DROPPED: "dropped",
        Move.CHANGED: "CHANGED",
    }
    why = {
        Move.REPLACED: "over this deployment's pending copy of the same message",
        Move.IN_USE: "claimed by a running replay; rerun once it is done",
        Move.CONFLICT: (
            "this deployment already replayed, discarded or claims that offset "
            "(--drop-conflicts deletes this legacy copy)"
        ),
        Move.DROPPED: "this deployment had settled that offset already",
        Move.CHANGED: "written meanwhile (by an old proxy or tool?); rerun",
    }
    with exit_on_errors():
        settings, table = _open(config, group)
        with table, _stop_on_signals() as stop:
            migration = Migration(table, settings.kafka.topic)
            result = migration.run(apply=not dry_run, stop=stop, drop_conflicts=drop_conflicts)
            indexing = Indexing(table).run(apply=not dry_run, stop=stop)
        index = {
            "active": indexing.index_active,
            "indexed": indexing.indexed,
            "changed": indexing.changed,
            "complete": indexing.complete,
        }
        counts = {move.value: result.count(move) for move in Move}
        if json_:
            left = [
                {"dead_letter": _coords(key), "outcome": move.value}
                for move in (Move.IN_USE, Move.CONFLICT, Move.CHANGED)
                for key in result.moves[move]
            ]
            _json_line(
                {
                    "group": table.group,
                    "topic": settings.kafka.topic,
                    "dry_run": dry_run,
                    **counts,
                    "left": left,
                    "index": index,
                    "interrupted": result.interrupted or indexing.interrupted,
                }
            )
        else:
            prefix = "would be " if dry_run else ""
            for move in Move:
                for key in result.moves[move]:
                    note = f": {why[move]}" if move in why else ""
                    typer.echo(
                        f"{prefix}{labels[move]:<9} {_coords(key)}{note}",
                        err=move in (Move.IN_USE, Move.CONFLICT, Move.CHANGED),
                    )
            summary = ", ".join(f"{labels[m].lower()} {result.count(m)}" for m in Move)
            what = "dry run, nothing changed: " if dry_run else ""
            typer.echo(
                f"{what}legacy dead letters of {settings.kafka.topic!r} for group "
                f"{table.group!r}: {summary}"
            )
            typer.echo(
                _indexing_summary(indexing, dry_run), err=not dry_run and not indexing.complete
            )
        if result.interrupted or indexing.interrupted:
            raise typer.Exit(int(ExitCode.INTERRUPTED))
        if not dry_run and (result.left or not indexing.complete):
            raise typer.Exit(int(ExitCode.FAILURE))


def _indexing_summary(indexing: Any, dry_run: bool) -> str:
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
