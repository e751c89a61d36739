"""Push delivery through a target's life: drain on SIGTERM, Retry-After, the rate limits,
a registered gRPC consumer killed and registering again, and what /metrics shows. A real
proxy (in process, or `triage proxy` in a subprocess), the real broker and DynamoDB
endpoint, and real receivers on free loopback ports."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme
from aiohttp import web

from tests.integration.harness import (
    LEASE_S,
    TOKEN,
    ChildProcess,
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
from tests.integration.receivers import receiver, register
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port
from triage_protocol import handler_pb2, handler_pb2_grpc
from triage_proxy.app import Proxy
from triage_proxy.push.targets import UNREGISTERED

pytestmark = pytest.mark.integration


def offset_of(request: web.Request) -> int:
    return int(request.headers["ce-id"].rsplit("/", 1)[1])


def records(n: int) -> list[tuple[bytes, bytes, None]]:
    return [(b"k%d" % i, b"v%d" % i, None) for i in range(n)]


def read_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def read_json(url: str) -> Any:
    return json.loads(read_text(url))


def test_sigterm_lets_requests_in_flight_finish_and_gives_back_the_rest_without_an_attempt(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str, tmp_path: Path
) -> None:
    """`triage proxy` gets SIGTERM with 8 requests in flight: the 4 answered during the
    drain are acked and committed; the 4 still unanswered at `drain_timeout_s` are given
    back without an attempt, so with `max_attempts = 1` the next process delivers them
    instead of dead-lettering them. Nothing new is sent once the drain began."""
    total = 40
    produce(broker.bootstrap, topic, records(total))
    answered_in_drain = asyncio.Event()
    phase = {"n": 1}
    held: set[int] = set()
    after_stop: list[int] = []
    stopping = asyncio.Event()
    release_first = asyncio.Event()
    # 4-7 stay unanswered until the scenario ends; then they return, so the receiver's
    # cleanup does not wait out aiohttp's shutdown timeout for them.
    release_rest = asyncio.Event()
    seen: set[int] = set()

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        offset = offset_of(request)
        if phase["n"] == 1:
            if stopping.is_set():
                after_stop.append(offset)
            if offset < 8:
                held.add(offset)
                # 0-3 are answered once the drain began; 4-7 never, in this phase.
                await (release_first if offset < 4 else release_rest).wait()
                answered_in_drain.set()
        seen.add(offset)
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
                "shutdown": {"drain_timeout_s": 3},
                "delivery": {"max_attempts": 1},
                "push": [
                    {
                        "name": "receiver",
                        "url": url,
                        "timeout_s": 60,
                        "max_concurrency": 8,
                        "initial_concurrency": 8,
                    }
                ],
            }
            procs: list[subprocess.Popen[bytes]] = []
            try:
                proc, _ = start_proxy_process(tmp_path, "first", base, 0)
                procs.append(proc)
                assert await await_until(lambda: len(held) == 8, 60)
                status_url = f"http://127.0.0.1:{first_http_port(tmp_path)}/status"
                proc.send_signal(signal.SIGTERM)

                def draining() -> bool:
                    doc = read_json(status_url)
                    return bool(doc["partitions"]) and doc["partitions"][0]["state"] == "stopping"

                deadline = time.monotonic() + 30
                while not await asyncio.to_thread(draining):
                    assert time.monotonic() < deadline, "the partition did not start draining"
                    await asyncio.sleep(0.02)
                stopping.set()
                release_first.set()
                assert await asyncio.wait_for(asyncio.to_thread(proc.wait), 60) == 0
                assert answered_in_drain.is_set()
                assert after_stop == []  # nothing new was sent once the drain began
                assert seen == {0, 1, 2, 3}
                group = settings.kafka.group_id
                assert committed(broker.bootstrap, group, topic) == 4

                phase["n"] = 2
                proc, _ = start_proxy_process(tmp_path, "second", base, 0)
                procs.append(proc)
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == total, 90
                )
            finally:
                release_rest.set()
                kill_processes(procs)

    asyncio.run(scenario())
    assert seen == set(range(total))
    assert dead_letters(settings_for(broker, aws, topic)) == []


def first_http_port(tmp_path: Path) -> int:
    """The HTTP port `start_proxy_process` wrote into first.toml (partition 0)."""
    import tomllib

    with open(tmp_path / "first.toml", "rb") as f:
        return int(tomllib.load(f)["server"]["http_port"])


def test_retry_after_is_honoured_and_uses_no_attempt(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """A 503 with `Retry-After: 2`: the target sends nothing for 2 s, says why in its
    state, and the record is delivered after it (one attempt allowed, none used)."""
    total = 10
    produce(broker.bootstrap, topic, records(total))
    arrivals: list[float] = []
    waiting: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        arrivals.append(time.monotonic())
        if len(arrivals) == 1:
            return web.Response(status=503, headers={"Retry-After": "2"}, text="busy")
        return web.Response(status=200)

    async def scenario() -> None:
        async with receiver(handle) as url:
            target = [{"name": "r", "url": url, "timeout_s": 5, "max_concurrency": 1}]
            settings = settings_for(broker, aws, topic, push=target, delivery={"max_attempts": 1})
            async with Proxy(settings, 0) as proxy:
                assert await await_until(lambda: len(arrivals) >= 1, 30)
                assert await await_until(lambda: proxy.status().push[0].state != "ok", 10)
                waiting.append(proxy.status().push[0].state)
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == total, 30
                )
                push = proxy.status().push[0]
                assert push.records.get("overload") == 1
                assert push.records.get("ack") == total
                assert push.state == "ok"

    asyncio.run(scenario())
    assert waiting[0].startswith("overload: HTTP 503")
    assert "waiting 2.0 s" in waiting[0]
    assert arrivals[1] - arrivals[0] >= 1.9  # nothing was sent before Retry-After ran out
    assert len(arrivals) == total + 1
    assert dead_letters(settings_for(broker, aws, topic)) == []


def test_an_endpoint_that_sheds_everything_is_backed_off_not_hammered(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """503 for every request, without Retry-After, for 3 s: the limit falls to its floor,
    then the target pauses with backoff instead of resending each record as fast as the
    endpoint answers. No attempt is used (one allowed); everything is delivered after."""
    total = 10
    produce(broker.bootstrap, topic, records(total))
    shed: list[float] = []
    states: list[str] = []
    until: list[float] = []

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        now = time.monotonic()
        if not until:
            until.append(now + 3.0)
        if now < until[0]:
            shed.append(now)
            return web.Response(status=503, text="maintenance")
        return web.Response(status=200)

    async def scenario() -> None:
        async with receiver(handle) as url:
            target = [{"name": "r", "url": url, "timeout_s": 5, "initial_concurrency": 4}]
            settings = settings_for(broker, aws, topic, push=target, delivery={"max_attempts": 1})
            async with Proxy(settings, 0) as proxy:
                assert await await_until(lambda: proxy.status().push[0].state != "ok", 15)
                states.append(proxy.status().push[0].state)
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == total, 60
                )

    asyncio.run(scenario())
    assert states[0].startswith("overload: HTTP 503 (waiting ")
    # Falling 4 -> 1 (x 0.9 once per round trip) takes some 20 requests; then pauses of
    # 0.5, 1, 2 s: a few more in 3 s, where resending at once makes thousands on loopback.
    assert 1 <= len(shed) <= 100
    assert dead_letters(settings_for(broker, aws, topic)) == []


def test_a_batch_stays_within_max_batch_bytes_and_a_larger_record_goes_alone(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """`batch = 50`, `max_batch_bytes = 8192`, records of 1,000 bytes: each request's
    body fits the bytes (a few records each, never 50), except the one request that
    carries the 20,000-byte record, alone; every record arrives byte-exact."""
    values = [bytes([i % 256]) * 1000 for i in range(30)]
    values.insert(10, b"\xfe" * 20_000)
    produce(broker.bootstrap, topic, [(b"k%d" % i, v, None) for i, v in enumerate(values)])
    bodies: list[tuple[int, int]] = []  # (bytes, events) per request
    got: dict[int, bytes] = {}

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        events = json.loads(body)
        bodies.append((len(body), len(events)))
        for event in events:
            got[int(event["id"].rsplit("/", 1)[1])] = base64.b64decode(event["data_base64"])
        return web.Response(status=200)

    async def scenario() -> None:
        async with receiver(handle) as url:
            target = [
                {"name": "r", "url": url, "timeout_s": 5, "batch": 50, "max_batch_bytes": 8192}
            ]
            settings = settings_for(broker, aws, topic, push=target)
            async with Proxy(settings, 0):
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == len(values), 30
                )

    asyncio.run(scenario())
    assert got == dict(enumerate(values))
    assert [n for size, n in bodies if size > 8192] == [1]  # the large record, alone
    assert all(size <= 8192 for size, n in bodies if n > 1)
    assert max(n for _, n in bodies) > 1  # batches did form


def test_the_rate_limit_holds_for_pushed_records(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """`rate_limit.messages_per_s` caps what a push target is handed, as it caps a
    streaming client: one second's burst, then the cap."""
    cap, total = 100.0, 300
    produce(broker.bootstrap, topic, records(total))
    arrivals: list[float] = []

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        arrivals.append(time.monotonic())
        return web.Response(status=200)

    async def scenario() -> float:
        async with receiver(handle) as url:
            target = [{"name": "r", "url": url, "timeout_s": 5, "max_concurrency": 16}]
            settings = settings_for(
                broker, aws, topic, push=target, rate_limit={"messages_per_s": cap}
            )
            opened = time.monotonic()
            async with Proxy(settings, 0):
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == total, 60
                )
            return opened

    opened = asyncio.run(scenario())
    assert len(arrivals) == total
    # Every bound is counted from `opened`, before the proxy started, so a handler that
    # records an arrival late on a loaded machine only loosens it. A full bucket of `cap`,
    # then `cap` a second: the last arrives (300 - 100) / 100 = 2 s after the first could.
    assert arrivals[-1] - opened >= (total - cap) / cap * 0.95
    # Never more than a burst plus `cap` a second in any prefix of the run.
    for i, t in enumerate(arrivals):
        assert i + 1 <= cap + cap * (t - opened) + 1


