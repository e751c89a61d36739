"""The client library against a real proxy, broker and DynamoDB endpoint."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.harness import (
    TOKEN,
    committed,
    create_topic,
    dead_letters,
    make_settings,
    produce,
    wait_until,
)
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port
from triage_client import Consumer, Message
from triage_proxy.app import Proxy
from triage_proxy.config.settings import Settings

pytestmark = pytest.mark.integration

ALL_BYTES = bytes(range(256))


def mixed_messages(n: int) -> list[Any]:
    """Null keys and values, every byte value, headers with None and repeated names."""
    out: list[Any] = []
    for i in range(n):
        key = None if i % 3 == 0 else b"key-%d" % i
        value: bytes | None
        if i % 10 == 7:
            value = b"poison-%d" % i
        elif i % 11 == 5:
            value = None
        elif i % 2:
            value = ALL_BYTES + b"%d" % i
        else:
            value = b""
        headers = [("trace", b"%d" % i), ("trace", None), ("empty", b"")] if i % 4 == 1 else None
        out.append((key, value, headers))
    return out


class ProxyThread:
    """A proxy running in its own event loop thread, so a blocking Consumer can run here."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.proxy: Proxy | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    def start(self) -> ProxyThread:
        self.proxy = Proxy(self.settings, 0)
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self._loop).result(30)
        return self

    def stop(self) -> None:
        if self.proxy is not None:
            proxy, self.proxy = self.proxy, None
            asyncio.run_coroutine_threadsafe(proxy.__aexit__(None, None, None), self._loop).result(
                60
            )

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.settings.server.port}"


@pytest.fixture
def proxy_thread(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> Iterator[ProxyThread]:
    create_topic(broker.bootstrap, unique_name)
    settings = make_settings(
        broker.bootstrap,
        aws.endpoint_url,
        unique_name,
        f"dlq-{unique_name}",
        server={"port": free_port()},
    )
    runner = ProxyThread(settings).start()
    yield runner
    runner.close()


def run_consumer(consumer: Consumer) -> threading.Thread:
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("style", ["sync", "async"])
def test_every_message_is_acked_or_dead_lettered_exactly_as_sent(
    broker: EmbeddedBroker, proxy_thread: ProxyThread, style: str
) -> None:
    settings = proxy_thread.settings
    topic = settings.kafka.topic
    sent = mixed_messages(200)
    produce(broker.bootstrap, topic, sent)
    seen: dict[int, Message] = {}
    lock = threading.Lock()

    def handle(message: Message) -> None:
        with lock:
            seen[message.offset] = message
        if (message.value or b"").startswith(b"poison"):
            raise ValueError(f"cannot parse offset {message.offset}")

    async def handle_async(message: Message) -> None:
        await asyncio.sleep(0)
        handle(message)

    consumer = Consumer(
        proxy_thread.target,
        TOKEN,
        handle if style == "sync" else handle_async,
        concurrency=8,
        consumer_id=f"e2e-{style}",
    )
    thread = run_consumer(consumer)
    try:
        assert wait_until(
            lambda: committed(broker.bootstrap, settings.kafka.group_id, topic) == len(sent),
            timeout=30,
        )
    finally:
        consumer.stop()
        thread.join(15)
    assert not thread.is_alive()
    assert sorted(seen) == list(range(len(sent)))
    for offset, (key, value, headers) in enumerate(sent):
        got = seen[offset]
        assert (got.topic, got.partition, got.attempt) == (topic, 0, 1)
        assert got.key == key
        assert got.value == value
        assert got.headers == (headers or [])
    poison = [i for i, (_, v, _) in enumerate(sent) if (v or b"").startswith(b"poison")]
    letters = dead_letters(settings)
    assert [d.record.offset for d in letters] == poison
    for dl in letters:
        key, value, headers = sent[dl.record.offset]
        assert (dl.record.key, dl.record.value) == (key, value)
        assert list(dl.record.headers) == (headers or [])
        assert dl.reason == f"ValueError: cannot parse offset {dl.record.offset}"
        assert dl.consumer_id == f"e2e-{style}"
        assert dl.attempts == 1


def test_consumer_reconnects_when_the_proxy_restarts(
    broker: EmbeddedBroker, proxy_thread: ProxyThread
) -> None:
    settings = proxy_thread.settings
    topic = settings.kafka.topic
    produce(broker.bootstrap, topic, [(None, b"a%d" % i, None) for i in range(50)])
    handled: list[int] = []

    def handle(message: Message) -> None:
        handled.append(message.offset)

    consumer = Consumer(proxy_thread.target, TOKEN, handle, concurrency=4)
    thread = run_consumer(consumer)
    try:
        assert wait_until(lambda: len(handled) >= 50)
        proxy_thread.stop()
        produce(broker.bootstrap, topic, [(None, b"b%d" % i, None) for i in range(50)])
        proxy_thread.start()
        assert wait_until(
            lambda: committed(broker.bootstrap, settings.kafka.group_id, topic) == 100,
            timeout=30,
        )
    finally:
        consumer.stop()
        thread.join(15)
    assert set(handled) == set(range(100))
    assert consumer.stats.reconnects >= 1
