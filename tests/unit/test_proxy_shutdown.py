"""The proxy's shutdown order (app.py's module docstring), with in-memory twins only.

A real gRPC instance on localhost holds one delivery and has nacked another while the
dead-letter store holds the write back; the proxy is told to stop. One list records,
in order, what the twins saw (fetches, the dead-letter write, commits, the lease
release, the Kafka close) and the proxy's shutdown-step log lines.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import pytest

from tests.unit.wire import consume_call, hello, serving, take
from tests.waiting import eventually
from triage_protocol import triage_pb2 as pb
from triage_proxy.app import Proxy, ProxyState
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.settings import Settings
from triage_proxy.kafka.client import MemoryPartition
from triage_proxy.store.checkpoints import MemoryCheckpoints
from triage_proxy.store.deadletter_store import MemoryStore
from triage_proxy.store.leases import MemoryLeases
from triage_proxy.structs import DeadLetter, Record

TOKEN = "shutdown-order-token-0123"

STEP_LOGS = {
    "fetcher stopped": "stop fetching",
    "drained;": "drained",
    "dead letters flushed;": "dead letters flushed",
    "streams ended; gRPC server stopped": "server stopped",
}
"""Log lines of shutdown steps (message prefix -> event name) that have no twin to see them."""


class Events(logging.Handler):
    """The one ordered record: twins append to it, and so does logging (as a handler)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []

    def add(self, event: str) -> None:
        self.seen.append(event)  # list.append is atomic: twins call it from other threads

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for prefix, event in STEP_LOGS.items():
            if message.startswith(prefix):
                self.add(event)

    def index(self, event: str) -> int:
        return self.seen.index(event)

    def last(self, event: str) -> int:
        return len(self.seen) - 1 - self.seen[::-1].index(event)


class RecordingPartition(MemoryPartition):
    def __init__(self, events: Events) -> None:
        super().__init__("orders", 0)
        self.events = events

    def fetch(self, max_records: int) -> list[Record]:
        self.events.add("fetch")
        return super().fetch(max_records)

    def commit(self, offset: int, metadata: str | None = None) -> None:
        super().commit(offset, metadata)
        self.events.add(f"commit {offset}")

    def close(self) -> None:
        super().close()
        self.events.add("close kafka")


class RecordingStore(MemoryStore):
    def __init__(self, events: Events) -> None:
        super().__init__()
        self.events = events

    def put_batch(self, items: Sequence[DeadLetter]) -> list[DeadLetter]:
        unwritten = super().put_batch(items)
        self.events.add("dead letter written")
        return unwritten


class RecordingLeases(MemoryLeases):
    def __init__(self, events: Events) -> None:
        super().__init__()
        self.events = events

    def release(self, owner: str) -> bool:
        released = super().release(owner)
        self.events.add("release lease")
        return released


@pytest.fixture
def events() -> Iterator[Events]:
    handler = Events()
    logger = logging.getLogger("triage_proxy")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def make_settings() -> Settings:
    return settings_from_dict(
        {
            "kafka": {"bootstrap_servers": "127.0.0.1:1", "topic": "orders", "group_id": "g"},
            "auth": {"token": TOKEN},
            "dead_letters": {"table": "dlq", "flush_interval_ms": 1},
            "server": {"host": "127.0.0.1", "port": 0, "http_port": 0},
            # No periodic commit: the only commit is the final one.
            "commit": {"interval_s": 3600},
            "shutdown": {"drain_timeout_s": 30},
            "ownership": {"enabled": True},
        },
        {},
    )


def test_shutdown_runs_in_the_documented_order(events: Events) -> None:
    log = RecordingPartition(events)
    for value in (b"a", b"b", b"c"):
        log.append(value)
    store = RecordingStore(events)
    leases = RecordingLeases(events)
    proxy = Proxy(
        make_settings(), 0, log=log, store=store, checkpoints=MemoryCheckpoints(), leases=leases
    )

    async def scenario() -> None:
        async with serving(proxy), consume_call(proxy, TOKEN) as call:
            try:
                await stop_in_order(call)
            finally:
                store.gate.set()

    async def stop_in_order(call: Any) -> None:
        await hello(call)
        assert await take(call, 3) == [0, 1, 2]
        store.gate.clear()  # the dead letter's write is held until the test lets it go
        nack = pb.Nack(offset=1, reason="bad", retry=False)
        await call.write(pb.ConsumerFrame(settle=pb.Settle(acks=[0], nacks=[nack])))
        await eventually(lambda: len(store.calls) == 1)

        proxy.stop()
        await eventually(lambda: "stop fetching" in events.seen)
        log.append(b"late")  # fetching has stopped: this one is never delivered
        assert proxy.state is ProxyState.STOPPING
        # Not drained while offset 2 is held and the dead letter unwritten, nor once 2 is
        # acked while the write is held: the order checked below shows both ("drained"
        # after "instance acks 2" and after "dead letter written"), with no wait here.
        events.add("instance acks 2")
        await call.write(pb.ConsumerFrame(settle=pb.Settle(acks=[2])))
        # The proxy has read that settlement once it rejects a later one (same stream).
        await call.write(pb.ConsumerFrame(settle=pb.Settle(acks=[10**9])))
        assert (await call.read()).rejected.offsets == [10**9]
        assert "drained" not in events.seen  # acked, but the dead letter is still held
        store.gate.set()
        assert await call.read() == grpc.aio.EOF  # the proxy ended the stream, "late" unsent
        assert await call.code() == grpc.StatusCode.OK
        await proxy.wait_stopped()

    asyncio.run(asyncio.wait_for(scenario(), 30))

    assert proxy.state is ProxyState.STOPPED
    order = [
        "stop fetching",
        "instance acks 2",
        "dead letter written",
        "drained",
        "dead letters flushed",
        "server stopped",
        "commit 3",
        "release lease",
        "close kafka",
    ]
    assert [events.index(e) for e in order] == sorted(events.index(e) for e in order), events.seen
    assert events.last("fetch") < events.index("stop fetching")
    assert [e for e in events.seen if e.startswith("commit")] == ["commit 3"]  # not 4
    assert events.seen.count("release lease") == 1
    assert events.seen[-1] == "close kafka"
    assert leases.lease is None  # a standby may take over at once
    assert log.closed
