"""The `triage dlq` typer app: its options and the list, show, replay, discard and
migrate commands (the package's docstring says what each does)."""

from __future__ import annotations

import contextlib
import enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from triage_cli.dlq.broker import partition_count, replay_producer
from triage_cli.dlq.render import (
    coords,
    indexing_summary,
    json_line,
    print_table,
    report_replay,
    show_json,
    show_selection,
    show_text,
)
from triage_cli.dlq.selection import (
    open_pending,
    open_table,
    parse_filters,
    require_filter,
    show_dry_run,
)
from triage_cli.exitcodes import CommandFailed, ExitCode, exit_on_errors
from triage_cli.helptext import plain
from triage_cli.signals import stop_on_signals as _stop_on_signals

if TYPE_CHECKING:
    from triage_proxy.config.settings import Settings
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
        filters = parse_filters(
            topic=topic,
            partition=partition,
            status=status.value if status else None,
            reason=reason,
            since=since,
            until=until,
        )
        settings, table = open_table(config, group)
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
                        json_line(item_summary(item))
                else:
                    rows.extend(got.items)
                if cursor is None or (limit is not None and count >= limit):
                    break
            if not json_:
                more = " (more: see below)" if cursor is not None else ""
                print_table(rows, f"{count} dead letters of {table.group!r} in {table.table}{more}")
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
        partitions = list(range(count if count is not None else partition_count(settings, topic)))
    with contextlib.suppress(TriageError):  # the listing worked; the hint is a bonus
        found = legacy_partitions(table, topic, partitions)
        if found:
            typer.echo(f"warning: {legacy_warning(topic, found, str(config))}", err=True)


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
        _, table = open_table(config, group)
        with table:
            item = table.get((topic, partition, offset))
            try:
                dl = table.load(item)
            except ValueError as exc:
                raise CommandFailed(ExitCode.FAILURE, str(exc)) from None
            if json_:
                json_line(show_json(item, dl))
            else:
                typer.echo(show_text(item, dl))


# --- replay and discard ---------------------------------------------------------------


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
        filters = parse_filters(
            topic=topic, partition=partition, offset=offset, reason=reason, since=since, until=until
        )
        if to_topic is not None and (not to_topic or "#" in to_topic):
            raise CommandFailed(ExitCode.BAD_INPUT, f"not a Kafka topic name: {to_topic!r}")
        if spark and not dry_run:
            require_filter(filters, everything, "replay")
            _spark_replay(config, filters, to_topic, master, json_, group)
            return
        with open_pending(config, filters, everything, what="replay", group=group) as (
            settings,
            table,
            count,
        ):
            if dry_run:
                if count.selected:
                    show_dry_run(table, filters, json_, "replayed")
                else:
                    show_selection([], json_, "replayed")
                return
            if not count.selected:
                report_replay(None, 0, json_)
                return
            producer = replay_producer(settings, to_topic, count.topics)
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
                    typer.echo(f"replayed  {coords(key)}")
                for key, why in result.skipped:
                    typer.echo(f"skipped   {coords(key)}: {why}")
                for key, why in result.failed:
                    typer.echo(f"FAILED    {coords(key)}: {why}", err=True)
                for key, why in result.in_doubt:
                    typer.echo(f"IN DOUBT  {coords(key)}: {why}", err=True)
            interrupted = result.interrupted or stop.is_set()
            report_replay(result, count.selected, json_, replay_id, interrupted=interrupted)
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
        json_line({**dataclasses.asdict(summary), "ok": summary.ok})
    else:
        typer.echo(str(summary))
    if not summary.ok:
        raise typer.Exit(int(ExitCode.FAILURE))


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
        filters = parse_filters(
            topic=topic, partition=partition, offset=offset, reason=reason, since=since, until=until
        )
        with open_pending(config, filters, everything, what="discard", group=group) as (
            _,
            table,
            count,
        ):
            if dry_run:
                if count.selected:
                    show_dry_run(table, filters, json_, "discarded")
                else:
                    show_selection([], json_, "discarded")
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
                    typer.echo(f"discarded {coords(key)}")
                for key, why in result.skipped:
                    typer.echo(f"skipped   {coords(key)}: {why}")
            if json_:
                json_line({"selected": count.selected, "discarded": discarded, "skipped": skipped})
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
        settings, table = open_table(config, group)
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
                {"dead_letter": coords(key), "outcome": move.value}
                for move in (Move.IN_USE, Move.CONFLICT, Move.CHANGED)
                for key in result.moves[move]
            ]
            json_line(
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
                        f"{prefix}{labels[move]:<9} {coords(key)}{note}",
                        err=move in (Move.IN_USE, Move.CONFLICT, Move.CHANGED),
                    )
            summary = ", ".join(f"{labels[m].lower()} {result.count(m)}" for m in Move)
            what = "dry run, nothing changed: " if dry_run else ""
            typer.echo(
                f"{what}legacy dead letters of {settings.kafka.topic!r} for group "
                f"{table.group!r}: {summary}"
            )
            typer.echo(
                indexing_summary(indexing, dry_run), err=not dry_run and not indexing.complete
            )
        if result.interrupted or indexing.interrupted:
            raise typer.Exit(int(ExitCode.INTERRUPTED))
        if not dry_run and (result.left or not indexing.complete):
            raise typer.Exit(int(ExitCode.FAILURE))
