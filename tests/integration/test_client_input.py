"""What one authenticated client can send, against a real proxy, broker (Tansu) and
DynamoDB (moto): a consumer id too long or not printable is refused with INVALID_ARGUMENT
and the proxy goes on serving; a 1 KB one works and is recorded on its dead letters; a
dead letter that can never be written shows in /status and /metrics and does not hold
up a SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import (
    RawConsumer,
    await_until,
    committed,
    dead_letters,
    produce,
    settings_for,
    target,
)
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker
from triage_protocol.constants import MAX_CONSUMER_ID_CHARS
from triage_proxy.app import Proxy
from triage_proxy.store.items import MAX_ITEM_BYTES

pytestmark = pytest.mark.integration

DRAIN_TIMEOUT_S = 30.0


async def refusal(consumer_id: str, proxy: Proxy) -> grpc.aio.AioRpcError:
    consumer = RawConsumer(target(proxy))
    consumer.consumer_id = consumer_id
    async with consumer:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async with asyncio.timeout(15):
                await consumer.read()
        assert consumer.deliveries == []
        return info.value


def test_a_bad_consumer_id_is_refused_and_the_proxy_still_serves(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="triage_proxy")
    settings = settings_for(broker, aws, topic)
    produce(broker.bootstrap, topic, [(None, b"v%d" % i, None) for i in range(5)])
    kilobyte_id = "worker-" + "é" * 1017  # 1,024 characters, 2 KB of UTF-8

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy:
            huge = await refusal("x" * 500_000, proxy)
            assert huge.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "Hello.consumer_id" in (huge.details() or "")
            assert str(MAX_CONSUMER_ID_CHARS) in (huge.details() or "")
            for forged in ("worker\n2030-01-01 CRITICAL forged", "\x1b[31mred"):
                refused = await refusal(forged, proxy)
                assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "printable" in (refused.details() or "")
            # The proxy still serves, and a 1 KB id works: acks, and a nack whose dead
            # letter records that id.
            good = RawConsumer(target(proxy))
            good.consumer_id = kilobyte_id
            async with good:
                got = [d.offset for d in await good.receive(5)]
                assert sorted(got) == [0, 1, 2, 3, 4]
                good.settle(acks=[0, 1, 2, 4], nacks=[(3, "ValueError: bad")])
                assert await await_until(
                    lambda: proxy.snapshot().counters.get("dead_lettered") == 1
                )
                assert await await_until(lambda: proxy.snapshot().committed_offset == 5)

    asyncio.run(scenario())
    (dl,) = dead_letters(settings)
    assert dl.record.offset == 3
    assert dl.consumer_id == kilobyte_id
    assert dl.reason == "ValueError: bad"
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("triage_proxy")]
    assert sum("refused a stream" in line for line in lines) == 3
    assert all(line.isprintable() for line in lines)  # nothing forged, no ANSI codes


async def http_get(port: int | None, path: str) -> str:
    assert port is not None
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}{path}") as response,
    ):
        assert response.status == 200
        return await response.text()


async def gauge(port: int | None, name: str) -> float:
    for family in text_string_to_metric_families(await http_get(port, "/metrics")):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"no {name} in /metrics")


def test_an_unwritable_dead_letter_shows_in_status_and_does_not_hold_up_sigterm(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic, shutdown={"drain_timeout_s": DRAIN_TIMEOUT_S})
    assert settings.dead_letters.overflow_bucket is None
    produce(broker.bootstrap, topic, [(None, b"a", None)])
    produce(broker.bootstrap, topic, [(None, b"x" * (MAX_ITEM_BYTES + 10_000), None)])
    produce(broker.bootstrap, topic, [(None, b"c", None)])
    stopped_in: list[float] = []

    async def scenario() -> None:
        proxy = Proxy(settings, 0)
        await proxy.start()
        try:
            async with RawConsumer(target(proxy)) as consumer:
                assert sorted(d.offset for d in await consumer.receive(3)) == [0, 1, 2]
                consumer.settle(acks=[0, 2], nacks=[(1, "ValueError: cannot parse")])

                async def status() -> dict[str, Any]:
                    doc: dict[str, Any] = json.loads(await http_get(proxy.http_port, "/status"))
                    return doc

                deadline = time.monotonic() + 15
                while (doc := await status())["dead_letters_unwritable"] != 1:
                    assert time.monotonic() < deadline, doc
                    await asyncio.sleep(0.05)
                assert "dead_letters_unwritable" in doc["degraded"]
                (held,) = doc["unwritable_dead_letters"]
                assert held["offset"] == 1
                assert held["size"] > held["limit"] == MAX_ITEM_BYTES
                assert "set dead_letters.overflow_bucket" in held["fix"]
                assert doc["in_flight"] == 0
                assert await gauge(proxy.http_port, "triage_dead_letters_unwritable") == 1
                assert await await_until(lambda: proxy.snapshot().committed_offset == 1)
        finally:
            started = time.monotonic()
            proxy.stop()  # what SIGTERM does
            await proxy.wait_stopped()
            stopped_in.append(time.monotonic() - started)

    asyncio.run(scenario())
    assert stopped_in[0] < 10, f"stopping took {stopped_in[0]:.1f}s"
    assert committed(broker.bootstrap, settings.kafka.group_id, topic) == 1  # redelivered next
    assert dead_letters(settings) == []
