"""The one-partition Kafka adapter (kafka.ConfluentPartition) against the real broker:
a commit and the broker queries do not wait for a fetch that is waiting for records.

confluent-kafka lets one call at a time into a handle; an idle fetch holds its handle
for its whole wait, back to back, so a commit on that handle waited for it (50-330 ms
at the end of every burst). The adapter commits and queries on a second handle.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.integration.harness import committed, create_topic, make_settings, produce, take
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker
from triage_proxy.kafka import client as kafka
from triage_proxy.kafka.client import ConfluentPartition
from triage_proxy.structs import Record

pytestmark = pytest.mark.integration

IDLE_FETCH_S = 10.0
"""How long the idle fetch waits: far longer than a commit takes on a busy machine."""


def test_commit_and_queries_do_not_wait_for_an_idle_fetch(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    create_topic(broker.bootstrap, unique_name)
    n = produce(broker.bootstrap, unique_name, [(b"k", b"v%d" % i, []) for i in range(10)])
    settings = make_settings(broker.bootstrap, aws.endpoint_url, unique_name, unique_name)
    log = ConfluentPartition(settings.kafka, 0)
    assert log.open() == (0, None)
    assert len(take(log, n, 100)) == n

    monkeypatch.setattr(kafka, "FETCH_WAIT_S", IDLE_FETCH_S)
    fetching = threading.Event()
    idle: list[Record] = []

    def fetch_idle() -> None:
        fetching.set()
        idle.extend(log.fetch(100))  # caught up: waits IDLE_FETCH_S for a record

    fetcher = threading.Thread(target=fetch_idle)
    fetcher.start()
    try:
        assert fetching.wait(10)
        # Let the fetch get inside librdkafka; were it not yet, this test would only be
        # weaker (the commit would get in first), never wrong.
        time.sleep(0.5)
        started = time.monotonic()
        log.commit(n, None)
        assert fetcher.is_alive(), "the commit waited for the idle fetch"
        assert 0 < log.log_end() <= n  # Tansu's high watermark may trail (logend.py)
        assert log.partition_count() == 1
        assert fetcher.is_alive(), "a query waited for the idle fetch"
        assert time.monotonic() - started < IDLE_FETCH_S / 2
    finally:
        fetcher.join(IDLE_FETCH_S + 30)
    assert not fetcher.is_alive()
    assert idle == []
    log.close()
    assert committed(broker.bootstrap, settings.kafka.group_id, unique_name) == n
