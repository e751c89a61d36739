"""The fetcher against in-memory twins on a virtual clock: no broker, no real waiting.

The dispatcher is the real one (it does no I/O); the partition and the Kafka thread are
twins (tests/unit/twins.py) and the backoff waits pass on the loop's virtual clock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tests.unit.test_dispatcher import connect
from tests.unit.twins import KAFKA_CALL_S, FlakyPartition, InlineKafkaThread
from tests.unit.virtual_time import gaps, run, until
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.errors import BrokerUnavailable
from triage_proxy.pipeline.dispatch import Dispatcher
from triage_proxy.pipeline.fetcher import Fetcher
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.structs import DeadLetter, Record

BACKOFFS_S = [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
"""The fetcher's waits after consecutive failed fetches: doubling from 0.1 s, capped at 5 s."""


@dataclass
class Rig:
    partition: FlakyPartition
    dispatcher: Dispatcher
    fetcher: Fetcher
    closing: asyncio.Event
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.closing.set()
        async with asyncio.timeout(1):
            await self.task


async def start(
    *,
    records: int,
    max_messages: int = 1000,
    fetch_batch: int = 100,
    buffered: Callable[[int], list[Record]] | None = None,
    arm: Callable[[Callable[[], None]], bool] | None = None,
) -> Rig:
    loop = asyncio.get_running_loop()
    settings = settings_from_dict(
        {
            "kafka": {
                "bootstrap_servers": "b",
                "topic": "t",
                "group_id": "g",
                "fetch_batch": fetch_batch,
            },
            "auth": {"token": "unit-test-token-0123"},
            "dead_letters": {"table": "dlq"},
            "window": {"max_messages": max_messages},
        },
        {},
    )
    dead: list[DeadLetter] = []
    dispatcher = Dispatcher(settings, 0, CommitTracker(0), dead.append, monotonic=loop.time)
    partition = FlakyPartition(loop.time)
    partition.fill(records)
    closing = asyncio.Event()
    fetcher = Fetcher(
        partition,
        InlineKafkaThread(),
        dispatcher,
        fetch_batch,
        closing,
        buffered=buffered,
        arm=arm,
    )
    task = asyncio.create_task(fetcher.run())
    return Rig(partition, dispatcher, fetcher, closing, task)


def test_fetches_the_partition_into_the_dispatcher_in_batches() -> None:
    async def main() -> None:
        rig = await start(records=250, fetch_batch=100)
        await until(lambda: rig.dispatcher.in_window == 250)
        assert rig.partition.fetch_sizes == [100, 100, 100]
        assert rig.dispatcher.queued == 250  # no instance yet: all ready for delivery
        assert not rig.fetcher.paused
        assert not rig.fetcher.degraded

        rig.partition.fill(5)  # the log grows: the idle loop picks it up
        await until(lambda: rig.dispatcher.in_window == 255)
        await rig.stop()

    run(main())


def test_a_full_window_pauses_fetching_until_there_is_room_for_a_batch() -> None:
    # 8 messages: the window takes 8, and fetching resumes once 2 (a quarter) fit again.
    async def main() -> None:
        rig = await start(records=20, max_messages=8)
        await until(lambda: rig.fetcher.paused)
        assert rig.partition.position == 8
        fetches = len(rig.partition.fetch_times)
        await asyncio.sleep(30)  # however long it stays full, nothing more is taken
        assert (rig.partition.position, len(rig.partition.fetch_times)) == (8, fetches)

        session = connect(rig.dispatcher, "a", 8)
        rig.dispatcher.settle(session, [0], [])
        await asyncio.sleep(1)
        assert rig.fetcher.paused  # room for 1 is not worth a fetch
        assert rig.partition.position == 8

        rig.dispatcher.settle(session, [1], [])
        await until(lambda: rig.partition.position == 10)
        assert rig.partition.fetch_sizes == [8, 2]
        await until(lambda: rig.fetcher.paused)  # full again
        assert rig.dispatcher.in_window == 8
        await rig.stop()

    run(main())


def test_broker_errors_back_off_doubling_to_the_cap_and_recover(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="triage_proxy.pipeline.fetcher")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        rig = await start(records=0)
        rig.partition.failing_fetches = len(BACKOFFS_S)
        rig.partition.fill(5)
        await until(lambda: rig.fetcher.degraded)
        await until(lambda: rig.dispatcher.in_window == 5)
        assert not rig.fetcher.degraded
        # The outage began before the first fetch ran (the task had not started yet); each
        # retry waits its backoff (plus the twin's one Kafka call).
        failed = rig.partition.fetch_times[: len(BACKOFFS_S) + 1]
        assert gaps(failed) == pytest.approx([b + KAFKA_CALL_S for b in BACKOFFS_S])

        # A later outage starts again from the first backoff: success reset it.
        rig.partition.failing_fetches = 2
        times = rig.partition.fetch_times
        before = len(times)
        await until(lambda: rig.fetcher.degraded)
        await until(lambda: not rig.fetcher.degraded)
        again = times[before - 1 :]
        assert gaps(again)[:3] == pytest.approx(
            [KAFKA_CALL_S, 0.1 + KAFKA_CALL_S, 0.2 + KAFKA_CALL_S]
        )
        assert loop.time() < 30  # virtual: the 17 s of backoff took no real time
        await rig.stop()

    run(main())
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    degraded = [m for level, m in messages if level == logging.WARNING]
    recovered = [m for level, m in messages if level == logging.INFO]
    assert len(degraded) == 2  # once per outage, not once per failed fetch
    assert all(m.startswith("degraded: fetch failing") for m in degraded)
    assert recovered == ["recovered: fetching again"] * 2


