"""Push delivery end to end: a real proxy, the real broker and DynamoDB endpoint, and real
receivers on free loopback ports (aiohttp parsing with the `cloudevents` SDK; a Python
gRPC server of the original Triage's MessageHandler that registers over HTTP)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import signal
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import trustme
from aiohttp import web
from cloudevents.v1.http import from_http, from_json

from tests.integration.harness import (
    LEASE_S,
    TOKEN,
    ChildProcess,
    RawConsumer,
    await_until,
    committed,
    dead_letters,
    kill_processes,
    produce,
    restart_until_committed,
    run_then_kill,
    settings_for,
    start_proxy_process,
)
from tests.integration.receivers import receiver
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port
from triage_protocol import handler_pb2, handler_pb2_grpc
from triage_proxy.app import Proxy
from triage_proxy.push.signing import verify
from triage_proxy.structs import Headers

pytestmark = pytest.mark.integration

Message = tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]] | None]
Seen = tuple[bytes | None, bytes | None, Headers]

ODD: list[Message] = [
    (None, b"no key", None),
    (b"", b"empty key", [("h", b"1")]),
    (b"\xff\x00\n", b"\x00\xff binary", [("dup", b"a"), ("dup", b"\xfe"), ("none", None)]),
    ('ü "%\n<'.encode(), b"", None),
    (b"tomb", None, None),
]


def recover(attrs: dict[str, Any], data: bytes | None) -> Seen:
    """What docs/guides/push.md tells a receiver to do."""
    key = base64.b64decode(attrs["triagekey"]) if "triagekey" in attrs else None
    rows = json.loads(base64.b64decode(attrs["triageheaders"])) if "triageheaders" in attrs else []
    headers = tuple((n, None if v is None else base64.b64decode(v)) for n, v in rows)
    value = None if attrs.get("triagetombstone") == "true" else (data or b"")
    return key, value, headers


def expected(message: Message) -> Seen:
    key, value, headers = message
    return key, value, tuple(headers or ())


def push_target(url: str, **extra: Any) -> list[dict[str, Any]]:
    return [{"name": "receiver", "url": url, "timeout_s": 5, **extra}]


def test_binary_mode_is_byte_exact_and_a_400_dead_letters_with_the_body(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    poison: list[Message] = [(b"p", b"poison pill", None)]
    messages = ODD + poison
    produce(broker.bootstrap, topic, messages)
    seen: dict[str, Seen] = {}

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        event = from_http(dict(request.headers), body, data_unmarshaller=lambda b: b)
        attrs = dict(event.get_attributes())
        if body.startswith(b"poison"):
            return web.Response(status=400, text="cannot parse: <poison>")
        seen[attrs["id"]] = recover(attrs, event.get_data())
        return web.Response(status=204)

    async def scenario() -> None:
        async with receiver(handle) as url:
            settings = settings_for(broker, aws, topic, push=push_target(url))
            async with Proxy(settings, 0) as proxy:
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == len(messages), 30
                )
                push = proxy.status().push[0]
                assert push.records == {"ack": len(ODD), "nack": 1}
                assert push.responses["2xx"] == len(ODD)

    asyncio.run(scenario())
    assert seen == {f"{topic}/0/{i}": expected(m) for i, m in enumerate(ODD)}
    (dl,) = dead_letters(settings_for(broker, aws, topic))
    assert dl.record.offset == len(ODD)
    assert dl.reason == "HTTP 400: cannot parse: <poison>"
    assert dl.record.value == b"poison pill"


def test_batch_mode_partial_failures_and_byte_exact_records(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    bulk: list[Message] = [(b"k%d" % i, b"v%d" % i, None) for i in range(200)]
    poison: list[Message] = [(b"p", b"poison", None)]
    retry_once: list[Message] = [(b"r", b"retry me", None)]
    messages = ODD + bulk + poison + retry_once
    produce(broker.bootstrap, topic, messages)
    seen: dict[str, Seen] = {}
    sizes: list[int] = []
    retried: set[str] = set()

    async def handle(request: web.Request) -> web.Response:
        assert request.headers["content-type"] == "application/cloudevents-batch+json"
        events = json.loads(await request.read())
        sizes.append(len(events))
        failures = []
        for raw in events:
            event = from_json(json.dumps(raw), data_unmarshaller=lambda b: b)
            attrs = dict(event.get_attributes())
            data = event.get_data()
            if data == b"poison":
                failures.append(
                    {"itemIdentifier": attrs["id"], "action": "deadletter", "reason": "bad"}
                )
            elif data == b"retry me" and attrs["id"] not in retried:
                retried.add(attrs["id"])
                failures.append({"itemIdentifier": attrs["id"]})
            else:
                seen[attrs["id"]] = recover(attrs, data)
        return web.json_response({"batchItemFailures": failures})

    async def scenario() -> None:
        async with receiver(handle) as url:
            target = push_target(url, batch=50)
            settings = settings_for(
                broker, aws, topic, push=target, retry={"initial_backoff_s": 0.05}
            )
            async with Proxy(settings, 0):
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == len(messages), 30
                )

    asyncio.run(scenario())
    assert max(sizes) <= 50
    want = {f"{topic}/0/{i}": expected(m) for i, m in enumerate(messages)}
    del want[f"{topic}/0/{len(ODD) + len(bulk)}"]  # the poison pill
    assert seen == want
    (dl,) = dead_letters(settings_for(broker, aws, topic))
    assert (dl.record.value, dl.reason) == (b"poison", "bad")


def test_a_record_that_hangs_its_batch_is_dead_lettered_and_its_batch_mates_are_not(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """A receiver that never answers a batch holding one particular record: the batch
    times out, and nothing says which record hung it. Its records come back as suspects
    without using an attempt, and the hanging one is blamed each time it hangs a batch as
    a suspect: it alone is dead-lettered."""
    values = [b"v%d" % i for i in range(40)]
    values[15] = b"hang"
    produce(broker.bootstrap, topic, [(None, v, None) for v in values])
    acked: set[bytes] = set()

    async def handle(request: web.Request) -> web.Response:
        events = json.loads(await request.read())
        got = [base64.b64decode(e["data_base64"]) for e in events]
        if b"hang" in got:
            await asyncio.sleep(3)  # past timeout_s: no answer in time
        acked.update(got)
        return web.Response(status=200)

    async def scenario() -> None:
        async with receiver(handle) as url:
            target = [{"name": "batched", "url": url, "batch": 10, "timeout_s": 1}]
            settings = settings_for(
                broker,
                aws,
                topic,
                push=target,
                delivery={"max_attempts": 2, "redelivery_span_s": 1},
                retry={"initial_backoff_s": 0.05, "max_backoff_s": 0.1},
            )
            async with Proxy(settings, 0):
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == len(values), 60
                )

    asyncio.run(scenario())
    dls = dead_letters(settings_for(broker, aws, topic))
    assert [(dl.record.offset, dl.record.value, dl.reason) for dl in dls] == [
        (15, b"hang", "delivery attempts exhausted (2): no answer within 1 s")
    ]


def test_a_receiver_that_is_down_then_back_dead_letters_nothing(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    messages: list[Message] = [(b"k%d" % i, b"v%d" % i, None) for i in range(50)]
    produce(broker.bootstrap, topic, messages)
    port = free_port()

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=200)

    async def scenario() -> None:
        url = f"http://127.0.0.1:{port}/"
        # Two attempts: were a refused request to use one, the third would dead-letter.
        delivery = {"max_attempts": 2}
        settings = settings_for(broker, aws, topic, push=push_target(url), delivery=delivery)
        async with Proxy(settings, 0) as proxy:
            assert await await_until(lambda: proxy.status().push[0].state != "ok", 15)
            assert proxy.status().push[0].state.startswith("outage")
            # Two more refused requests, each after a pause: nothing may use an attempt.
            refused = proxy.status().push[0].errors
            assert await await_until(lambda: proxy.status().push[0].errors >= refused + 2, 30)
            counters = proxy.snapshot().counters
            assert (counters["dead_lettered"], counters["retried"]) == (0, 0)
            async with receiver(handle, port):
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == len(messages), 60
                )
            assert proxy.status().push[0].records.get("outage", 0) >= 1

    asyncio.run(scenario())
    assert dead_letters(settings_for(broker, aws, topic)) == []


def test_overload_lowers_the_limit_and_uses_no_attempt(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    messages: list[Message] = [(b"k%d" % i, b"v%d" % i, None) for i in range(300)]
    produce(broker.bootstrap, topic, messages)
    active = 0

    async def handle(request: web.Request) -> web.Response:
        nonlocal active
        await request.read()
        if active >= 4:
            return web.Response(status=503, text="busy")
        active += 1
        try:
            await asyncio.sleep(0.01)
        finally:
            active -= 1
        return web.Response(status=200)

    async def scenario() -> None:
        async with receiver(handle) as url:
            target = push_target(url, min_concurrency=1, max_concurrency=32, initial_concurrency=32)
            settings = settings_for(broker, aws, topic, push=target, delivery={"max_attempts": 2})
            async with Proxy(settings, 0) as proxy:
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == len(messages), 60
                )
                push = proxy.status().push[0]
                assert push.records.get("overload", 0) > 0
                assert push.limit < 32

    asyncio.run(scenario())
    assert dead_letters(settings_for(broker, aws, topic)) == []


class Handler_(handler_pb2_grpc.MessageHandlerServicer):
    def __init__(self) -> None:
        self.bodies: list[str] = []

    async def SendMessage(self, request: Any, context: Any) -> Any:
        if request.body.startswith("poison"):
            return handler_pb2.MessageResponse(body="no", status=-1)
        self.bodies.append(request.body)
        return handler_pb2.MessageResponse(body="ok", status=1)


def test_grpc_push_registers_like_the_original_consumers(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    messages: list[Message] = [(b"k%d" % i, b"v%d" % i, None) for i in range(20)]
    messages += [(b"p", b"poison", None), (b"b", b"\xff not utf-8", None)]
    produce(broker.bootstrap, topic, messages)
    handler = Handler_()

    async def scenario() -> None:
        server = grpc.aio.server()
        handler_pb2_grpc.add_MessageHandlerServicer_to_server(handler, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        target = [{"name": "go", "mode": "grpc", "registration": True}]
        settings = settings_for(broker, aws, topic, push=target)
        token = next(iter(settings.auth.active().values()))
        try:
            async with Proxy(settings, 0) as proxy, aiohttp.ClientSession() as http:
                url = f"http://127.0.0.1:{proxy.http_port}/consumers"
                cases = [
                    ({}, 400, "Missing Authorization header"),
                    ({"Authorization": "wrong"}, 401, "Malformed or invalid authorization token"),
                    ({"Authorization": token}, 400, "Missing gRPC port header"),
                    ({"Authorization": token, "grpcport": "70000"}, 400, "1 to 65535"),
                ]
                for headers, status, text in cases:
                    async with http.get(url, headers=headers) as response:
                        assert response.status == status
                        assert text in await response.text()
                assert proxy.snapshot().counters["delivered"] == 0
                headers = {"Authorization": token, "grpcport": str(port)}
                async with http.get(url, headers=headers) as response:
                    assert response.status == 200
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == len(messages), 30
                )
        finally:
            await server.stop(None)

    asyncio.run(scenario())
    assert sorted(handler.bodies) == sorted(f"v{i}" for i in range(20))
    reasons = {dl.record.value: dl.reason for dl in dead_letters(settings_for(broker, aws, topic))}
    assert reasons[b"poison"] == "consumer nacked: no"
    assert "not valid UTF-8" in reasons[b"\xff not utf-8"]


RECEIVER_JS = Path(__file__).resolve().parents[1] / "perf" / "push_receiver.js"


class NodeReceiver:
    """tests/perf/push_receiver.js as a child process on a fixed port, killed by PID."""

    def __init__(self, port: int, options: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            ["node", str(RECEIVER_JS), json.dumps({**options, "port": port})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        json.loads(self.proc.stdout.readline())  # it listens

    def requests(self) -> int:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return int(json.loads(self.proc.stdout.readline())["requests"])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def test_a_receiver_killed_and_restarted_mid_run_loses_and_dead_letters_nothing(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    messages: list[Message] = [(b"k%d" % i, b"v%d" % i, None) for i in range(3000)]
    produce(broker.bootstrap, topic, messages)
    port = free_port()
    options = {"mode": "capacity", "capacity": 64, "delay_ms": 5}
    receivers = [NodeReceiver(port, options)]

    async def scenario() -> None:
        url = f"http://127.0.0.1:{port}/"
        target = push_target(url, max_concurrency=16)
        settings = settings_for(broker, aws, topic, push=target)
        async with Proxy(settings, 0) as proxy:
            assert await await_until(lambda: receivers[0].requests() >= 500, 30)
            receivers[0].kill()  # kill -9 with requests in flight
            assert await await_until(lambda: proxy.status().push[0].state != "ok", 15)
            receivers.append(NodeReceiver(port, options))
            group = settings.kafka.group_id
            assert await await_until(
                lambda: committed(broker.bootstrap, group, topic) == len(messages), 60
            )
            assert proxy.snapshot().counters["dead_lettered"] == 0

    run_then_kill(scenario, receivers)
    assert dead_letters(settings_for(broker, aws, topic)) == []


def crash_receiver(port: int, options: dict[str, Any]) -> ChildProcess:
    """tests/integration/crash_receiver.py as a child process on a fixed port."""
    receiver = ChildProcess("tests.integration.crash_receiver", {**options, "port": port})
    assert receiver.ready, "the crash receiver ended before it listened"
    return receiver


def test_a_record_that_crashes_the_receiver_is_dead_lettered_and_nothing_else(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """A crash-type poison pill: the receiver exits whenever it is handed one record, with
    other requests in flight, and (as a process manager would) it is started again. Those
    other records come back as suspects without using an attempt, and the pill is blamed
    once it crashes the receiver as a suspect: it alone is dead-lettered, after at most
    `max_attempts + 1` crashes, and the partition commits to the end."""
    values = [b"v%d" % i for i in range(300)]
    values[100] = b"crash"
    produce(broker.bootstrap, topic, [(None, v, None) for v in values])
    port = free_port()
    options = {"work_ms": 100, "crash_on": "crash"}
    receivers: list[ChildProcess] = []

    async def scenario() -> None:
        url = f"http://127.0.0.1:{port}/"
        settings = settings_for(
            broker,
            aws,
            topic,
            push=push_target(url, min_concurrency=8, initial_concurrency=8, max_concurrency=8),
            delivery={"max_attempts": 2, "redelivery_span_s": 1},
            retry={"initial_backoff_s": 0.05, "max_backoff_s": 0.1},
        )
        async with Proxy(settings, 0):
            await restart_until_committed(
                lambda: crash_receiver(port, options),
                receivers,
                broker.bootstrap,
                settings.kafka.group_id,
                topic,
                len(values),
            )

    run_then_kill(scenario, receivers)
    assert [
        (dl.record.offset, dl.record.value, dl.attempts)
        for dl in dead_letters(settings_for(broker, aws, topic))
    ] == [(100, b"crash", 2)]
    assert len(receivers) <= 4  # max_attempts + 1 crashes, then one that stays


def test_a_proxy_killed_mid_run_loses_nothing(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str, tmp_path: Path
) -> None:
    messages: list[Message] = [(b"k%d" % i, b"v%d" % i, None) for i in range(2000)]
    produce(broker.bootstrap, topic, messages)
    seen: set[str] = set()

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(0.002)
        seen.add(request.headers["ce-id"])
        return web.Response(status=200)

    async def scenario() -> None:
        async with receiver(handle) as url:
            settings = settings_for(broker, aws, topic)  # creates the table
            base: dict[str, Any] = {
                "kafka": {
                    "bootstrap_servers": broker.bootstrap,
                    "topic": topic,
                    "group_id": settings.kafka.group_id,
                },
                "auth": {"token": TOKEN},
                "dead_letters": {
                    "table": settings.dead_letters.table,
                    "endpoint_url": aws.endpoint_url,
                },
                "commit": {"interval_s": 0.1},
                "ownership": {"lease_s": LEASE_S},
                "push": push_target(url, max_concurrency=8),
            }
            procs = []
            try:
                proc, _ = start_proxy_process(tmp_path, "first", base, 0)
                procs.append(proc)
                assert await await_until(lambda: len(seen) >= 300, 60)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
                at_kill = len(seen)
                proc, _ = start_proxy_process(tmp_path, "second", base, 0)
                procs.append(proc)
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == len(messages), 90
                )
                assert at_kill < len(messages)
            finally:
                kill_processes(procs)

    asyncio.run(scenario())
    assert seen == {f"{topic}/0/{i}" for i in range(len(messages))}
    assert dead_letters(settings_for(broker, aws, topic)) == []


def test_https_with_a_private_ca_a_client_certificate_a_bearer_token_and_a_signature(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str, tmp_path: Path, caplog: Any
) -> None:
    """TLS verified against the configured CA, with the client certificate the receiver
    demands (mutual TLS), the token and the signing key read from references, each
    request signed over its exact body, and neither secret in any log line or in status."""
    caplog.set_level(logging.DEBUG)
    messages: list[Message] = [(b"k%d" % i, b"v%d" % i, None) for i in range(20)]
    produce(broker.bootstrap, topic, messages)
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    client = ca.issue_cert("proxy.triage.test")
    client.cert_chain_pems[0].write_to_path(str(tmp_path / "client.pem"))
    client.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ssl)
    server_ssl.verify_mode = ssl.CERT_REQUIRED  # no client certificate: no handshake
    ca.configure_trust(server_ssl)
    checked: list[bool] = []
    peers: set[str] = set()
    shown: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        signature = request.headers["triage-signature"]
        fresh = verify(b"hmac-key-of-the-test", body, signature, int(time.time()))
        checked.append(fresh and request.headers["authorization"] == "Bearer push-token-1")
        assert request.transport is not None
        peer = request.transport.get_extra_info("peercert")
        peers.update(v for kind, v in peer.get("subjectAltName", ()) if kind == "DNS")
        return web.Response(status=200)

    async def scenario() -> None:
        async with receiver(handle, ssl_context=server_ssl) as url:
            target = push_target(
                url,
                ca_file=str(tmp_path / "ca.pem"),
                token="env:TEST_PUSH_TOKEN",
                signing_secret="env:TEST_PUSH_HMAC",
                cert_file=str(tmp_path / "client.pem"),
                key_file=str(tmp_path / "client.key"),
            )
            settings = settings_for(broker, aws, topic, push=target)
            async with Proxy(settings, 0) as proxy:
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == len(messages), 30
                )
                shown.append(json.dumps(proxy.status().to_json()))
                shown.append(repr(proxy.settings))

    os.environ["TEST_PUSH_TOKEN"] = "push-token-1"
    os.environ["TEST_PUSH_HMAC"] = "hmac-key-of-the-test"
    try:
        asyncio.run(scenario())
    finally:
        del os.environ["TEST_PUSH_TOKEN"], os.environ["TEST_PUSH_HMAC"]
    assert len(checked) == len(messages)
    assert all(checked)
    assert peers == {"proxy.triage.test"}
    logged = [record.getMessage() for record in caplog.records] + shown
    assert logged
    for secret in ("push-token-1", "hmac-key-of-the-test"):
        assert not [line for line in logged if secret in line]


def test_per_key_ordering_holds_through_push(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    messages: list[Message] = [(b"key%d" % (i % 5), b"%d" % i, None) for i in range(300)]
    produce(broker.bootstrap, topic, messages)
    busy: set[str] = set()
    order: dict[str, list[int]] = {}
    overlaps = 0

    async def handle(request: web.Request) -> web.Response:
        nonlocal overlaps
        key = request.headers["ce-partitionkey"]
        if key in busy:
            overlaps += 1
        busy.add(key)
        order.setdefault(key, []).append(int(await request.read()))
        await asyncio.sleep(0.002)
        busy.discard(key)
        return web.Response(status=200)

    async def scenario() -> None:
        async with receiver(handle) as url:
            target = push_target(url, max_concurrency=16, initial_concurrency=16)
            settings = settings_for(broker, aws, topic, push=target, delivery={"ordering": "key"})
            async with Proxy(settings, 0):
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == len(messages), 30
                )

    asyncio.run(scenario())
    assert overlaps == 0
    assert all(values == sorted(values) for values in order.values())
    assert sum(map(len, order.values())) == len(messages)


async def _bad_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers each connection by what the port was told to be: garbage, a hang, or a
    500 whose body never ends (1 GB)."""
    await reader.read(65536)
    kind = writer.get_extra_info("sockname")[1] % 3
    try:
        if kind == 0:
            writer.write(b"this is not HTTP\r\n\r\n")
            await writer.drain()
        elif kind == 1:
            await asyncio.sleep(3600)
        else:
            writer.write(b"HTTP/1.1 500 Oops\r\ncontent-length: 1000000000\r\n\r\n")
            chunk = b"x" * 65536
            for _ in range(16_000):  # up to 1 GB, unless the proxy hangs up first
                writer.write(chunk)
                await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


