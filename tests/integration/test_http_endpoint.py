"""The proxy's HTTP endpoint against a real proxy, broker (Tansu) and DynamoDB (moto)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import RawConsumer, await_until, produce, settings_for, target
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker
from triage_proxy.app import Proxy, ProxyState
from triage_proxy.kafka.client import ConfluentPartition

pytestmark = pytest.mark.integration


def one_by_one(bootstrap: str, topic: str, n: int) -> None:
    """One record per produce request, so Tansu's high watermark is exact (DESIGN.md)."""
    for i in range(n):
        produce(bootstrap, topic, [(b"k%d" % i, b"v%d" % i, None)])


async def get(port: int | None, path: str) -> tuple[int, str]:
    assert port is not None
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}{path}") as response,
    ):
        return response.status, await response.text()


async def scrape(port: int | None) -> dict[str, float]:
    """Every sample of /metrics for partition 0, by name (labels checked, then dropped)."""
    status, text = await get(port, "/metrics")
    assert status == 200
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels["partition"] == "0"
            le = sample.labels.get("le")
            samples[sample.name + (f"[{le}]" if le else "")] = sample.value
    return samples


def high_watermark(proxy: Proxy) -> int | None:
    """The partition's high watermark as the pipeline last read it (None: not yet)."""
    pipeline = proxy.pipelines.get(proxy.partition)
    if pipeline is None or pipeline.watermarks is None:
        return None
    return pipeline.watermarks.high


async def status_of(port: int | None) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/status") as response,
    ):
        assert response.status == 200
        doc: dict[str, Any] = await response.json()
        return doc


def test_metrics_scrape_shows_the_counters_moving(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic)
    one_by_one(broker.bootstrap, topic, 6)

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy, RawConsumer(target(proxy)) as consumer:
            await consumer.receive(6)
            first = await scrape(proxy.http_port)
            assert first["triage_delivered_total"] == 6
            assert first["triage_acked_total"] == 0
            assert first["triage_in_flight"] == 6
            assert first["triage_connected_instances"] == 1
            assert first["triage_settle_latency_seconds_count"] == 0
            assert first["triage_window_max_messages"] == settings.window.max_messages

            consumer.settle(acks=[0, 1, 2], nacks=[(3, "bad input")])
            assert await await_until(
                lambda: (
                    proxy.snapshot().counters.get("dead_lettered") == 1
                    and proxy.snapshot().committed_offset == 4
                )
            )
            assert await await_until(lambda: high_watermark(proxy) == 6)
            second = await scrape(proxy.http_port)
            assert second["triage_acked_total"] == 3
            assert second["triage_nacked_total"] == 1
            assert second["triage_dead_lettered_total"] == 1
            assert second["triage_settle_latency_seconds_count"] == 4
            assert second["triage_settle_latency_seconds_bucket[+Inf]"] == 4
            assert 0 < second["triage_settle_latency_seconds_sum"] < 15
            assert second["triage_in_flight"] == 2
            assert second["triage_in_window_messages"] == 2
            assert second["triage_in_window_bytes"] == 8  # two records of 2-byte key + value
            assert second["triage_committed_offset"] == 4
            assert second["triage_log_end_offset"] == 6
            assert second["triage_lag"] == 2
            assert second["triage_ready"] == 1
            assert second["triage_dead_letters_pending"] == 0
            assert second["triage_oldest_unsettled_age_seconds"] > 0

            consumer.settle(acks=[4, 5])
            assert await await_until(lambda: proxy.snapshot().committed_offset == 6)
            third = await scrape(proxy.http_port)
            assert third["triage_acked_total"] == 5
            assert third["triage_lag"] == 0
            assert third["triage_in_flight"] == 0
            assert third["triage_oldest_unsettled_age_seconds"] == 0

    asyncio.run(scenario())


