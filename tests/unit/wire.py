"""A real proxy (`Proxy` over in-memory twins) and one Consume stream to it, for the unit
tests that talk to the service over gRPC on loopback.

Why one place: each such test started the proxy, opened a channel and a stream with the
token and said Hello the same way, and stopped it all in the same order; a change to
any of that (a header, a frame) was a change to every copy.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from triage_protocol import triage_pb2 as pb
from triage_protocol import triage_pb2_grpc as pb_grpc
from triage_proxy.app import Proxy

READ_TIMEOUT_S = 30.0
"""Generous: a frame the proxy owes arrives within milliseconds on an idle machine."""


@contextlib.asynccontextmanager
async def serving(proxy: Proxy) -> AsyncIterator[Proxy]:
    """The proxy started, and stopped (waited for) on the way out."""
    await proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
        await proxy.wait_stopped()


@contextlib.asynccontextmanager
async def consume_call(proxy: Proxy, token: str) -> AsyncIterator[Any]:
    """A Consume stream to `proxy` with `token`; cancelled and its channel closed on the
    way out."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        stub = pb_grpc.TriageStub(channel)
        call = stub.Consume(metadata=[("authorization", f"Bearer {token}")])
        try:
            yield call
        finally:
            call.cancel()


async def hello(call: Any, credits: int = 10, consumer_id: str = "i1") -> pb.Welcome:
    """Say Hello with `credits`; the Welcome (the test fails if another frame comes)."""
    await call.write(pb.ConsumerFrame(hello=pb.Hello(consumer_id=consumer_id, credits=credits)))
    frame: pb.ProxyFrame = await asyncio.wait_for(call.read(), READ_TIMEOUT_S)
    assert frame.HasField("welcome"), frame
    return frame.welcome


async def take(call: Any, count: int) -> list[int]:
    """Read Deliveries frames until `count` offsets have come; the offsets."""
    got: list[int] = []
    while len(got) < count:
        frame = await asyncio.wait_for(call.read(), READ_TIMEOUT_S)
        got.extend(d.offset for d in frame.deliveries.deliveries)
    return got
