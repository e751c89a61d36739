"""The process's one Kafka reader (reader.py) against the real broker: every partition
gets its own records in order, a full buffer pauses only its partition and loses or
repeats nothing when it resumes, and a closed partition drops what it buffered and
reopens at its committed offset."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from tests.integration.harness import (
    Message,
    committed,
    create_topic,
    make_settings,
    produce,
    take,
)
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker
from triage_proxy.kafka import reader as reader_module
from triage_proxy.kafka.client import FETCH_WAIT_S
from triage_proxy.kafka.reader import Reader
from triage_proxy.structs import Record

pytestmark = pytest.mark.integration

IDLE_CONSUME_S = 10.0
"""How long the reader's idle consume waits: far longer than a commit on a busy machine."""


def _messages(partition: int, n: int, pad: int = 0) -> list[Message]:
    return [(f"k{i}".encode(), f"p{partition}-v{i}".encode() + b"." * pad, []) for i in range(n)]


def _unpadded(record: Record) -> bytes:
    """The value `_messages` wrote, without its padding."""
    assert record.value is not None
    return record.value.split(b".")[0]


def test_partitions_read_through_one_consumer_pause_alone(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    create_topic(broker.bootstrap, unique_name, partitions=2)
    settings = make_settings(broker.bootstrap, aws.endpoint_url, unique_name, unique_name)
    # 3 MB per partition: more than one fetch response (1 MB a partition), so a resume
    # makes librdkafka fetch again from the last record handed over.
    n = 3000
    for p in (0, 1):
        produce(broker.bootstrap, unique_name, _messages(p, n, pad=1000), partition=p)
    reader = Reader(settings.kafka, max_bytes=120_000)  # ~100 records of 1 KB
    try:
        logs = [reader.partition(p) for p in (0, 1)]
        assert [log.open() for log in logs] == [(0, None), (0, None)]
        # Partition 1 is not read at all while partition 0 is read to its end: its full
        # buffer pauses it alone, and partition 0 pauses and resumes many times.
        got = take(logs[0], n, 30)
        assert [r.offset for r in got] == list(range(n))
        assert [_unpadded(r) for r in got] == [f"p0-v{i}".encode() for i in range(n)]
        assert {r.partition for r in got} == {0}
        assert reader.pauses >= 3, "the small buffers never filled up"
        rest = take(logs[1], n, 70)
        assert [r.offset for r in rest] == list(range(n))
        assert [_unpadded(r) for r in rest] == [f"p1-v{i}".encode() for i in range(n)]
        assert 0 < logs[0].log_end() <= n  # Tansu's high watermark may trail (logend.py)
        assert logs[0].partition_count() == 2
        for log in logs:
            log.close()
    finally:
        reader.close()


def test_takes_without_waiting_and_fetches_interleave_in_order_through_pauses(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    # What a pipeline does (pipeline/fetcher.py): take what is buffered on its loop, fetch
    # on its thread when nothing is. Together they read every record once, in order, and a
    # take without waiting resumes a paused partition as a fetch does.
    create_topic(broker.bootstrap, unique_name, partitions=1)
    settings = make_settings(broker.bootstrap, aws.endpoint_url, unique_name, unique_name)
    n = 3000
    produce(broker.bootstrap, unique_name, _messages(0, n, pad=1000), partition=0)
    reader = Reader(settings.kafka, max_bytes=120_000)  # ~100 records of 1 KB
    try:
        log = reader.partition(0)
        assert log.open() == (0, None)
        got: list[int] = []
        buffered = 0
        deadline = time.monotonic() + 60
        while len(got) < n:
            assert time.monotonic() < deadline, f"only {len(got)} of {n} records arrived"
            taken = log.take_buffered(37)
            buffered += len(taken)
            if not taken:
                taken = log.fetch(37)
            assert len(taken) <= 37
            got.extend(r.offset for r in taken)
        assert got == list(range(n))
        assert buffered > 0, "nothing was ever buffered when asked"
        # Paused at least once, and read to the end: something resumed it.
        assert reader.pauses >= 1, "the small buffer never filled up"
        assert log.take_buffered(10) == []  # nothing more: no wait, nothing invented
        log.close()
    finally:
        reader.close()


def test_a_closed_partition_drops_its_buffer_and_reopens_at_its_commit(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    create_topic(broker.bootstrap, unique_name, partitions=2)
    settings = make_settings(broker.bootstrap, aws.endpoint_url, unique_name, unique_name)
    produce(broker.bootstrap, unique_name, _messages(0, 30), partition=0)
    reader = Reader(settings.kafka)
    try:
        log = reader.partition(0)
        other = reader.partition(1)
        assert log.open() == (0, None)
        assert other.open() == (0, None)
        first = take(log, 5, 5)
        assert [r.offset for r in first] == [0, 1, 2, 3, 4]
        log.commit(5)
        log.close()  # what it had buffered beyond 4 is dropped
        again = reader.partition(0)
        assert again.open()[0] == 5
        assert [r.offset for r in take(again, 25, 100)] == list(range(5, 30))
        # The other partition, open all along, still reads what arrives now.
        produced = threading.Thread(
            target=produce,
            args=(broker.bootstrap, unique_name, _messages(1, 3)),
            kwargs={"partition": 1},
        )
        produced.start()
        assert [r.value for r in take(other, 3, 10)] == [b"p1-v0", b"p1-v1", b"p1-v2"]
        produced.join()
        again.close()
        other.close()
    finally:
        reader.close()


def test_commits_and_queries_do_not_wait_for_an_idle_consume(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queued for the reader thread, a commit waited for its idle consume (and held up
    every partition's fetch for its round trip); on the side handle it waits for none."""
    create_topic(broker.bootstrap, unique_name)
    n = produce(broker.bootstrap, unique_name, _messages(0, 10))
    settings = make_settings(broker.bootstrap, aws.endpoint_url, unique_name, unique_name)
    reader = Reader(settings.kafka)
    try:
        log = reader.partition(0)
        assert log.open() == (0, None)
        assert len(take(log, n, 100)) == n
        # The reader thread reads the constant at each consume: from its next idle
        # consume on it waits this long for a record that never comes.
        monkeypatch.setattr(reader_module, "FETCH_WAIT_S", IDLE_CONSUME_S)
        time.sleep(0.5)  # into that consume; were it not yet, the test is weaker, not wrong
        started = time.monotonic()
        log.commit(n)
        assert 0 < log.log_end() <= n  # Tansu's high watermark may trail (logend.py)
        assert log.partition_count() == 1
        assert time.monotonic() - started < IDLE_CONSUME_S / 2, "a call waited for the consume"
        monkeypatch.setattr(reader_module, "FETCH_WAIT_S", FETCH_WAIT_S)
    finally:
        reader.close()
    assert committed(broker.bootstrap, settings.kafka.group_id, unique_name) == n


def test_an_armed_partition_is_woken_once_when_its_records_come_and_when_it_closes(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    # How a pipeline waits on its event loop for an empty buffer (pipeline/fetcher.py):
    # the reader thread calls the waker once records come in, or once the partition
    # closes; `arm` refuses while records wait already, so none is missed.
    create_topic(broker.bootstrap, unique_name, partitions=1)
    settings = make_settings(broker.bootstrap, aws.endpoint_url, unique_name, unique_name)
    reader = Reader(settings.kafka)
    try:
        log = reader.partition(0)
        assert log.open() == (0, None)
        woken: list[threading.Event] = [threading.Event(), threading.Event()]
        calls = [0, 0]

        def waker(n: int) -> Callable[[], None]:
            def wake() -> None:
                calls[n] += 1
                woken[n].set()

            return wake

        assert log.arm(waker(0))  # nothing buffered: armed
        produce(broker.bootstrap, unique_name, _messages(0, 3), partition=0)
        assert woken[0].wait(60), "the reader never called the waker"
        deadline = time.monotonic() + 60
        while reader_buffered(reader, 0) < 3:
            assert time.monotonic() < deadline, "the records never reached the buffer"
            time.sleep(0.01)
        assert not log.arm(waker(1))  # records wait: take them, no call will come
        assert [r.value for r in log.take_buffered(10)] == [b"p0-v0", b"p0-v1", b"p0-v2"]
        assert log.arm(waker(1))
        log.close()  # closing wakes a waiting pipeline too
        assert woken[1].wait(10)
        assert calls == [1, 1]  # once each
    finally:
        reader.close()


def reader_buffered(reader: Reader, partition: int) -> int:
    """Records the reader holds for `partition` (its buffer's count)."""
    buffer = reader._buffers.get(partition)
    return 0 if buffer is None else buffer.count
