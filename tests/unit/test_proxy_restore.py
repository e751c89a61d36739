"""What a starting proxy takes from the previous run (partition.py `restore`): the offsets
settled above the commit and the failed-delivery counts, with in-memory twins only."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest

from triage_proxy.app import Proxy
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.settings import Settings
from triage_proxy.kafka.client import MemoryPartition
from triage_proxy.pipeline import partition
from triage_proxy.pipeline.settled import encode_attempts, encode_settled
from triage_proxy.store.checkpoints import MemoryCheckpoints
from triage_proxy.store.deadletter_store import MemoryStore
from triage_proxy.store.items import dead_letter_from_item
from triage_proxy.store.leases import MemoryLeases

TOKEN = "restore-test-token-0123"


def make_settings(
    *, encode_settled: bool = True, window: int | None = None, commit_s: float | None = None
) -> Settings:
    raw: dict[str, dict[str, object]] = {
        "kafka": {"bootstrap_servers": "127.0.0.1:1", "topic": "orders", "group_id": "g"},
        "auth": {"token": TOKEN},
        "dead_letters": {"table": "dlq", "flush_interval_ms": 1},
        "server": {"host": "127.0.0.1", "port": 0, "http_port": 0},
        "delivery": {"max_attempts": 5, "redelivery_span_s": 7.0},
        "commit": {"encode_settled": encode_settled},
    }
    if window is not None:
        raw["window"] = {"max_messages": window}
    if commit_s is not None:
        raw["commit"]["interval_s"] = commit_s
    return settings_from_dict(raw, {})


def checkpoint(committed: int, settled: list[int], counts: dict[int, int]) -> MemoryCheckpoints:
    store = MemoryCheckpoints()
    store.put(
        committed, encode_settled(committed, settled) or "", encode_attempts(committed, counts)
    )
    return store


def restore(
    checkpoints: MemoryCheckpoints, committed: int, metadata: str | None = None
) -> tuple[list[int], dict[int, int]]:
    return asyncio.run(partition.restore(make_settings(), committed, metadata, checkpoints))


def test_a_trailing_checkpoint_gives_what_is_still_above_the_commit() -> None:
    # Written after the commit of 8; Kafka has 10 since: what is below 10 drops out.
    store = checkpoint(8, [9, 11], {8: 2, 10: 3, 12: 1})
    assert restore(store, 10) == ([11], {10: 3, 12: 1})


def test_a_checkpoint_newer_than_the_commit_is_ignored() -> None:
    store = checkpoint(12, [14], {12: 2})  # the group was rewound to 10
    assert restore(store, 10) == ([], {})


def test_an_item_from_before_the_counts_gives_none() -> None:
    store = MemoryCheckpoints()
    store.put(10, encode_settled(10, [12]) or "")
    assert restore(store, 10) == ([12], {})


def test_commit_metadata_and_the_item_are_joined_and_the_item_gives_the_counts() -> None:
    # The item may be ahead of the metadata: written while the offset was held, after the
    # commit (the bounded window counts on it alone).
    store = checkpoint(10, [13], {11: 4})
    metadata = encode_settled(10, [12])
    assert restore(store, 10, metadata) == ([12, 13], {11: 4})


def test_a_trailing_item_adds_what_is_above_the_commit_to_its_metadata() -> None:
    store = checkpoint(8, [9, 14], {})
    metadata = encode_settled(10, [12])
    assert restore(store, 10, metadata) == ([12, 14], {})


def test_garbled_counts_are_ignored_but_the_settled_set_is_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryCheckpoints()
    store.put(10, encode_settled(10, [12]) or "", "a1:garbage!")
    assert restore(store, 10) == ([12], {})
    assert "ignoring the failed-delivery counts" in caplog.text


def test_without_the_encoding_nothing_is_restored() -> None:
    store = checkpoint(10, [12], {11: 4})
    settings = make_settings(encode_settled=False)
    assert asyncio.run(partition.restore(settings, 10, None, store)) == ([], {})


async def until(predicate: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def test_a_restarted_proxy_continues_the_counts(caplog: pytest.LogCaptureFixture) -> None:
    # Offset 0 had failed four times of five, offset 1 all five: 1 is dead-lettered at
    # once, 0 waits its gap (4/7 of 7 s) and then has one attempt left.
    caplog.set_level(logging.INFO, logger="triage_proxy.pipeline.partition")
    log = MemoryPartition("orders", 0)
    for value in (b"pill", b"spent", b"fine"):
        log.append(value)
    store = MemoryStore()
    proxy = Proxy(
        make_settings(),
        0,
        log=log,
        store=store,
        checkpoints=checkpoint(0, [], {0: 4, 1: 5}),
        leases=MemoryLeases(),
    )

    async def scenario() -> None:
        async with proxy:
            pipeline = proxy.pipelines.get(proxy.partition)
            assert pipeline is not None
            dispatcher = pipeline.dispatcher
            assert dispatcher is not None
            await until(lambda: dispatcher.counters.dead_lettered == 1)
            assert dispatcher.failures() == {0: 4}
            assert dispatcher.queued == 1  # only "fine"; 0 is in its backoff

    asyncio.run(asyncio.wait_for(scenario(), 30))
    (item,) = store.items.values()
    dl = dead_letter_from_item(item)
    assert (dl.record.offset, dl.attempts) == (1, 5)
    assert dl.reason == "delivery attempts exhausted (5) before a proxy restart"
    assert "2 with failed deliveries" in caplog.text


def test_the_first_commits_keep_what_the_previous_run_settled_beyond_the_window() -> None:
    # The previous run settled 10..29 above its commit of 0; this run's window (5) fills
    # with 0..4, which no instance takes, so the fetch never reaches 10. Its commits must
    # still record 10..29, or a kill now would redeliver them after the next restart.
    log = MemoryPartition("orders", 0)
    for i in range(30):
        log.append(b"m%d" % i)
    checkpoints = checkpoint(0, list(range(10, 30)), {})
    proxy = Proxy(
        make_settings(window=5, commit_s=0.05),
        0,
        log=log,
        store=MemoryStore(),
        checkpoints=checkpoints,
        leases=MemoryLeases(),
    )

    async def scenario() -> None:
        async with proxy:
            pipeline = proxy.pipelines.get(proxy.partition)
            assert pipeline is not None
            committer = pipeline.committer
            assert committer is not None
            await until(lambda: committer.commits >= 1 and checkpoints.puts >= 2)
            assert proxy.snapshot().in_window == 5

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert checkpoints.value == (0, encode_settled(0, list(range(10, 30))))