def test_closing_ends_the_loop_whatever_it_waits_on() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()

        # Waiting for room in a full window.
        rig = await start(records=10, max_messages=4)
        await until(lambda: rig.fetcher.paused)
        await rig.stop()
        assert rig.partition.position == 4

        # Waiting out a 5 s backoff: it ends at once, with no further fetch.
        rig = await start(records=0)
        rig.partition.failing_fetches = 100
        await until(lambda: len(rig.partition.fetch_times) == 8)
        fetches, stop_at = len(rig.partition.fetch_times), loop.time()
        await rig.stop()
        assert loop.time() - stop_at < KAFKA_CALL_S
        assert len(rig.partition.fetch_times) == fetches
        assert rig.fetcher.paused  # a stopped fetcher reports itself paused

        # Closed before it ran: it never fetches.
        rig = await start(records=10)
        rig.closing.set()
        await rig.stop()
        assert rig.partition.fetch_times == []

    run(main())


class Buffered:
    """What a process's reader holds for the partition (kafka/reader.py's take_buffered):
    the records it is given, taken without waiting; `failing` of the next takes raise."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.takes: list[int] = []
        """`max_records` of each take that returned records."""
        self.failing = 0

    def __call__(self, max_records: int) -> list[Record]:
        if self.failing:
            self.failing -= 1
            raise BrokerUnavailable("take failed (twin)")
        out, self.records = self.records[:max_records], self.records[max_records:]
        if out:
            self.takes.append(max_records)
        return out


def test_records_already_buffered_are_taken_on_the_loop_and_the_rest_fetched() -> None:
    async def main() -> None:
        buffered = Buffered()
        rig = await start(records=0, fetch_batch=100, max_messages=1000, buffered=buffered)
        # Buffered: 250 records at offsets 0-249 (the partition twin's log stays empty).
        twin = FlakyPartition(asyncio.get_running_loop().time)
        twin.fill(250)
        buffered.records = list(twin.log)
        await until(lambda: rig.dispatcher.in_window == 250)
        assert buffered.takes == [100, 100, 100]
        assert rig.partition.fetch_sizes == []  # nothing went to the fetch thread

        # Nothing buffered: the fetch thread's fetch brings what the log has.
        for offset in range(250, 260):
            rig.partition.append(b"v", offset=offset)
        await until(lambda: rig.dispatcher.in_window == 260)
        assert rig.partition.fetch_sizes != []

        # A failing take is a failing fetch: degraded, backed off, recovered.
        buffered.failing = 1
        await until(lambda: rig.fetcher.degraded)
        await until(lambda: not rig.fetcher.degraded)
        await rig.stop()

    run(main())


def test_a_full_window_takes_nothing_more_from_the_buffer() -> None:
    async def main() -> None:
        buffered = Buffered()
        rig = await start(records=0, max_messages=8, buffered=buffered)
        twin = FlakyPartition(asyncio.get_running_loop().time)
        twin.fill(20)
        buffered.records = list(twin.log)
        await until(lambda: rig.fetcher.paused)
        assert rig.dispatcher.in_window == 8
        assert len(buffered.records) == 12
        await asyncio.sleep(30)
        assert len(buffered.records) == 12  # however long it stays full
        await rig.stop()

    run(main())


class ArmedBuffer(Buffered):
    """A reader's buffer that also wakes a waiting pipeline (kafka/reader.py's `arm`): the
    waker is called once when records come (`deliver`), as the reader thread does."""

    def __init__(self) -> None:
        super().__init__()
        self.waker: Callable[[], None] | None = None
        self.armed = 0

    def arm(self, wake: Callable[[], None]) -> bool:
        if self.records or self.failing:
            return False
        self.waker = wake
        self.armed += 1
        return True

    def deliver(self, records: list[Record]) -> None:
        self.records += records
        waker, self.waker = self.waker, None
        if waker is not None:
            waker()


def test_an_empty_buffer_is_waited_for_on_the_loop_not_on_the_fetch_thread() -> None:
    async def main() -> None:
        buffer = ArmedBuffer()
        rig = await start(records=0, buffered=buffer, arm=buffer.arm)
        await until(lambda: buffer.waker is not None)
        twin = FlakyPartition(asyncio.get_running_loop().time)
        twin.fill(30)
        buffer.deliver(list(twin.log)[:10])
        await until(lambda: rig.dispatcher.in_window == 10)
        await until(lambda: buffer.waker is not None)  # empty again: armed again
        buffer.deliver(list(twin.log)[10:])
        await until(lambda: rig.dispatcher.in_window == 30)
        # A failed take (the reader's error) is a failing fetch, as before.
        buffer.failing = 1
        buffer.deliver([])
        await until(lambda: rig.fetcher.degraded)
        await until(lambda: not rig.fetcher.degraded)
        assert rig.partition.fetch_sizes == []  # nothing ever went to the fetch thread
        await until(lambda: buffer.waker is not None)
        await rig.stop()  # closing ends a wait for records

    run(main())