def grpc_consumer(options: dict[str, Any]) -> ChildProcess:
    """tests/integration/grpc_consumer.py as a child process, registered with the proxy."""
    consumer = ChildProcess("tests.integration.grpc_consumer", options)
    assert consumer.ready.get("registered") == 200, consumer.ready
    return consumer


def test_a_grpc_consumer_killed_mid_run_loses_nothing_and_may_register_again(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """The original Triage's consumer is killed -9 with calls in flight: the proxy forgets
    it, the records of those calls come back as suspects (a kill during several calls blames
    none of them), and once it registers again on the same port it receives the rest."""
    total = 600
    produce(broker.bootstrap, topic, records(total))
    port = free_port()
    consumers: list[ChildProcess] = []

    async def scenario() -> None:
        target = [{"name": "go", "mode": "grpc", "registration": True, "max_concurrency": 8}]
        settings = settings_for(broker, aws, topic, push=target, delivery={"max_attempts": 2})
        async with Proxy(settings, 0) as proxy:
            options = {
                "port": port,
                "register": f"http://127.0.0.1:{proxy.http_port}/consumers",
                "token": TOKEN,
                "delay_ms": 20,
            }

            def acked() -> int:
                return sum(t.records.get("ack", 0) for t in proxy.status().push)

            consumers.append(await asyncio.to_thread(grpc_consumer, options))
            assert await await_until(lambda: acked() >= 100, 30)
            consumers[0].kill()  # kill -9 with calls in flight
            # Forgotten: the table shows as one target that waits for a registration.
            waiting = [("go", UNREGISTERED)]
            assert await await_until(
                lambda: [(t.name, t.state) for t in proxy.status().push] == waiting, 15
            )
            group = settings.kafka.group_id
            assert committed(broker.bootstrap, group, topic) < total
            consumers.append(await asyncio.to_thread(grpc_consumer, options))
            assert await await_until(lambda: committed(broker.bootstrap, group, topic) == total, 60)
            assert proxy.snapshot().counters["dead_lettered"] == 0
            (again,) = proxy.status().push
            assert again.name == f"go@127.0.0.1:{port}"

    run_then_kill(scenario, consumers)
    assert dead_letters(settings_for(broker, aws, topic)) == []


def test_a_record_that_crashes_the_grpc_consumer_is_dead_lettered_and_nothing_else(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """A crash-type poison pill for the original Triage's consumer: the process exits
    whenever it is handed one record, and (as a process manager would) it is started again
    and registers again. The pill is blamed as the vanished consumer's one suspect, so it
    is dead-lettered after `max_attempts + 1` crashes at most; the records in flight beside
    it lose nothing, and the partition commits to the end."""
    values = [b"v%d" % i for i in range(200)]
    values[60] = b"crash"
    produce(broker.bootstrap, topic, [(None, v, None) for v in values])
    port = free_port()
    consumers: list[ChildProcess] = []

    async def scenario() -> None:
        target = [{"name": "go", "mode": "grpc", "registration": True, "max_concurrency": 8}]
        settings = settings_for(
            broker,
            aws,
            topic,
            push=target,
            delivery={"max_attempts": 2, "redelivery_span_s": 1},
        )
        async with Proxy(settings, 0) as proxy:
            options = {
                "port": port,
                "register": f"http://127.0.0.1:{proxy.http_port}/consumers",
                "token": TOKEN,
                "delay_ms": 5,
                "crash_on": "crash",
            }
            await restart_until_committed(
                lambda: grpc_consumer(options),
                consumers,
                broker.bootstrap,
                settings.kafka.group_id,
                topic,
                len(values),
            )

    run_then_kill(scenario, consumers)
    (dl,) = dead_letters(settings_for(broker, aws, topic))
    assert (dl.record.offset, dl.record.value, dl.attempts) == (60, b"crash", 2)
    cause = f"the consumer at 127.0.0.1:{port} went away during the call"
    assert dl.reason == f"delivery attempts exhausted (2): {cause}"
    assert len(consumers) <= 4  # max_attempts + 1 crashes, then one that stays


def test_a_record_that_keeps_failing_is_dead_lettered_after_its_attempts(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """A 500 uses an attempt each time; after `max_attempts` the record is dead-lettered
    with the last answer as its reason, and the records around it are acked."""
    produce(broker.bootstrap, topic, [*records(3), (b"bad", b"always 500", None), *records(3)])
    tries: list[int] = []

    async def handle(request: web.Request) -> web.Response:
        if await request.read() == b"always 500":
            tries.append(len(tries) + 1)
            return web.Response(status=500, text=f"broken, try {len(tries)}")
        return web.Response(status=200)

    async def scenario() -> None:
        async with receiver(handle) as url:
            settings = settings_for(
                broker,
                aws,
                topic,
                push=[{"name": "r", "url": url, "timeout_s": 5}],
                delivery={"max_attempts": 3},
                retry={"initial_backoff_s": 0.05, "max_backoff_s": 0.1},
            )
            async with Proxy(settings, 0) as proxy:
                group = settings.kafka.group_id
                assert await await_until(lambda: committed(broker.bootstrap, group, topic) == 7, 30)
                assert proxy.status().push[0].records == {"ack": 6, "retry": 3}

    asyncio.run(scenario())
    assert tries == [1, 2, 3]
    (dl,) = dead_letters(settings_for(broker, aws, topic))
    assert (dl.record.offset, dl.record.key, dl.record.value) == (3, b"bad", b"always 500")
    assert dl.reason == "delivery attempts exhausted (3): HTTP 500: broken, try 3"


def test_metrics_show_each_target(broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str) -> None:
    """/metrics of a running proxy: the limit, in-flight, requests by class, records by
    verdict, errors and the latency histogram, labelled by target. Registration is off
    without a mode "grpc" target: `GET /consumers` is not there."""
    produce(broker.bootstrap, topic, [*records(5), (b"p", b"poison", None)])

    async def handle(request: web.Request) -> web.Response:
        if await request.read() == b"poison":
            return web.Response(status=422, text="no")
        return web.Response(status=200)

    async def scenario() -> str:
        async with receiver(handle) as url:
            target = [{"name": "orders", "url": url, "timeout_s": 5, "max_concurrency": 4}]
            settings = settings_for(broker, aws, topic, push=target)
            async with Proxy(settings, 0) as proxy:
                group = settings.kafka.group_id
                assert await await_until(lambda: committed(broker.bootstrap, group, topic) == 6, 30)
                base = f"http://127.0.0.1:{proxy.http_port}"
                with pytest.raises(urllib.error.HTTPError) as refused:
                    await asyncio.to_thread(read_text, f"{base}/consumers")
                refused.value.close()
                assert refused.value.code == 404
                return await asyncio.to_thread(read_text, f"{base}/metrics")  # served here

    text = asyncio.run(scenario())
    lines = set(text.splitlines())
    assert any(line.startswith('triage_push_limit{target="orders"} ') for line in lines)
    assert 'triage_push_in_flight{target="orders"} 0.0' in lines
    assert 'triage_push_paused{target="orders"} 0.0' in lines
    assert 'triage_push_requests_total{class="2xx",target="orders"} 5.0' in lines
    assert 'triage_push_requests_total{class="4xx",target="orders"} 1.0' in lines
    assert 'triage_push_records_total{target="orders",verdict="ack"} 5.0' in lines
    assert 'triage_push_records_total{target="orders",verdict="nack"} 1.0' in lines
    assert 'triage_push_errors_total{target="orders"} 0.0' in lines
    assert 'triage_push_latency_seconds_count{target="orders"} 6.0' in lines


def test_grpc_push_dials_back_over_mutual_tls(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str, tmp_path: Path
) -> None:
    """With `ca_file` and `cert_file`/`key_file` on the mode "grpc" table, the proxy dials
    the registered consumer over TLS, verifies it against the CA and presents its own
    certificate (the consumer's server demands one)."""
    total = 20
    produce(broker.bootstrap, topic, records(total))
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    client_cert = ca.issue_cert("proxy.triage.test")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    client_cert.cert_chain_pems[0].write_to_path(str(tmp_path / "client.pem"))
    client_cert.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    bodies: list[str] = []

    class Handler(handler_pb2_grpc.MessageHandlerServicer):
        async def SendMessage(self, request: Any, context: Any) -> Any:
            bodies.append(request.body)
            return handler_pb2.MessageResponse(body="ok", status=1)

    async def scenario() -> None:
        server = grpc.aio.server()
        handler_pb2_grpc.add_MessageHandlerServicer_to_server(Handler(), server)
        credentials = grpc.ssl_server_credentials(
            [(server_cert.private_key_pem.bytes(), server_cert.cert_chain_pems[0].bytes())],
            root_certificates=ca.cert_pem.bytes(),
            require_client_auth=True,
        )
        port = server.add_secure_port("127.0.0.1:0", credentials)
        await server.start()
        table = {
            "name": "go",
            "mode": "grpc",
            "registration": True,
            "ca_file": str(tmp_path / "ca.pem"),
            "cert_file": str(tmp_path / "client.pem"),
            "key_file": str(tmp_path / "client.key"),
        }
        settings = settings_for(broker, aws, topic, push=[table])
        try:
            async with Proxy(settings, 0) as proxy:
                assert proxy.http_port is not None  # set once the proxy has started
                assert await register(proxy.http_port, TOKEN, port) == 200
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == total, 30
                )
                (target,) = proxy.status().push
                assert target.records == {"ack": total}
        finally:
            await server.stop(None)

    asyncio.run(scenario())
    assert sorted(bodies) == sorted(f"v{i}" for i in range(total))


def test_grpc_answers_use_an_attempt_or_not_as_the_table_says(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    """Two attempts allowed. RESOURCE_EXHAUSTED twice in a row uses none (then acked); a
    status other than 1 or -1, an INTERNAL error and a call past `timeout_s` use one each
    (then acked at the second); a status 7 every time is dead-lettered after two."""
    bodies = ["exhausted", "status0", "internal", "slow", "always7", "plain"]
    produce(broker.bootstrap, topic, [(None, b.encode(), None) for b in bodies])
    tries: dict[str, int] = {}

    class Handler(handler_pb2_grpc.MessageHandlerServicer):
        async def SendMessage(self, request: Any, context: Any) -> Any:
            body = request.body
            n = tries[body] = tries.get(body, 0) + 1
            if body == "exhausted" and n <= 2:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
            if body == "status0" and n == 1:
                return handler_pb2.MessageResponse(body="later", status=0)
            if body == "internal" and n == 1:
                await context.abort(grpc.StatusCode.INTERNAL, "oops")
            if body == "slow" and n == 1:
                await asyncio.sleep(3)  # past timeout_s: DEADLINE_EXCEEDED at the proxy
            if body == "always7":
                return handler_pb2.MessageResponse(body="nope", status=7)
            return handler_pb2.MessageResponse(body="ok", status=1)

    async def scenario() -> None:
        server = grpc.aio.server()
        handler_pb2_grpc.add_MessageHandlerServicer_to_server(Handler(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        table = {"name": "go", "mode": "grpc", "registration": True, "timeout_s": 1}
        settings = settings_for(
            broker,
            aws,
            topic,
            push=[table],
            delivery={"max_attempts": 2},
            retry={"initial_backoff_s": 0.05, "max_backoff_s": 0.1},
        )
        try:
            async with Proxy(settings, 0) as proxy:
                assert proxy.http_port is not None  # set once the proxy has started
                assert await register(proxy.http_port, TOKEN, port) == 200
                group = settings.kafka.group_id
                assert await await_until(
                    lambda: committed(broker.bootstrap, group, topic) == len(bodies), 60
                )
                (target,) = proxy.status().push
                assert target.responses.get("exhausted") == 2
                assert target.responses.get("timeout") == 1
                assert target.responses.get("internal") == 1
                # Only the timeout got no answer; every other call's round trip is latency.
                assert target.errors == 1
                assert target.latency.count == sum(target.responses.values()) - 1
        finally:
            await server.stop(None)

    asyncio.run(scenario())
    assert tries == {
        "exhausted": 3,
        "status0": 2,
        "internal": 2,
        "slow": 2,
        "always7": 2,
        "plain": 1,
    }
    (dl,) = dead_letters(settings_for(broker, aws, topic))
    assert dl.record.value == b"always7"
    assert dl.reason == "delivery attempts exhausted (2): consumer answered status 7: nope"