def test_status_names_the_instances_and_the_oldest_unsettled_age(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic)
    one_by_one(broker.bootstrap, topic, 3)

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy, RawConsumer(target(proxy)) as consumer:
            await consumer.receive(3)
            consumer.settle(acks=[1])
            assert await await_until(lambda: high_watermark(proxy) == 3)
            assert await await_until(lambda: proxy.snapshot().counters["acked"] == 1)
            await asyncio.sleep(0.3)  # the age the status must show, at least
            doc = await status_of(proxy.http_port)
            assert doc["topic"] == topic
            assert doc["partition"] == 0
            assert doc["state"] == "running"
            assert doc["ready"] is True
            assert doc["grpc_port"] == proxy.port
            assert doc["http_port"] == proxy.http_port
            assert doc["committed_offset"] == 0  # offset 0 is unsettled
            assert doc["log_end_offset"] == 3
            assert doc["lag"] == 3
            assert doc["in_flight"] == 2
            assert doc["in_window"] == 2
            assert doc["connected_instances"] == 1
            assert doc["instances"] == [
                {"consumer_id": consumer.consumer_id, "credits": 100, "held": 2}
            ]
            assert doc["oldest_unsettled_age_s"] >= 0.3
            assert doc["dead_letters_pending"] == 0
            assert doc["counters"]["delivered"] == 3
            assert doc["counters"]["acked"] == 1
            assert doc["degraded"] == []

    asyncio.run(scenario())


class GatedPartition(ConfluentPartition):
    """The real partition, whose open() waits for the test to let it through."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.gate = threading.Event()

    def open(self) -> tuple[int, str | None]:
        assert self.gate.wait(30)
        return super().open()


def test_healthz_and_readyz_follow_the_lifecycle(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    # No lease: the state goes straight to "starting" (standby is its own test).
    settings = settings_for(broker, aws, topic, ownership={"enabled": False})
    one_by_one(broker.bootstrap, topic, 1)
    log = GatedPartition(settings.kafka, 0)

    async def scenario() -> None:
        proxy = Proxy(settings, 0, log=log)
        starting = asyncio.create_task(proxy.start())
        try:
            assert await await_until(lambda: proxy.http_port is not None)
            # Kafka is not open yet: alive, not ready, observable.
            assert await get(proxy.http_port, "/healthz") == (200, "ok\n")
            assert await get(proxy.http_port, "/readyz") == (503, "starting\n")
            assert (await status_of(proxy.http_port))["state"] == "starting"
            metrics = await scrape(proxy.http_port)
            assert metrics["triage_ready"] == 0
            assert "triage_committed_offset" not in metrics

            log.gate.set()
            await starting
            assert await get(proxy.http_port, "/readyz") == (200, "ready\n")
            async with RawConsumer(target(proxy)) as consumer:
                await consumer.receive(1)
                proxy.stop()  # draining waits for the unsettled delivery
                assert await await_until(lambda: proxy.state is ProxyState.STOPPING)
                assert await get(proxy.http_port, "/readyz") == (503, "stopping\n")
                assert (await get(proxy.http_port, "/healthz"))[0] == 200
                consumer.settle(acks=[0])
                await proxy.wait_stopped()
            with pytest.raises(aiohttp.ClientConnectionError):
                await get(proxy.http_port, "/healthz")
        finally:
            log.gate.set()
            proxy.stop()
            await asyncio.gather(starting, return_exceptions=True)
            await proxy.wait_stopped()

    asyncio.run(scenario())


def test_a_standby_is_observable_but_not_ready(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic)
    one_by_one(broker.bootstrap, topic, 1)

    async def scenario() -> None:
        async with Proxy(settings, 0) as holder:
            standby = Proxy(settings, 0)
            waiting = asyncio.create_task(standby.start())
            try:
                assert await await_until(lambda: standby.state is ProxyState.STANDBY)
                assert await get(standby.http_port, "/healthz") == (200, "ok\n")
                assert await get(standby.http_port, "/readyz") == (503, "standby\n")
                doc = await status_of(standby.http_port)
                assert (doc["state"], doc["ready"], doc["committed_offset"]) == (
                    "standby",
                    False,
                    None,
                )
                assert (await scrape(standby.http_port))["triage_ready"] == 0
                assert await get(holder.http_port, "/readyz") == (200, "ready\n")
            finally:
                standby.stop()
                await asyncio.gather(waiting, return_exceptions=True)
                await standby.wait_stopped()

    asyncio.run(scenario())
