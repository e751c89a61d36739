"""Unit tests of dead-letter notifications: the aggregation policy with a fake clock, the
component's lifecycle over the in-memory sink, and its wiring into the writer."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests import samples
from tests.samples import T0
from tests.unit import virtual_time
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.deadletters.notifier import (
    MAX_TRACKED_REASONS,
    SUMMARY_REASON_CHARS,
    Aggregator,
    DeadLetterNotifier,
    MemorySink,
    NotifierState,
    Summary,
    WebhookSink,
    next_send_at,
    notifier_from_settings,
)
from triage_proxy.deadletters.writer import DeadLetterWriter
from triage_proxy.errors import ConfigError, StateError
from triage_proxy.store.deadletter_store import MemoryStore
from triage_proxy.structs import DeadLetter


def make_dl(offset: int, **fields: Any) -> DeadLetter:
    """The sample dead letter with a payload the notifier must never send."""
    fields = {"value": b"secret payload", "reason": "boom", "attempts": 5, **fields}
    return samples.make_dl(offset, timestamp_ms=T0, **fields)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- the policy -----------------------------------------------------------------------


def test_first_dead_letter_waits_only_the_gather_delay() -> None:
    assert next_send_at(100.0, None, 60.0, 1.0) == 101.0
    assert next_send_at(100.0, 10.0, 60.0, 1.0) == 101.0
    assert next_send_at(100.0, 90.0, 60.0, 1.0) == 150.0
    assert next_send_at(100.0, None, 0.5, 1.0) == 100.5


@given(
    opened=st.floats(0, 1e6),
    since_sent=st.none() | st.floats(0, 1e6),
    interval=st.floats(0.001, 1e4),
    gather=st.floats(0, 1e4),
)
def test_policy_bounds(
    opened: float, since_sent: float | None, interval: float, gather: float
) -> None:
    last = None if since_sent is None else opened - since_sent  # a window opens after a send
    at = next_send_at(opened, last, interval, gather)
    assert at <= opened + interval + 1e-6  # nothing waits longer than the interval
    assert at >= opened
    if last is not None:
        assert at >= last + interval  # at most one message per interval


def test_ten_thousand_dead_letters_make_a_handful_of_summaries() -> None:
    clock = FakeClock()
    aggregator = Aggregator("orders[0]", "dlq", interval_s=5.0, gather_s=1.0)
    sent: list[tuple[float, Summary]] = []

    def tick() -> None:
        summary = aggregator.take(clock.now)
        if summary is not None:
            aggregator.sent(True, clock.now)
            sent.append((clock.now, summary))

    start = clock.now
    for i in range(10_000):  # 10,000 dead letters over 10 seconds, the clock checked each time
        clock.now = start + i / 1000
        aggregator.record(make_dl(i, reason=f"reason-{i % 7}"), clock.now)
        tick()
    while clock.now < start + 30:
        clock.now += 0.1
        tick()
    assert 2 <= len(sent) <= 4
    assert sent[0][0] == pytest.approx(start + 1.0)  # the burst's start is seen at once
    assert sum(s.count for _, s in sent) == 10_000
    assert aggregator.pending == 0
    assert sent[0][1].partitions[0].first_offset == 0
    assert sent[-1][1].partitions[0].last_offset == 9_999
    times = [t for t, _ in sent]
    assert all(b - a >= 5.0 - 1e-9 for a, b in itertools.pairwise(times))
    assert sent[0][1].top_reasons[0][1] > 0


def test_summary_content() -> None:
    clock = FakeClock()
    aggregator = Aggregator("orders[*]", "dlq", interval_s=60.0)
    for i, reason in enumerate(["a", "b", "a", "c", "a", "b", "d", "e", "f", "g"]):
        aggregator.record(make_dl(100 + i, partition=i % 2, reason=reason, at_ms=T0 + i), clock.now)
    clock.now += 1
    summary = aggregator.take(clock.now)
    assert summary is not None
    assert summary.count == 10
    assert [(p.partition, p.count, p.first_offset, p.last_offset) for p in summary.partitions] == [
        (0, 5, 100, 108),
        (1, 5, 101, 109),
    ]
    assert summary.top_reasons[:2] == (("a", 3), ("b", 2))
    assert len(summary.top_reasons) == 5
    assert summary.other_reasons == 10 - sum(n for _, n in summary.top_reasons)
    doc = summary.to_json()
    json.dumps(doc)
    assert doc["first_dead_lettered_at"] == "2024-05-01T12:00:00.000Z"
    assert doc["last_dead_lettered_at"] == "2024-05-01T12:00:00.009Z"
    assert "secret payload" not in json.dumps(doc)
    assert summary.subject() == "Triage: 10 dead letters in orders[0], orders[1]"


def test_failed_send_puts_the_counts_back_and_waits_an_interval() -> None:
    clock = FakeClock()
    aggregator = Aggregator("p", "dlq", interval_s=10.0, gather_s=1.0)
    aggregator.record(make_dl(1), clock.now)
    clock.now += 1
    first = aggregator.take(clock.now)
    assert first is not None
    assert aggregator.due_at() is None  # nothing else goes out while one is being sent
    aggregator.record(make_dl(2), clock.now)
    aggregator.sent(False, clock.now)
    assert aggregator.pending == 2
    assert aggregator.take(clock.now + 9) is None
    retry = aggregator.take(clock.now + 10)
    assert retry is not None
    assert retry.count == 2
    assert [(p.first_offset, p.last_offset) for p in retry.partitions] == [(1, 2)]


def test_distinct_reasons_are_bounded() -> None:
    aggregator = Aggregator("p", "dlq", interval_s=1.0)
    for i in range(MAX_TRACKED_REASONS + 50):
        aggregator.record(make_dl(i, reason=f"id {i}"), 0.0)
    summary = aggregator.take(10.0)
    assert summary is not None
    assert summary.count == MAX_TRACKED_REASONS + 50
    assert summary.other_reasons == summary.count - len(summary.top_reasons)


def test_summary_reasons_are_cut_at_summary_reason_chars() -> None:
    """Reasons that differ only past the cut are one reason in the summary."""
    aggregator = Aggregator("p", "dlq", interval_s=1.0)
    head = "r" * SUMMARY_REASON_CHARS
    aggregator.record(make_dl(1, reason=head + " request id 1"), 0.0)
    aggregator.record(make_dl(2, reason=head + " request id 2"), 0.0)
    aggregator.record(make_dl(3, reason=head[:-1]), 0.0)
    summary = aggregator.take(10.0)
    assert summary is not None
    assert summary.top_reasons == ((head, 2), (head[:-1], 1))
    assert summary.to_json()["top_reasons"][0] == {"reason": head, "count": 2}


def test_interval_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="notify_interval_s"):
        Aggregator("p", "dlq", interval_s=0)


# --- the component --------------------------------------------------------------------


def run(coro: Any, timeout: float = 15.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_notifier_sends_aggregated_summaries_and_a_final_one_at_stop() -> None:
    sink = MemorySink()

    async def main() -> None:
        notifier = DeadLetterNotifier(
            [sink],
            source="orders[0]",
            table="dlq",
            interval_s=0.3,
            gather_s=0.05,
            clock=asyncio.get_running_loop().time,
        )
        async with notifier:
            for i in range(1000):
                notifier.record(make_dl(i))
            await asyncio.sleep(0.15)
            assert [s.count for s in sink.summaries] == [1000]
            for i in range(1000, 1500):
                notifier.record(make_dl(i))
                if i % 100 == 0:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            assert len(sink.summaries) == 1  # the interval has not passed yet
            notifier.record(make_dl(1500))
        assert notifier.state is NotifierState.STOPPED
        assert sum(s.count for s in sink.summaries) == 1501
        assert len(sink.summaries) <= 3
        assert notifier.pending == 0

    virtual_time.run(main())  # the loop's clock, which jumps: each wait is exact


def test_notifier_retries_after_a_failed_send() -> None:
    sink = MemorySink()
    sink.fail = True

    async def main() -> None:
        notifier = DeadLetterNotifier(
            [sink],
            source="p",
            table="dlq",
            interval_s=0.2,
            gather_s=0.01,
            clock=asyncio.get_running_loop().time,
        )
        async with notifier:
            notifier.record(make_dl(1))
            await asyncio.sleep(0.1)
            assert notifier.failed == 1
            sink.fail = False
            notifier.record(make_dl(2))
            await asyncio.sleep(0.3)
            assert [s.count for s in sink.summaries] == [2]

    virtual_time.run(main())  # the loop's clock, which jumps: each wait is exact


def test_notifier_lifecycle() -> None:
    async def main() -> None:
        notifier = DeadLetterNotifier([MemorySink()], source="p", table="t", interval_s=1)
        await notifier.start()
        with pytest.raises(StateError):
            await notifier.start()
        await asyncio.gather(notifier.stop(), notifier.stop())
        await notifier.stop()
        assert notifier.state is NotifierState.STOPPED
        notifier.record(make_dl(1))  # ignored, no error
        never = DeadLetterNotifier([MemorySink()], source="p", table="t", interval_s=1)
        await never.stop()
        with pytest.raises(StateError):
            await never.start()

    run(main())


def test_writer_tells_the_notifier_about_every_durable_dead_letter() -> None:
    sink = MemorySink()
    settings = DeadLetterSettings(table="dlq", flush_interval_ms=5)

    async def main() -> None:
        store = MemoryStore()
        notifier = DeadLetterNotifier(
            [sink], source="orders[0]", table="dlq", interval_s=10, gather_s=0.01
        )
        async with notifier:
            store.fail_next(2)
            async with DeadLetterWriter(
                store, settings, lambda dl: None, notifier=notifier, sleep=_no_sleep
            ) as writer:
                for i in range(60):
                    writer.submit(make_dl(i))
                assert await writer.flush(5)
        assert sum(s.count for s in sink.summaries) == 60  # stop() sent the rest
        assert len(sink.summaries) <= 2

    run(main())


async def _no_sleep(delay: float) -> None:
    await asyncio.sleep(0)


def test_from_settings() -> None:
    assert notifier_from_settings(DeadLetterSettings(table="t"), "p") is None
    hooked = notifier_from_settings(
        DeadLetterSettings(table="t", notify_webhook_url="http://127.0.0.1:1/hook"), "p"
    )
    assert hooked is not None
    with pytest.raises(ConfigError, match="notify_webhook_url"):
        WebhookSink("file:///etc/passwd")
