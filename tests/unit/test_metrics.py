"""Pure parts of the metrics, status and observer: no broker, no DynamoDB."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from tests.waiting import eventually
from triage_proxy.app import Proxy
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.settings import Settings
from triage_proxy.errors import BrokerUnavailable, ConfigError
from triage_proxy.kafka.client import KafkaThread, MemoryPartition
from triage_proxy.observe.endpoint import HttpEndpoint
from triage_proxy.observe.metrics import metric_families
from triage_proxy.observe.snapshot import Instance, LatencyHistogram, ProxySnapshot
from triage_proxy.pipeline.logend import LogEndWatcher
from triage_proxy.pipeline.tracker import CommitTracker


def make_settings() -> Settings:
    return settings_from_dict(
        {
            "kafka": {"bootstrap_servers": "127.0.0.1:1", "topic": "orders", "group_id": "g"},
            "auth": {"token": "0123456789abcdef"},
            "dead_letters": {"table": "dlq"},
        },
        {},
    )


def test_histogram_buckets_are_upper_inclusive_and_cumulative() -> None:
    h = LatencyHistogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(value)
    assert h.cumulative() == [("0.1", 2), ("1.0", 4), ("+Inf", 5)]
    assert h.count == 5
    assert h.total == pytest.approx(8.65)


def test_lag_is_log_end_minus_committed_and_unknown_without_either() -> None:
    base = ProxySnapshot(topic="t", partition=0, state="running", ready=True, grpc_port=1)
    assert base.lag is None
    assert ProxySnapshot(**{**vars(base), "committed_offset": 5}).lag is None
    assert ProxySnapshot(**{**vars(base), "committed_offset": 5, "log_end_offset": 9}).lag == 4
    # A log end read before the last commit never makes the lag negative.
    assert ProxySnapshot(**{**vars(base), "committed_offset": 9, "log_end_offset": 5}).lag == 0


def test_status_json_has_the_documented_fields() -> None:
    h = LatencyHistogram()
    h.observe(0.5)
    h.observe(1.5)
    snap = ProxySnapshot(
        topic="t",
        partition=2,
        state="running",
        ready=True,
        grpc_port=7702,
        committed_offset=10,
        log_end_offset=15,
        in_flight=3,
        instances=(Instance("a", 10, 2), Instance("b", 5, 1)),
        oldest_unsettled_age_s=1.23456,
        dead_letters_pending=1,
        settle_latency=h,
    )
    doc = snap.to_json()
    assert doc["lag"] == 5
    assert doc["connected_instances"] == 2
    assert doc["instances"] == [
        {"consumer_id": "a", "credits": 10, "held": 2},
        {"consumer_id": "b", "credits": 5, "held": 1},
    ]
    assert doc["oldest_unsettled_age_s"] == 1.235
    assert doc["settle_latency_mean_s"] == 1.0
    assert "settle_latency" not in doc
    assert doc["dead_letters_pending"] == 1


class Fixed(Collector):
    def __init__(self, snap: ProxySnapshot) -> None:
        self.snap = snap

    def collect(self) -> Iterable[Metric]:
        return list(metric_families(self.snap))


def scrape(snap: ProxySnapshot) -> dict[str, float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed(snap))
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            assert sample.labels["topic"] == "orders"
            assert sample.labels["partition"] == "3"
            out[sample.name + sample.labels.get("le", "")] = sample.value
    return out


def test_metrics_render_counters_gauges_and_the_histogram() -> None:
    h = LatencyHistogram((0.1,))
    h.observe(0.05)
    snap = ProxySnapshot(
        topic="orders",
        partition=3,
        state="running",
        ready=True,
        grpc_port=1,
        committed_offset=7,
        log_end_offset=10,
        in_window=4,
        window_max_messages=100,
        counters={"delivered": 9, "acked": 5, "commits": 2},
        settle_latency=h,
    )
    samples = scrape(snap)
    assert samples["triage_delivered_total"] == 9
    assert samples["triage_acked_total"] == 5
    assert samples["triage_nacked_total"] == 0
    assert samples["triage_commits_total"] == 2
    assert samples["triage_lag"] == 3
    assert samples["triage_in_window_messages"] == 4
    assert samples["triage_settle_latency_seconds_bucket0.1"] == 1
    assert samples["triage_settle_latency_seconds_count"] == 1
    assert samples["triage_ready"] == 1


def test_offsets_not_known_yet_are_left_out_not_zero() -> None:
    samples = scrape(
        ProxySnapshot(topic="orders", partition=3, state="standby", ready=False, grpc_port=0)
    )
    assert samples["triage_ready"] == 0
    for name in ("triage_committed_offset", "triage_log_end_offset", "triage_lag"):
        assert name not in samples
    assert "triage_settle_latency_seconds_count" not in samples


def test_snapshot_of_a_proxy_that_has_not_opened_kafka() -> None:
    snap = Proxy(make_settings(), 1).snapshot()
    assert (snap.topic, snap.partition, snap.state, snap.ready) == ("orders", 1, "new", False)
    assert not snap.alive
    assert snap.committed_offset is None
    assert snap.counters == {}


class FlakyPartition(MemoryPartition):
    """The in-memory partition whose broker can be switched off."""

    down = False

    def log_end(self) -> int:
        if self.down:
            raise BrokerUnavailable("broker down")
        return super().log_end()


def test_log_end_watcher_keeps_the_last_reading_through_an_outage() -> None:
    async def scenario() -> None:
        log = FlakyPartition()
        for _ in range(5):
            log.append(b"v")
        tracker = CommitTracker(0)
        thread = KafkaThread()
        clock = [100.0]
        watcher = LogEndWatcher(log, thread, tracker, asyncio.Event(), monotonic=lambda: clock[0])
        try:
            unread = watcher.log_end  # a name: mypy keeps an attribute's narrowing past poll()
            assert unread is None
            await watcher.poll()
            assert (watcher.log_end, watcher.checked_at, watcher.degraded) == (5, 100.0, False)
            for offset in range(7):  # fetched past what the broker reported
                tracker.track(offset)
            assert watcher.log_end == 7
            log.down, clock[0] = True, 102.0
            await watcher.poll()
            assert (watcher.high, watcher.checked_at, watcher.degraded) == (5, 100.0, True)
            log.down = False
            await watcher.poll()
            assert (watcher.high, watcher.checked_at, watcher.degraded) == (5, 102.0, False)
        finally:
            thread.shutdown()

    asyncio.run(scenario())


def test_log_end_watcher_stops_when_closing_is_set() -> None:
    async def scenario() -> None:
        closing = asyncio.Event()
        thread = KafkaThread()
        watcher = LogEndWatcher(
            MemoryPartition(), thread, CommitTracker(0), closing, interval_s=3600
        )
        try:
            task = asyncio.create_task(watcher.run())
            await eventually(lambda: watcher.checked_at is not None)  # it polled: now it waits
            assert not task.done()
            closing.set()
            await asyncio.wait_for(task, 10)  # its next poll is an hour away
            assert watcher.high == 0
        finally:
            thread.shutdown()

    asyncio.run(scenario())


def test_observer_off_binds_nothing() -> None:
    async def scenario() -> None:
        async with HttpEndpoint(Proxy(make_settings(), 0).snapshot, None) as observer:
            assert observer.port is None

    asyncio.run(scenario())


def test_observer_on_a_busy_port_names_the_config_key() -> None:
    async def scenario(port: int) -> None:
        observer = HttpEndpoint(Proxy(make_settings(), 0).snapshot, ("127.0.0.1", port))
        with pytest.raises(ConfigError) as info:
            await observer.start()
        assert info.value.key == "server.http_port"
        await observer.stop()  # safe after a failed start

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        asyncio.run(scenario(busy.getsockname()[1]))
