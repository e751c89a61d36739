"""Push's test counterparts: a real aiohttp receiver on a loopback port, and the
registration call a gRPC push consumer makes (`GET /consumers`)."""

from __future__ import annotations

import asyncio
import ssl
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def receiver(
    handler: Handler, port: int = 0, ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[str]:
    """Serves `handler` for POST / on 127.0.0.1:`port` (0: a free one); yields its URL."""
    app = web.Application()
    app.router.add_post("/", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, ssl_context=ssl_context)
    await site.start()
    scheme = "https" if ssl_context is not None else "http"
    try:
        yield f"{scheme}://127.0.0.1:{runner.addresses[0][1]}/"
    finally:
        await runner.cleanup()


async def register(http_port: int, token: str, grpc_port: int) -> int:
    """Registers a gRPC push consumer on `grpc_port` with the proxy's HTTP port, as the
    original Triage consumer client does; the response's status."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/consumers",
        headers={"Authorization": token, "grpcport": str(grpc_port)},
    )

    def call() -> int:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)

    return await asyncio.to_thread(call)