def test_receivers_that_answer_garbage_hang_or_send_a_huge_body_stall_no_one(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    messages: list[Message] = [(b"k%d" % i, b"v%d" % i, None) for i in range(200)]
    produce(broker.bootstrap, topic, messages)
    good: set[str] = set()

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        good.add(request.headers["ce-id"])
        return web.Response(status=200)

    async def scenario() -> None:
        servers = []
        bad_urls: list[str] = []
        while len(bad_urls) < 3:  # one port of each kind (its number mod 3)
            server = await asyncio.start_server(_bad_server, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            if port % 3 in {int(u.rsplit(":", 1)[1].rstrip("/")) % 3 for u in bad_urls}:
                server.close()
                continue
            servers.append(server)
            bad_urls.append(f"http://127.0.0.1:{port}/")
        async with receiver(handle) as url:
            targets = [
                {"name": "good", "url": url, "timeout_s": 5},
                *(
                    {"name": f"bad{i}", "url": u, "timeout_s": 1, "max_response_bytes": 4096}
                    for i, u in enumerate(bad_urls)
                ),
            ]
            settings = settings_for(
                broker,
                aws,
                topic,
                push=targets,
                delivery={"max_attempts": 50},
                retry={"initial_backoff_s": 0.01, "max_backoff_s": 0.05},
            )
            async with Proxy(settings, 0) as proxy:
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == len(messages), 60
                )
                kinds = {t.name: t.responses for t in proxy.status().push}
        for server in servers:
            server.close()
        for name in ("bad0", "bad1", "bad2"):  # each was tried, none ever acked
            assert sum(kinds[name].values()) > 0
            assert "2xx" not in kinds[name]

    asyncio.run(scenario())
    assert good == {f"{topic}/0/{i}" for i in range(len(messages))}
    assert dead_letters(settings_for(broker, aws, topic)) == []


def test_a_streaming_client_and_a_push_target_share_one_deployment(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """Both take records from the same partition's window; each record is settled once,
    by whichever got it, and the commit reaches the end."""
    messages: list[Message] = [(b"k%d" % i, b"v%d" % i, None) for i in range(400)]
    pushed: set[int] = set()

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(0.005)
        pushed.add(int(request.headers["ce-id"].rsplit("/", 1)[1]))
        return web.Response(status=200)

    async def scenario() -> None:
        async with receiver(handle) as url:
            target = push_target(url, max_concurrency=4, initial_concurrency=4)
            settings = settings_for(broker, aws, topic, push=target)
            async with Proxy(settings, 0) as proxy, RawConsumer(f"127.0.0.1:{proxy.port}") as raw:
                produce(broker.bootstrap, topic, messages)
                streamed: set[int] = set()
                group = settings.kafka.group_id
                deadline = time.monotonic() + 60
                while committed(broker.bootstrap, group, topic) != len(messages):
                    assert time.monotonic() < deadline, "the commit did not reach the end"
                    try:
                        got = await raw.receive(1, timeout=0.2)
                    except TimeoutError:
                        continue
                    streamed |= {d.offset for d in got}
                    raw.settle(acks=[d.offset for d in got])
                assert streamed
                assert pushed
                assert not streamed & pushed  # one settlement each
                assert streamed | pushed == set(range(len(messages)))
                assert proxy.snapshot().counters["rejected"] == 0

    asyncio.run(scenario())
