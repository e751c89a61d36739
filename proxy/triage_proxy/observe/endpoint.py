"""The HTTP endpoint: one proxy process's HTTP endpoint for monitoring and orchestration.

    GET /metrics   Prometheus text format (this proxy's own registry, see metrics.py): one
                   sample per partition the process runs, labelled `partition`
    GET /healthz   liveness: 200 while the proxy's event loop answers (and it has not stopped)
    GET /readyz    readiness: 200 only while every partition it should serve is delivering
                   (pinned: every pin; fleet: it joined the group and serves what it was
                   assigned); 503 while starting, standing by for a lease, or stopping,
                   and while the broker is gone with nothing left to deliver
                   (`not_ready_because`)
    GET /status    JSON snapshot (`snapshot.ProcessSnapshot.to_json`: the process and a
                   document per partition, `partitions`); `triage status` reads it

It runs on the proxy's event loop (aiohttp), starts before the proxy opens Kafka so a
standby or a slow start can be watched, and stops last. It carries no secrets and no
payloads, so it has no token; it binds its own interface, `server.http_host` (default
loopback, whatever `server.host` is), and `server.http_enabled = false` turns it off.
It reads the proxy only through `Proxy.status` (passed in), never the proxy itself; a
one-partition `ProxySnapshot` is taken as a process serving that partition.

A request that does not parse gets aiohttp's 400 and one WARNING line per kind per
interval (`_MalformedRequests`), never a traceback; a connection idle for
KEEPALIVE_TIMEOUT_S is closed.
"""

from __future__ import annotations

import enum
import errno
import logging
from collections.abc import Callable, Sequence
from types import TracebackType

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.log import server_logger
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from triage_proxy.errors import ConfigError, StateError
from triage_proxy.observe.logthrottle import LogThrottle
from triage_proxy.observe.metrics import proxy_registry
from triage_proxy.observe.snapshot import ProcessSnapshot, ProxySnapshot, as_process

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 1.0
"""How long an in-progress HTTP request may finish when the proxy stops."""
KEEPALIVE_TIMEOUT_S = 15.0
"""How long a connection may stay idle (before its first request, or between two) before
it is closed: a scraper reconnects at no cost; aiohttp's default is an hour."""


class _MalformedRequests(logging.Logger):
    """The logger aiohttp's request handler is given: a request that does not parse (an
    `HttpProcessingError`: garbage, TLS on the HTTP port, a bad header) is the client's,
    answered 400 by aiohttp; it becomes one WARNING line per kind per interval, with the
    peer and without the client's bytes, instead of a traceback per request. Anything
    else goes to aiohttp's own logger as it was."""

    def __init__(self) -> None:
        super().__init__(f"{__name__}.http")
        self._throttle = LogThrottle(logger)

    def handle(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            kind = type(exc).__name__
            self._throttle.warning(kind, "refused a malformed HTTP request from %s: %s", peer, kind)
        elif server_logger.isEnabledFor(record.levelno):
            server_logger.handle(record)


class EndpointState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


class HttpEndpoint:
    """Serves /metrics, /healthz, /readyz and /status for one proxy process."""

    def __init__(
        self,
        snapshot: Callable[[], ProcessSnapshot | ProxySnapshot],
        address: tuple[str, int] | None,
        *,
        routes: Sequence[web.RouteDef] = (),
    ) -> None:
        self._source = snapshot
        self._routes = tuple(routes)
        """More routes the process serves here (push registration, `GET /consumers`)."""
        self._address = address
        self._registry = proxy_registry(snapshot)
        self._runner: web.AppRunner | None = None
        self.state = EndpointState.NEW
        self.port: int | None = None
        """The port bound (None when `server.http_enabled` is false)."""

    def _snapshot(self) -> ProcessSnapshot:
        return as_process(self._source())

    async def start(self) -> None:
        if self.state is not EndpointState.NEW:
            raise StateError(f"HTTP endpoint already {self.state.value}")
        self.state = EndpointState.RUNNING
        if self._address is None:
            return
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/status", self._status)
        app.router.add_routes(self._routes)
        runner = web.AppRunner(
            app,
            access_log=None,
            shutdown_timeout=SHUTDOWN_GRACE_S,
            keepalive_timeout=KEEPALIVE_TIMEOUT_S,
            logger=_MalformedRequests(),
        )
        await runner.setup()
        host, port = self._address
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            self.state = EndpointState.STOPPED
            # A port in use is the port's fault; anything else (an address this machine
            # does not have, a name that does not resolve) the host's.
            key = "server.http_port" if exc.errno == errno.EADDRINUSE else "server.http_host"
            raise ConfigError(key, f"cannot listen on {host}:{port}: {exc}") from exc
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        logger.info("metrics, health and status on http://%s:%d", host, self.port)

    async def stop(self) -> None:
        """Stop answering (safe twice)."""
        if self.state is EndpointState.STOPPED:
            return
        self.state = EndpointState.STOPPED
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
            logger.debug("HTTP endpoint stopped")

    async def __aenter__(self) -> HttpEndpoint:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # --- endpoints --------------------------------------------------------------------

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self._registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _healthz(self, request: web.Request) -> web.Response:
        snap = self._snapshot()
        if snap.alive:
            return web.Response(text="ok\n")
        return web.Response(status=503, text=f"{snap.state}\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        why = not_ready_because(self._snapshot())
        if why is None:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"{why}\n")

    async def _status(self, request: web.Request) -> web.Response:
        doc = self._snapshot().to_json()
        doc["http_port"] = self.port
        return web.json_response(doc)


BROKER_GONE = "broker unreachable and nothing left to deliver"
NOT_A_MEMBER = "not a member of the consumer group (its session was lost): rejoining"


def not_ready_because(snap: ProcessSnapshot | ProxySnapshot) -> str | None:
    """Why the proxy is not ready, or None when it is (pure; what /readyz answers).

    Ready means RUNNING and able to hand out work on every partition it should serve:
    not while the broker is gone for one of them (the last fetch or high-watermark query
    failed, `degraded` names `fetch` or `log_end`) and its window holds nothing to
    deliver. With records still in the window the proxy keeps serving them, and stays
    ready; the first good answer from the broker makes it ready again (the watermark is
    asked every 2 s, see logend.py)."""
    if not snap.ready:
        lost = isinstance(snap, ProcessSnapshot) and not snap.member
        return NOT_A_MEMBER if lost and snap.state == "running" else snap.state
    parts = snap.partitions if isinstance(snap, ProcessSnapshot) else (snap,)
    for part in parts:
        broker_gone = "fetch" in part.degraded or "log_end" in part.degraded
        if broker_gone and part.in_window == 0:
            return BROKER_GONE if len(parts) == 1 else f"partition {part.partition}: {BROKER_GONE}"
    return None
