"""Which dead letters a `triage dlq` command acts on: the config's table (checked to
exist and answer), the filters its options give, and the pending items replay and
discard act on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from triage_cli.dlq.render import show_selection
from triage_cli.exitcodes import CommandFailed, ExitCode

if TYPE_CHECKING:
    from triage_proxy.config.settings import Settings
    from triage_proxy.store.bulk import Count
    from triage_proxy.store.query import DeadLetterTable, Filters


def open_table(config: Path, group: str | None = None) -> tuple[Settings, DeadLetterTable]:
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


def parse_filters(
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


def _sorted(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from triage_proxy.store.items import item_key

    return sorted(items, key=item_key)


@contextlib.contextmanager
def open_pending(
    config: Path, filters: Filters, everything: bool, *, what: str, group: str | None
) -> Iterator[tuple[Settings, DeadLetterTable, Count]]:
    """The settings, the open table and how many pending items replay and discard act on
    (`store.bulk.count_pending`; one `get` first for --offset, to say why not)."""
    from triage_proxy.store.bulk import Count, count_pending
    from triage_proxy.store.items import STATUS_PENDING

    settings, table = open_table(config, group)
    with table:
        require_filter(filters, everything, what)
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


def show_dry_run(table: DeadLetterTable, filters: Filters, json_: bool, would_be: str) -> None:
    """What a bulk action would act on, listed (sorted by topic, partition, offset)."""
    from triage_proxy.store.bulk import pending_filters
    from triage_proxy.store.pages import select

    show_selection(_sorted(list(select(table, pending_filters(filters)))), json_, would_be)


def require_filter(filters: Filters, everything: bool, what: str) -> None:
    if not filters.narrows and not everything:
        raise CommandFailed(
            ExitCode.BAD_INPUT,
            f"refusing to {what} every pending dead letter: give a filter or --all",
        )
