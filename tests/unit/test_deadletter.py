"""Unit tests of the dead-letter item format, backoff policy and writer (MemoryStore twin)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Coroutine
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests import samples, waiting
from tests.samples import GROUP, T0
from tests.unit import virtual_time
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.deadletters.writer import DeadLetterWriter, WriterState, backoff_delay
from triage_proxy.errors import ConfigError, DeadLetterTooLarge, DeadLetterUnavailable, StateError
from triage_proxy.store.deadletter_store import MemoryStore
from triage_proxy.store.items import (
    MAX_ITEM_BYTES,
    dead_letter_from_item,
    format_iso_ms,
    item_from_dead_letter,
    item_size,
)
from triage_proxy.structs import DeadLetter, Headers, Record

LOGGER = "triage_proxy.deadletters.writer"


def make_dl(offset: int, **fields: Any) -> DeadLetter:
    """The sample dead letter with reason "boom", timestamp T0, dead-lettered at T0 + 123."""
    return samples.make_dl(
        offset, **{"reason": "boom", "timestamp_ms": T0, "at_ms": T0 + 123, **fields}
    )


def dl_settings(**overrides: Any) -> DeadLetterSettings:
    values: dict[str, Any] = {"table": "dead-letters", "flush_interval_ms": 5, "retry_max_s": 5.0}
    values.update(overrides)
    return DeadLetterSettings(**values)


def run(coro: Coroutine[Any, Any, None], timeout: float = 15.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout))


eventually = functools.partial(waiting.eventually, within=5.0)


class Harness:
    """A MemoryStore, a writer over it, what it reported, and the pauses it asked for."""

    def __init__(self, *, real_pause: float | None = None, **kwargs: Any) -> None:
        self.store = MemoryStore()
        self.written: list[DeadLetter] = []
        self.sleeps: list[float] = []
        self._real_pause = real_pause
        settings = dl_settings(**kwargs.pop("settings", {}))
        kwargs.setdefault("sleep", self.sleep)
        kwargs.setdefault("rand", lambda: 1.0)
        self.writer = DeadLetterWriter(self.store, settings, self.on_written, **kwargs)

    def on_written(self, dl: DeadLetter) -> None:
        item = item_from_dead_letter(dl, GROUP)
        key = (item["source"]["S"], dl.record.offset)
        assert key in self.store.items, "reported before the store held it"
        self.written.append(dl)

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        await asyncio.sleep(self._real_pause or 0)


# --- item format ----------------------------------------------------------------------


def test_item_schema_is_exact() -> None:
    dl = make_dl(42, partition=3, headers=(("trace", b"\x01"), ("empty", None)), reason="bad ✗")
    assert item_from_dead_letter(dl, GROUP) == {
        "source": {"S": f"orders#3#dead#{GROUP}"},
        "offset": {"N": "42"},
        "group": {"S": GROUP},
        "topic": {"S": "orders"},
        "partition": {"N": "3"},
        "key": {"B": b"k"},
        "value": {"B": b"v"},
        "headers": {
            "L": [
                {"M": {"k": {"S": "trace"}, "v": {"B": b"\x01"}}},
                {"M": {"k": {"S": "empty"}}},
            ]
        },
        "timestamp_ms": {"N": "1714564800000"},
        "reason": {"S": "bad ✗"},
        "attempts": {"N": "3"},
        "consumer_id": {"S": "worker-1"},
        "dead_lettered_at": {"S": "2024-05-01T12:00:00.123Z"},
        "status": {"S": "pending"},
        "dl_state": {"S": f"pending#{GROUP}"},
    }


def test_null_key_value_and_no_headers_are_absent() -> None:
    item = item_from_dead_letter(make_dl(1, key=None, value=None), GROUP)
    assert "key" not in item
    assert "value" not in item
    assert "headers" not in item
    assert dead_letter_from_item(item) == make_dl(1, key=None, value=None)


def test_empty_bytes_are_not_null() -> None:
    dl = make_dl(1, key=b"", value=b"", headers=(("h", b""),))
    item = item_from_dead_letter(dl, GROUP)
    assert item["key"] == {"B": b""}
    assert item["value"] == {"B": b""}
    assert dead_letter_from_item(item) == dl


def test_empty_header_list_reads_back_as_no_headers() -> None:
    item = item_from_dead_letter(make_dl(1), GROUP)
    item["headers"] = {"L": []}
    assert dead_letter_from_item(item).record.headers == ()


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "1970-01-01T00:00:00.000Z"),
        (1_714_564_800_123, "2024-05-01T12:00:00.123Z"),
        (999, "1970-01-01T00:00:00.999Z"),
    ],
)
def test_iso_timestamp(ms: int, text: str) -> None:
    assert format_iso_ms(ms) == text


_headers = st.lists(st.tuples(st.text(max_size=20), st.none() | st.binary(max_size=20)), max_size=5)


@given(
    topic=st.text(
        st.characters(whitelist_categories=("L", "N"), whitelist_characters="._-"),
        min_size=1,
        max_size=40,
    ),
    partition=st.integers(0, 10_000),
    offset=st.integers(0, 2**63 - 1),
    key=st.none() | st.binary(max_size=64),
    value=st.none() | st.binary(max_size=512),
    headers=_headers.map(tuple),
    timestamp_ms=st.integers(-1, 2**45),
    reason=st.text(max_size=100),
    attempts=st.integers(0, 1000),
    consumer_id=st.text(max_size=30),
    dead_lettered_at_ms=st.integers(0, 253_402_300_799_999),
)
def test_round_trip_is_exact(
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    headers: Headers,
    timestamp_ms: int,
    reason: str,
    attempts: int,
    consumer_id: str,
    dead_lettered_at_ms: int,
) -> None:
    record = Record(topic, partition, offset, key, value, headers, timestamp_ms)
    dl = DeadLetter(record, reason, attempts, consumer_id, dead_lettered_at_ms)
    assert dead_letter_from_item(item_from_dead_letter(dl, GROUP)) == dl


def test_too_large_item_is_refused_at_the_limit() -> None:
    base = item_size(make_dl(1, value=b""), GROUP)
    fits = make_dl(1, value=b"x" * (MAX_ITEM_BYTES - base))
    assert item_size(fits, GROUP) == MAX_ITEM_BYTES
    item_from_dead_letter(fits, GROUP)
    over = make_dl(1, value=b"x" * (MAX_ITEM_BYTES - base + 1))
    with pytest.raises(DeadLetterTooLarge) as info:
        item_from_dead_letter(over, GROUP)
    assert info.value.key == ("orders", 0, 1)
    assert not info.value.retriable


def test_item_size_counts_headers_and_unicode() -> None:
    plain = item_size(make_dl(1), GROUP)
    assert item_size(make_dl(1, reason="é" * 10), GROUP) == plain - len("boom") + 20
    assert item_size(make_dl(1, headers=(("ab", b"xyz"),)), GROUP) > plain + 5


# --- backoff policy -------------------------------------------------------------------


def test_backoff_doubles_then_caps() -> None:
    delays = [backoff_delay(n, 1.0) for n in range(1, 8)]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


@given(
    failures=st.integers(1, 100_000),
    cap=st.floats(0.001, 3600),
    rand=st.floats(0, 1),
)
def test_backoff_bounds(failures: int, cap: float, rand: float) -> None:
    delay = backoff_delay(failures, cap, rand=rand)
    full = backoff_delay(failures, cap)
    assert full / 2 <= delay <= full <= cap
    assert backoff_delay(failures + 1, cap) >= full


# --- the memory twin ------------------------------------------------------------------


def test_memory_store_fails_and_leaves_items_on_demand() -> None:
    store = MemoryStore()
    batch = [make_dl(i) for i in range(5)]
    store.fail_next(1)
    with pytest.raises(DeadLetterUnavailable):
        store.put_batch(batch)
    store.leave_unprocessed(2)
    assert store.put_batch(batch) == batch[3:]
    assert [dl.record.offset for dl in store.dead_letters()] == [0, 1, 2]
    assert store.put_batch(batch) == []
    assert store.calls == [5, 5, 5]


def test_memory_store_rejects_what_dynamodb_rejects() -> None:
    store = MemoryStore()
    with pytest.raises(ValueError, match="at most 25"):
        store.put_batch([make_dl(i) for i in range(26)])
    with pytest.raises(ValueError, match="same key"):
        store.put_batch([make_dl(1), make_dl(1, reason="again")])


# --- the writer -----------------------------------------------------------------------


def test_batches_up_to_batch_size() -> None:
    h = Harness()

    async def main() -> None:
        dls = [make_dl(i) for i in range(60)]
        for dl in dls:
            h.writer.submit(dl)
        assert h.writer.pending == 60
        async with h.writer:
            assert await h.writer.flush(5)
        assert sorted(h.store.calls) == [10, 25, 25]
        assert sorted(dl.record.offset for dl in h.written) == list(range(60))
        assert h.writer.pending == 0
        assert h.writer.written == 60

    run(main())


def test_respects_configured_batch_size() -> None:
    h = Harness(settings={"batch_size": 7}, max_in_flight=1)

    async def main() -> None:
        async with h.writer:
            for i in range(20):
                h.writer.submit(make_dl(i))
            assert await h.writer.flush(5)
        assert h.store.calls == [7, 7, 6]
        assert [dl.record.offset for dl in h.written] == list(range(20))

    run(main())


def test_lone_item_waits_for_the_flush_interval() -> None:
    h = Harness(settings={"flush_interval_ms": 300})

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with h.writer:
            started = loop.time()
            h.writer.submit(make_dl(1))
            await asyncio.sleep(0.1)
            assert h.written == []
            assert await h.writer.flush(5)
            assert loop.time() - started >= 0.3
        assert h.store.calls == [1]

    virtual_time.run(main())  # the loop's clock, which jumps: each wait is exact


def test_full_batch_does_not_wait_for_the_interval() -> None:
    # A minute's interval: a full batch that waited for it would take 60 s, far past the
    # bound, which leaves a descheduled loop seconds of room.
    h = Harness(settings={"flush_interval_ms": 60_000})

    async def main() -> None:
        async with h.writer:
            started = time.monotonic()
            for i in range(25):
                h.writer.submit(make_dl(i))
            assert await h.writer.flush(30)
            assert time.monotonic() - started < 10
        assert h.store.calls == [25]

    run(main())


def test_retries_failures_with_exponential_backoff() -> None:
    h = Harness(max_in_flight=1)

    async def main() -> None:
        h.store.fail_next(4)
        async with h.writer:
            for i in range(3):
                h.writer.submit(make_dl(i))
            assert await h.writer.flush(5)
        assert h.sleeps == [0.05, 0.1, 0.2, 0.4]
        assert h.store.calls == [3] * 5
        assert len(h.written) == 3

    run(main())


def test_backoff_is_capped_at_retry_max() -> None:
    h = Harness(settings={"retry_max_s": 0.2})

    async def main() -> None:
        h.store.fail_next(6)
        async with h.writer:
            h.writer.submit(make_dl(1))
            assert await h.writer.flush(5)
        assert h.sleeps == [0.05, 0.1, 0.2, 0.2, 0.2, 0.2]

    run(main())


def test_jitter_shortens_the_pause() -> None:
    h = Harness(rand=lambda: 0.0)

    async def main() -> None:
        h.store.fail_next(2)
        async with h.writer:
            h.writer.submit(make_dl(1))
            assert await h.writer.flush(5)
        assert h.sleeps == [0.025, 0.05]

    run(main())


def test_unprocessed_items_are_retried() -> None:
    h = Harness(max_in_flight=1)

    async def main() -> None:
        h.store.leave_unprocessed(5)
        async with h.writer:
            for i in range(25):
                h.writer.submit(make_dl(i))
            assert await h.writer.flush(5)
        assert h.store.calls == [25, 5]
        assert h.sleeps == [0.05]
        assert [dl.record.offset for dl in h.written] == list(range(25))

    run(main())


def test_nothing_is_reported_while_the_store_is_down(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    h = Harness(real_pause=0.01)

    async def main() -> None:
        h.store.fail_next(10**9)
        async with h.writer:
            for i in range(30):
                h.writer.submit(make_dl(i))
            await eventually(lambda: len(h.store.calls) >= 10)
            assert h.written == []
            assert h.writer.pending == 30
            assert h.writer.degraded
            assert not await h.writer.flush(0.1)
            h.store.fail_next(0)
            assert await h.writer.flush(5)
        assert sorted(dl.record.offset for dl in h.written) == list(range(30))
        assert not h.writer.degraded

    run(main())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    recoveries = [r for r in caplog.records if "recovered" in r.getMessage()]
    assert len(warnings) == 1
    assert len(recoveries) == 1
    assert recoveries[0].levelno == logging.INFO


def test_same_message_twice_goes_in_separate_batches() -> None:
    h = Harness(max_in_flight=1)

    async def main() -> None:
        h.writer.submit(make_dl(7, reason="first"))
        h.writer.submit(make_dl(7, reason="second"))
        h.writer.submit(make_dl(8))
        async with h.writer:
            assert await h.writer.flush(5)
        assert h.store.calls == [2, 1]
        assert [dl.reason for dl in h.written] == ["first", "boom", "second"]
        assert h.store.dead_letters()[0].reason == "second"

    run(main())


def test_batches_in_flight_are_bounded() -> None:
    h = Harness(max_in_flight=3)

    async def main() -> None:
        h.store.gate.clear()
        try:
            async with h.writer:
                for i in range(200):
                    h.writer.submit(make_dl(i))
                await eventually(lambda: len(h.store.calls) == 3)
                h.store.gate.set()
                assert await h.writer.flush(5)
        finally:
            h.store.gate.set()
        assert h.store.max_concurrent == 3  # the store counted: never a fourth at once
        assert len(h.written) == 200

    run(main())


def test_flush_waits_only_for_what_was_submitted_before_it() -> None:
    h = Harness(max_in_flight=1)

    async def main() -> None:
        async with h.writer:
            h.writer.submit(make_dl(1))
            h.store.gate.clear()
            try:
                flushing = asyncio.create_task(h.writer.flush(5))
                await eventually(lambda: len(h.store.calls) == 1)
                h.writer.submit(make_dl(2))
                h.store.gate.set()
                assert await flushing
            finally:
                h.store.gate.set()
            assert await h.writer.flush(5)

    run(main())


def test_stop_finishes_the_batch_in_flight_and_starts_no_other() -> None:
    h = Harness(max_in_flight=1)
    returned: list[bool] = []

    async def main() -> None:
        h.store.gate.clear()
        try:
            await h.writer.start()
            for i in range(30):
                h.writer.submit(make_dl(i))
            await eventually(lambda: h.store.calls == [25])
            stopping = asyncio.create_task(h.writer.stop())
            # When stop() returns, whether the batch in flight could have finished by then.
            stopping.add_done_callback(lambda _: returned.append(h.store.gate.is_set()))
            await eventually(lambda: h.writer.state is not WriterState.RUNNING)
            state = h.writer.state  # a name: mypy keeps an attribute's narrowing past awaits
            assert state is WriterState.STOPPING
            h.store.gate.set()
            await stopping
            assert returned == [True], "stop() returned while the batch was still held"
        finally:
            h.store.gate.set()
        assert h.writer.state is WriterState.STOPPED
        assert h.store.calls == [25]
        assert len(h.written) == 25
        assert h.writer.pending == 5
        assert not await h.writer.flush(1)

    run(main())


def test_stop_interrupts_the_backoff() -> None:
    backing_off = asyncio.Event()

    async def forever(delay: float) -> None:
        backing_off.set()
        await asyncio.Event().wait()

    # A minute's stop timeout: a stop that waited the backoff out rather than interrupting
    # it would end only then, far past the bound (seconds of room for a loaded machine).
    h = Harness(sleep=forever, stop_timeout_s=60)

    async def main() -> None:
        h.store.fail_next(10**9)
        async with h.writer:
            h.writer.submit(make_dl(1))
            await asyncio.wait_for(backing_off.wait(), 10)  # the write failed: it backs off
            started = time.monotonic()
        assert time.monotonic() - started < 10
        assert h.written == []
        assert h.writer.pending == 1

    run(main())


def test_stop_cancels_writes_that_outlive_its_timeout() -> None:
    h = Harness(stop_timeout_s=0.2)

    async def main() -> None:
        h.store.gate.clear()
        try:
            await h.writer.start()
            h.writer.submit(make_dl(1))
            await eventually(lambda: len(h.store.calls) == 1)
            started = time.monotonic()
            await h.writer.stop()
            # The 0.2 s timeout, not the write, which never ends (nor the 10 s default).
            assert 0.15 < time.monotonic() - started < 5
        finally:
            h.store.gate.set()
        assert h.writer.state is WriterState.STOPPED
        assert h.written == []
        assert h.writer.pending == 1

    run(main())


def test_too_large_dead_letter_is_held_not_sent(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    h = Harness()

    async def main() -> None:
        async with h.writer:
            h.writer.submit(make_dl(1, value=b"x" * MAX_ITEM_BYTES))
            h.writer.submit(make_dl(2))
            started = time.monotonic()
            # False at once, not at the timeout (60 s), for the one that is held.
            assert not await h.writer.flush(60)
            assert time.monotonic() - started < 10
            assert [dl.record.offset for dl in h.written] == [2]
            assert h.writer.too_large == 1
            assert h.writer.pending == 1
        assert h.store.calls == [1]

    run(main())
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "orders[0]@1" in errors[0].getMessage()


def test_lifecycle_errors() -> None:
    h = Harness()

    async def main() -> None:
        await h.writer.start()
        with pytest.raises(StateError):
            await h.writer.start()
        await h.writer.stop()
        await h.writer.stop()
        with pytest.raises(StateError):
            await h.writer.start()
        with pytest.raises(StateError):
            h.writer.submit(make_dl(1))

    run(main())


def test_stop_before_start_and_flush_when_not_running() -> None:
    h = Harness()

    async def main() -> None:
        assert await h.writer.flush(1)
        h.writer.submit(make_dl(1))
        assert not await h.writer.flush(1)
        await h.writer.stop()
        assert h.writer.state is WriterState.STOPPED
        assert h.writer.pending == 1
        with pytest.raises(StateError):
            await h.writer.start()

    run(main())


def test_concurrent_stops_both_return() -> None:
    h = Harness()

    async def main() -> None:
        await h.writer.start()
        await asyncio.gather(h.writer.stop(), h.writer.stop())
        assert h.writer.state is WriterState.STOPPED

    run(main())


def test_error_in_on_written_surfaces_at_stop() -> None:
    def broken(dl: DeadLetter) -> None:
        raise RuntimeError("tracker bug")

    writer = DeadLetterWriter(MemoryStore(), dl_settings(), broken)

    async def main() -> None:
        await writer.start()
        writer.submit(make_dl(1))
        assert await writer.flush(5)  # durable before the callback ran, so it counts
        with pytest.raises(ExceptionGroup) as info:
            await writer.stop()
        assert info.group_contains(RuntimeError, match="tracker bug")

    run(main())


def test_rejects_batch_size_over_dynamodb_limit() -> None:
    with pytest.raises(ConfigError):
        DeadLetterWriter(MemoryStore(), dl_settings(batch_size=26), lambda dl: None)
