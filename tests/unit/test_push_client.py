"""push/client.py's bounds against servers on loopback that this test writes byte by byte:
connections kept and reused, a body cut at `max_body`, headers over the cap, a server
that hangs, and a name that does not resolve (an outage to the target, no attempt)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from triage_proxy.push.client import MAX_HEADER_BYTES, ConnectError, HttpClient, ResponseError
from triage_proxy.push.cloudevents import EventShape
from triage_proxy.push.http import HttpEndpoint, HttpTarget
from triage_proxy.push.limit import LimitSettings
from triage_proxy.push.responses import Verdict
from triage_proxy.push.target import TargetShape
from triage_proxy.structs import Record

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return await reader.readexactly(length)


async def with_server(serve: Serve, body: Callable[[str], Awaitable[Any]]) -> Any:
    """Run `body(url)` against a server whose connections `serve` answers; then close
    every connection and end every handler."""
    handlers: set[asyncio.Task[Any]] = set()
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await serve(reader, writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await body(f"http://127.0.0.1:{port}/in")
    finally:
        server.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        for writer in writers:
            writer.close()
        await server.wait_closed()


def test_connections_are_kept_and_reused() -> None:
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            while True:
                body = await read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    async def body(url: str) -> list[bytes]:
        client = HttpClient(url, max_body=1024)
        try:
            return [(await client.post({}, b"r%d" % i, 5)).body for i in range(5)]
        finally:
            client.close()

    assert asyncio.run(with_server(serve, body)) == [b"r%d" % i for i in range(5)]
    assert connections == 1


def test_a_body_over_max_body_is_cut_and_its_connection_dropped() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 500 Oops\r\ncontent-length: 1000000000\r\n\r\n")
        try:
            for _ in range(1000):  # 64 MB at most, unless the client hangs up first
                writer.write(b"x" * 65536)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    async def body(url: str) -> Any:
        client = HttpClient(url, max_body=4096)
        try:
            return await client.post({}, b"", 5)
        finally:
            client.close()

    response = asyncio.run(with_server(serve, body))
    assert (response.status, len(response.body), response.complete) == (500, 4096, False)


def test_headers_over_the_cap_fail_the_request() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(MAX_HEADER_BYTES // 1000 + 2):
            writer.write(b"x-filler-%d: %s\r\n" % (i, b"y" * 1000))
        writer.write(b"content-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def body(url: str) -> None:
        client = HttpClient(url, max_body=4096)
        try:
            with pytest.raises(ResponseError, match="headers over"):
                await client.post({}, b"", 5)
        finally:
            client.close()

    asyncio.run(with_server(serve, body))


def test_a_server_that_hangs_ends_at_the_timeout() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(3600)

    async def body(url: str) -> None:
        client = HttpClient(url, max_body=4096)
        try:
            with pytest.raises(TimeoutError):
                await client.post({}, b"", 0.2)
        finally:
            client.close()

    asyncio.run(with_server(serve, body))


def test_a_name_that_does_not_resolve_is_an_outage_that_uses_no_attempt() -> None:
    """The resolver's answer is stood in for (no lookup leaves the machine); a refused
    connection, the same path, is covered against a real closed port in
    tests/integration/test_push.py."""
    shape = TargetShape(
        name="t",
        limit=LimitSettings(min_limit=1, max_limit=4, initial=1),
        batch=1,
        max_batch_bytes=1024 * 1024,
        timeout_s=5.0,
    )
    endpoint = HttpEndpoint(
        url="http://orders.example.invalid/in",
        event=EventShape(source="triage://g/t"),
        nack_statuses=frozenset({400}),
        max_response_bytes=4096,
    )
    record = Record("t", 0, 7, b"k", b"v", (), 0)

    async def scenario() -> Any:
        loop = asyncio.get_running_loop()

        async def no_such_name(*args: Any, **kwargs: Any) -> Any:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

        loop.getaddrinfo = no_such_name  # type: ignore[method-assign]
        target = HttpTarget(shape, endpoint)
        await target.start()
        try:
            return await target.call([record], [record])
        finally:
            await target.stop()

    call = asyncio.run(scenario())
    (outcome,) = call.outcomes
    assert outcome.verdict is Verdict.OUTAGE
    assert not outcome.verdict.uses_attempt
    assert "cannot connect to orders.example.invalid:80" in outcome.reason
    assert call.kind == "refused"
    assert issubclass(ConnectError, OSError)
