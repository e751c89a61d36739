"""Paged reads of dead letters against the real moto server: every item exactly once
across pages, in each read mode (index, key, scan), every filter, bounded calls for a
filter that matches nothing, cursor validation, and counts by reason."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from tests import samples
from tests.integration.harness import create_unindexed_table, dynamodb
from tests.samples import GROUP, T0
from triage_cli.devstack import write_config
from triage_cli.embedded import EmbeddedAWS
from triage_cli.main import app
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.exitcodes import ExitCode
from triage_proxy.kafka.producer import never_written
from triage_proxy.store.items import STATE_ATTR, item_key
from triage_proxy.store.pages import (
    CALLS_PER_PAGE,
    EVALUATE_PER_CALL,
    InvalidCursor,
    Page,
    page,
    reason_counts,
)
from triage_proxy.store.provisioning import create_table
from triage_proxy.store.query import DeadLetterTable, Filters, matches

# On one worker (--dist loadgroup): the module's tables are made and filled once.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("dlq-pages")]

TOPIC = "orders"
MINUTE = 60_000
REASONS = ("ValueError: bad", "TimeoutError: slow", "KeyError: 'id'")
STATUSES = ("pending", "pending", "replayed", "pending", "discarded")


def sample(n: int, group: str = GROUP, *, indexed: bool = True) -> dict[str, Any]:
    """Item n: partition n % 3, a reason, status and time (a minute apart) that vary."""
    item = samples.item(
        n,
        status=STATUSES[n % len(STATUSES)],
        group=group,
        partition=n % 3,
        reason=REASONS[n % len(REASONS)],
        at_ms=T0 + n * MINUTE,
    )
    if not indexed:
        del item[STATE_ATTR]
    return item


def put_all(client: Any, table: str, items: list[dict[str, Any]]) -> None:
    for start in range(0, len(items), 25):
        batch = [{"PutRequest": {"Item": i}} for i in items[start : start + 25]]
        left = client.batch_write_item(RequestItems={table: batch})["UnprocessedItems"]
        assert not left


def expected(items: list[dict[str, Any]], filters: Filters, group: str = GROUP) -> set[Any]:
    return {item_key(i) for i in items if matches(i, filters, group=group)}


def read_all(table: DeadLetterTable, filters: Filters, limit: int) -> list[Page]:
    found = []
    cursor = None
    while True:
        got = page(table, filters, cursor, limit)
        assert len(got.items) <= limit
        assert got.calls <= CALLS_PER_PAGE
        found.append(got)
        if got.next_cursor is None:
            return found
        cursor = got.next_cursor
        assert len(found) < 1000, "paging does not end"


ITEMS = [sample(n) for n in range(60)] + [sample(n, "shipping") for n in range(10)]


def indexed_table(aws: EmbeddedAWS, name: str) -> Iterator[DeadLetterTable]:
    """A table of ITEMS, made the way the proxy makes it (with the index)."""
    settings = DeadLetterSettings(table=name, endpoint_url=aws.endpoint_url)
    create_table(settings)
    put_all(dynamodb(aws), name, ITEMS)
    with DeadLetterTable(settings, group=GROUP) as table:
        assert table.indexed()
        yield table


@pytest.fixture
def indexed(aws: EmbeddedAWS, unique_name: str) -> Iterator[DeadLetterTable]:
    """A fresh indexed table of ITEMS, for a test that changes it."""
    yield from indexed_table(aws, unique_name)


# The tests that only read share one table per module (on each xdist worker): the
# paging cases alone would otherwise make and fill 30 tables in moto.


@pytest.fixture(scope="module")
def read_only(aws: EmbeddedAWS) -> Iterator[DeadLetterTable]:
    """An indexed table of ITEMS that no test changes."""
    yield from indexed_table(aws, "dlq-pages-read-only")


@pytest.fixture(scope="module")
def unindexed(aws: EmbeddedAWS) -> Iterator[DeadLetterTable]:
    """A table made before the index: items without dl_state, no marker: scan mode. No
    test changes it."""
    client = dynamodb(aws)
    unique_name = "dlq-pages-unindexed"
    create_unindexed_table(client, unique_name)
    put_all(client, unique_name, [sample(n, indexed=False) for n in range(60)])
    settings = DeadLetterSettings(table=unique_name, endpoint_url=aws.endpoint_url)
    with DeadLetterTable(settings, group=GROUP) as table:
        assert not table.indexed()
        yield table


def test_the_default_view_is_pending_newest_first_each_item_once(
    read_only: DeadLetterTable,
) -> None:
    pending = Filters(status="pending")
    pages = read_all(read_only, pending, 7)
    assert {p.mode for p in pages} == {"index"}
    keys = [item_key(i) for p in pages for i in p.items]
    assert len(keys) == len(set(keys))
    assert set(keys) == expected(ITEMS, pending)
    times = [i["dead_lettered_at"]["S"] for p in pages for i in p.items]
    assert times == sorted(times, reverse=True)  # newest first
    first = pages[0]
    assert (first.calls, first.examined) == (1, 7)  # the index answers the filter alone
    assert "value" not in first.items[0]  # a listing never reads payloads


@pytest.mark.parametrize(
    "filters",
    [
        Filters(),
        Filters(status="replayed"),
        Filters(reason="timeout"),
        Filters(topic=TOPIC, partition=1),
        Filters(topic=TOPIC, partition=2, status="pending", reason="keyerror"),
        Filters(partition=0),
        Filters(since_ms=T0 + 20 * MINUTE),
        Filters(until_ms=T0 + 20 * MINUTE, status="pending"),
        Filters(since_ms=T0 + 10 * MINUTE, until_ms=T0 + 30 * MINUTE, reason="value"),
        Filters(topic="other"),
    ],
    ids=repr,
)
@pytest.mark.parametrize("limit", [1, 4, 50])
def test_paging_returns_each_selected_item_exactly_once(
    read_only: DeadLetterTable, filters: Filters, limit: int
) -> None:
    pages = read_all(read_only, filters, limit)
    keys = [item_key(i) for p in pages for i in p.items]
    assert len(keys) == len(set(keys))
    assert set(keys) == expected(ITEMS, filters)
    assert sorted(keys) == sorted(map(item_key, read_only.scan(filters)))  # the one selection


@pytest.mark.parametrize(
    "filters",
    [Filters(), Filters(status="pending"), Filters(reason="slow", partition=1)],
    ids=repr,
)
def test_an_unindexed_table_pages_by_bounded_scan(
    unindexed: DeadLetterTable, filters: Filters
) -> None:
    items = [sample(n, indexed=False) for n in range(60)]
    pages = read_all(unindexed, filters, 9)
    assert {p.mode for p in pages} == {"scan"}
    keys = [item_key(i) for p in pages for i in p.items]
    assert len(keys) == len(set(keys))
    assert set(keys) == expected(items, filters)


def test_a_filter_that_matches_nothing_costs_bounded_calls_per_page(
    aws: EmbeddedAWS, unique_name: str
) -> None:
    settings = DeadLetterSettings(table=unique_name, endpoint_url=aws.endpoint_url)
    create_table(settings)
    many = [sample(n) for n in range(CALLS_PER_PAGE * EVALUATE_PER_CALL + 300)]  # > 1 page
    for item in many:
        item["status"] = {"S": "pending"}
        item[STATE_ATTR] = {"S": f"pending#{GROUP}"}
    put_all(dynamodb(aws), unique_name, many)
    with DeadLetterTable(settings, group=GROUP) as table:
        first = page(table, Filters(reason="no such reason"), limit=10)
        assert first.items == []
        assert first.calls == CALLS_PER_PAGE
        assert first.next_cursor is not None  # go on, if you want to
        second = page(table, Filters(reason="no such reason"), first.next_cursor, limit=10)
        assert (second.items, second.next_cursor) == ([], None)
        assert first.examined + second.examined == len(many)


def forge(body: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(body).encode()).decode().rstrip("=")


def test_a_forged_or_foreign_cursor_is_refused_clearly(read_only: DeadLetterTable) -> None:
    pending = Filters(status="pending")
    good = page(read_only, pending, limit=3).next_cursor
    assert good is not None
    body = json.loads(base64.urlsafe_b64decode(good + "=" * (-len(good) % 4)))
    other_group = dict(body["k"], source={"S": f"{TOPIC}#0#dead#shipping"})
    bad = [
        "",
        "garbage!",
        "x" * 5000,
        forge({"v": 99}),
        base64.urlsafe_b64encode(b"\xff\xfe").decode(),
        forge({**body, "s": 7}),
        forge({**body, "s": "0"}),
        forge({**body, "k": {"source": {"S": "x"}}}),
        forge({**body, "k": dict(body["k"], offset={"N": "1e9"})}),
        forge({**body, "k": dict(body["k"], offset={"N": "-1"})}),
        forge({**body, "k": other_group}),
        forge({**body, "k": dict(body["k"], dl_state={"S": "replayed#" + GROUP})}),
        forge({**body, "k": dict(body["k"], dead_lettered_at={"S": "yesterday"})}),
    ]
    for cursor in bad:
        with pytest.raises(InvalidCursor, match="start again from the first page"):
            page(read_only, pending, cursor, 3)
    with pytest.raises(InvalidCursor, match="another filter or deployment"):
        page(read_only, Filters(status="replayed"), good, 3)
    with (
        DeadLetterTable(read_only.settings, group="shipping") as other,
        pytest.raises(InvalidCursor, match="another filter or deployment"),
    ):
        page(other, pending, good, 3)
    with pytest.raises(ValueError, match=r"1\.\.1000"):
        page(read_only, pending, None, 0)
    assert page(read_only, pending, good, 3).items  # the real one still works


def test_the_cli_lists_by_pages_and_refuses_a_bad_cursor(
    read_only: DeadLetterTable, tmp_path: Any
) -> None:
    config = tmp_path / "triage.toml"
    write_config(
        config,
        {
            # The partition count given: `dlq list` need not ask the (absent) broker,
            # 3 s for each of the four calls below.
            "kafka": {
                "bootstrap_servers": "127.0.0.1:1",
                "topic": TOPIC,
                "group_id": GROUP,
                "partitions": 3,
            },
            "auth": {"token": "t" * 32},
            "dead_letters": {
                "table": read_only.table,
                "endpoint_url": read_only.settings.endpoint_url,
            },
        },
    )
    runner = CliRunner(env={"COLUMNS": "200"})

    def run(*args: str) -> Any:
        return runner.invoke(app, ["dlq", "list", "-c", str(config), *args])

    first = run("--json", "--limit", "4", "--status", "pending")
    assert first.exit_code == 0, first.output
    rows = [json.loads(line) for line in first.stdout.splitlines()]
    assert len(rows) == 4
    cursor = first.stderr.split("--cursor ")[1].split()[0]
    rest = run("--json", "--status", "pending", "--cursor", cursor)
    assert rest.exit_code == 0, rest.output
    more = [json.loads(line) for line in rest.stdout.splitlines()]
    seen = [(r["partition"], r["offset"]) for r in rows + more]
    assert len(seen) == len(set(seen)) == len(expected(ITEMS, Filters(status="pending")))
    bad = run("--cursor", "not-a-cursor")
    assert bad.exit_code == ExitCode.BAD_INPUT
    assert "invalid cursor" in bad.stderr
    assert "Traceback" not in bad.output
    table = run("--status", "pending", "--limit", "5")
    assert "5 dead letters" in table.stdout
    assert "--cursor" in table.stderr


def test_counts_by_reason_are_exact_under_the_cap_and_say_more_beyond(
    read_only: DeadLetterTable,
) -> None:
    pending = Filters(status="pending")
    want = Counter(i["reason"]["S"] for i in ITEMS if matches(i, pending, group=GROUP))
    counts = reason_counts(read_only, pending)
    assert counts.complete
    assert dict(counts.by_reason) == dict(want)
    assert counts.counted == sum(want.values())
    assert [n for _, n in counts.by_reason] == sorted(want.values(), reverse=True)
    capped = reason_counts(read_only, dataclasses.replace(pending), cap=1)
    assert not capped.complete
    assert 0 < capped.counted < counts.counted
    assert reason_counts(read_only, Filters(reason="nothing like it")).by_reason == []


# --- bulk actions -----------------------------------------------------------------------


def test_bulk_discard_counts_first_reports_progress_and_acts_once(
    indexed: DeadLetterTable,
) -> None:
    from triage_proxy.store.bulk import count_pending, discard_matching

    timeouts = Filters(reason="timeout")
    want = expected(ITEMS, dataclasses.replace(timeouts, status="pending"))
    count = count_pending(indexed, timeouts)
    assert (count.selected, count.complete, count.topics) == (len(want), True, frozenset({TOPIC}))
    assert count_pending(indexed, timeouts, cap=2) == dataclasses.replace(
        count, selected=2, complete=False
    )
    calls: list[tuple[int, int]] = []
    result = discard_matching(
        indexed, timeouts, progress=lambda d, t: calls.append((d, t)), expected=count.selected
    )
    assert set(result.discarded) == want
    assert len(result.discarded) == len(want)
    assert result.skipped == []
    assert calls[-1] == (len(want), len(want))
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)  # done only grows
    assert all(d <= t for d, t in calls)
    for key in want:
        assert indexed.get(key)["status"]["S"] == "discarded"
    assert count_pending(indexed, timeouts).selected == 0
    again = discard_matching(indexed, timeouts)
    assert (again.discarded, again.skipped) == ([], [])
    untouched = expected(ITEMS, Filters(status="pending")) - want
    assert all(indexed.get(key)["status"]["S"] == "pending" for key in untouched)


def test_bulk_discard_stops_when_asked(indexed: DeadLetterTable) -> None:
    import threading

    from triage_proxy.store.bulk import discard_matching

    stop = threading.Event()

    def progress(done: int, total: int) -> None:
        if done == 3:
            stop.set()

    result = discard_matching(indexed, Filters(), progress=progress, stop=stop)
    assert result.interrupted
    assert len(result.discarded) == 3


def test_bulk_replay_goes_through_the_replay_routine_with_progress(
    aws: EmbeddedAWS, broker: Any, unique_name: str
) -> None:
    from confluent_kafka import Consumer, Producer, TopicPartition

    from tests.integration.harness import (
        create_topic,
        headers_of,
        write_dead_letters,
    )
    from triage_proxy.store.bulk import count_pending, replay_matching
    from triage_proxy.store.replay import REPLAY_OF_HEADER, new_replay_id

    settings = DeadLetterSettings(table=unique_name, endpoint_url=aws.endpoint_url)
    create_table(settings)
    create_topic(broker.bootstrap, unique_name)
    dls = [
        samples.make_dl(
            i,
            topic=unique_name,
            value=bytes([i]) * (i + 1),
            headers=(("h", b"\x00\xff"), ("h", None)),
            reason="boom" if i % 4 else "other",
            at_ms=T0 + i,
        )
        for i in range(23)
    ]
    write_dead_letters(settings, dls)
    chosen = {dl.record.offset: dl for dl in dls if dl.reason == "boom"}
    producer = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all"})
    calls: list[tuple[int, int]] = []
    with DeadLetterTable(settings, group=GROUP) as table:
        count = count_pending(table, Filters(reason="boom"))
        assert count.selected == len(chosen)
        result = replay_matching(
            table,
            producer,
            Filters(reason="boom"),
            replay_id=new_replay_id(),
            never_written=never_written,
            chunk=5,
            progress=lambda d, t: calls.append((d, t)),
            expected=count.selected,
        )
        assert sorted(k[2] for k in result.replayed) == sorted(chosen)
        assert (result.failed, result.in_doubt, result.skipped) == ([], [], [])
        assert calls[-1] == (len(chosen), len(chosen))
        assert all(t == len(chosen) for _, t in calls)
        assert [d for d, _ in calls] == sorted(d for d, _ in calls)
        again = replay_matching(
            table,
            producer,
            Filters(reason="boom"),
            replay_id=new_replay_id(),
            never_written=never_written,
        )
        assert again.replayed == []  # a rerun replays nothing twice
    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": unique_name})
    consumer.assign([TopicPartition(unique_name, 0, 0)])
    copies: dict[int, Any] = {}
    try:
        import time

        deadline = time.monotonic() + 60
        while len(copies) < len(chosen) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                origin = dict(headers_of(msg))[REPLAY_OF_HEADER]
                assert origin is not None
                copies[int(origin.decode().rsplit("/", 1)[1])] = msg
    finally:
        consumer.close()
    assert sorted(copies) == sorted(chosen)
    for offset, msg in copies.items():  # byte-exact: the index holds no payloads, get_many does
        dl = chosen[offset]
        assert (msg.key(), msg.value()) == (dl.record.key, dl.record.value)
        assert msg.headers()[:2] == list(dl.record.headers)


def test_bulk_replay_stops_between_chunks_when_asked(
    aws: EmbeddedAWS, broker: Any, unique_name: str
) -> None:
    """`stop` set during a chunk: that chunk is settled, no other one is started, and the
    rest stays pending for a rerun, which replays it."""
    import threading

    from confluent_kafka import Producer

    from tests.integration.harness import create_topic, write_dead_letters
    from triage_proxy.store.bulk import count_pending, replay_matching
    from triage_proxy.store.replay import new_replay_id

    settings = DeadLetterSettings(table=unique_name, endpoint_url=aws.endpoint_url)
    create_table(settings)
    create_topic(broker.bootstrap, unique_name)
    write_dead_letters(settings, [samples.make_dl(i, topic=unique_name) for i in range(12)])
    producer = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all"})
    stop = threading.Event()
    calls: list[tuple[int, int]] = []

    def progress(done: int, total: int) -> None:
        calls.append((done, total))
        stop.set()  # after the first chunk

    with DeadLetterTable(settings, group=GROUP) as table:
        cut = replay_matching(
            table,
            producer,
            Filters(),
            replay_id=new_replay_id(),
            never_written=never_written,
            chunk=5,
            progress=progress,
            stop=stop,
            expected=12,
        )
        assert cut.interrupted
        assert sorted(k[2] for k in cut.replayed) == [0, 1, 2, 3, 4]  # oldest first
        assert (cut.failed, cut.in_doubt, cut.skipped) == ([], [], [])
        assert calls == [(5, 12), (5, 12)]  # the chunk, then the end (total as expected)
        assert count_pending(table, Filters()).selected == 7
        rest = replay_matching(
            table,
            producer,
            Filters(),
            replay_id=new_replay_id(),
            never_written=never_written,
            chunk=5,
        )
        assert not rest.interrupted
        assert sorted(k[2] for k in rest.replayed) == list(range(5, 12))
