"""gRPC push, compatible with the original Triage's consumers (Go programs, unchanged).

A consumer registers with `GET /consumers` on the proxy's HTTP port:

    Authorization: <token>     the deployment's token, raw (no "Bearer")
    grpcport: <port>           where it serves triage.MessageHandler

    400 Missing Authorization header
    401 Malformed or invalid authorization token
    400 Missing gRPC port header            (or: a port outside 1-65535)
    403 the source address is outside the allow-list
    503 the proxy is stopping
    200 registered (again: still registered)

The proxy dials back the request's source address (the first X-Forwarded-For value when
`trust_forwarded_for` is set) on that port and calls `SendMessage(Message{body})` once
per record, `body` being the record value as text:

    status 1             ack
    status -1            nack: dead letter now
    any other status     an attempt used (redelivered after backoff)
    cannot connect       the consumer is gone: its records go back without an attempt,
                         and it is forgotten until it registers again
    UNAVAILABLE          the consumer vanished during the call (the call went out on a
                         connection that was up): forgotten too, and what its calls
                         carried is judged as for a client that vanished (the
                         dispatcher's `suspect`): a suspect uses an attempt, the rest
                         come back as suspects. So a record that crashes the consumer
                         is dead-lettered in the end
    DEADLINE_EXCEEDED    an attempt used; the limit falls (a timeout)
    RESOURCE_EXHAUSTED   overloaded: no attempt, the limit falls
    any other failure    an attempt used

A record whose value is not UTF-8 cannot travel as a proto3 string: it is dead-lettered
with a reason that says so, without a call. Each registered consumer is a push target of
its own (its own adaptive limit), so a slow consumer holds back only itself.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

import grpc
from aiohttp import web

from triage_protocol import handler_pb2, handler_pb2_grpc
from triage_proxy.config.push import DEFAULT_ALLOW
from triage_proxy.errors import ShuttingDown
from triage_proxy.push.responses import Outcome, Verdict
from triage_proxy.push.target import Call, PushTarget, TargetShape
from triage_proxy.structs import Record

__all__ = ["GrpcTarget", "Registration", "address_allowed"]

logger = logging.getLogger(__name__)


NOT_UTF8 = (
    "value is not valid UTF-8: the gRPC push protocol (triage.MessageHandler) carries "
    "text only; consume this topic through a client or HTTP push instead"
)

ACKED = Outcome(Verdict.ACK)


def address_allowed(address: str, allow: Iterable[str]) -> bool:
    """Whether `address` is inside one of the `allow` networks."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in ipaddress.ip_network(net, strict=False) for net in allow)


class GrpcTarget(PushTarget):
    """One registered consumer: SendMessage once per record."""

    def __init__(
        self,
        shape: TargetShape,
        address: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        on_gone: Callable[[GrpcTarget], None] = lambda target: None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(shape, monotonic=monotonic)
        self.address = address
        self._credentials = credentials
        self._on_gone = on_gone
        self._channel: grpc.aio.Channel | None = None
        self._stub: handler_pb2_grpc.MessageHandlerAsyncStub | None = None

    def _connect(self) -> None:
        if self._credentials is None:
            self._channel = grpc.aio.insecure_channel(self.address)
        else:
            self._channel = grpc.aio.secure_channel(self.address, self._credentials)
        self._stub = handler_pb2_grpc.MessageHandlerStub(self._channel)

    async def _disconnect(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def call(self, records: list[Record], payloads: list[object]) -> Call:
        self._check_sending()
        assert self._stub is not None  # connected at start
        (record,) = records
        try:
            text = (record.value or b"").decode("utf-8")
        except UnicodeDecodeError:
            return Call(
                [Outcome(Verdict.NACK, NOT_UTF8)], dropped=False, kind="not-utf8", answered=False
            )
        if not await self._connected():
            self._on_gone(self)
            reason = f"cannot connect to the consumer at {self.address}"
            return Call(
                [Outcome(Verdict.OUTAGE, reason)], dropped=False, kind="unavailable", answered=False
            )
        try:
            answer = await self._stub.SendMessage(
                handler_pb2.Message(body=text), timeout=self.shape.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            return self._failed(exc)
        if answer.status == 1:
            return Call([ACKED], dropped=False, kind="ok")
        if answer.status == -1:
            reason = f"consumer nacked: {answer.body}" if answer.body else "consumer nacked"
            return Call([Outcome(Verdict.NACK, reason)], dropped=False, kind="ok")
        reason = f"consumer answered status {answer.status}: {answer.body}"
        return Call([Outcome(Verdict.RETRY, reason)], dropped=False, kind="ok")

    async def _connected(self) -> bool:
        """Whether the channel to the consumer is up, connecting first if it is not (at
        most `timeout_s`): a call is only made on a connection that is up, so that an
        UNAVAILABLE answer means the consumer went away during the call, not that it
        could not be reached."""
        assert self._channel is not None, "start() first"
        channel = self._channel
        ready = grpc.ChannelConnectivity.READY
        state = channel.get_state(try_to_connect=True)
        try:
            async with asyncio.timeout(self.shape.timeout_s):
                while state is not ready:
                    if state in (
                        grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                        grpc.ChannelConnectivity.SHUTDOWN,
                    ):
                        return False
                    await channel.wait_for_state_change(state)
                    state = channel.get_state(try_to_connect=True)
        except TimeoutError:
            return False
        return True

    def _failed(self, exc: grpc.aio.AioRpcError) -> Call:
        code = exc.code()
        reason = f"gRPC {code.name}: {exc.details() or ''}"[:500]
        if code is grpc.StatusCode.UNAVAILABLE:
            # The call went out on a connection that was up (`_connected`): the consumer
            # vanished while it held this record, perhaps because of it.
            self._on_gone(self)
            reason = f"the consumer at {self.address} went away during the call"
            return Call(
                [Outcome(Verdict.SUSPECT, reason)],
                dropped=False,
                kind="unavailable",
                answered=False,
            )
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return Call(
                [Outcome(Verdict.RETRY, reason)], dropped=True, kind="timeout", answered=False
            )
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            return Call([Outcome(Verdict.OVERLOAD, reason)], dropped=True, kind="exhausted")
        return Call([Outcome(Verdict.RETRY, reason)], dropped=False, kind=code.name.lower())


class Registration:
    """The `GET /consumers` handler: checks a consumer's request and hands the address on.

    `tokens` is read on every request, so a reloaded or revoked token counts at once.
    """

    def __init__(
        self,
        tokens: Callable[[], Iterable[str]],
        register: Callable[[str], Awaitable[None]],
        *,
        allow: Sequence[str] = DEFAULT_ALLOW,
        trust_forwarded_for: bool = False,
    ) -> None:
        self._tokens = tokens
        self._register = register
        self._allow = tuple(allow)
        self._trust_forwarded_for = trust_forwarded_for

    async def handle(self, request: web.Request) -> web.Response:
        token = request.headers.get("Authorization")
        if token is None:
            return web.Response(status=400, text="Missing Authorization header")
        # Header bytes that are not UTF-8 arrive as surrogates: compare the bytes as sent,
        # so such a token is refused (401) instead of failing the request (500).
        given = token.encode("utf-8", "surrogateescape")
        if not any(hmac.compare_digest(given, t.encode()) for t in self._tokens()):
            return web.Response(status=401, text="Malformed or invalid authorization token")
        port_text = request.headers.get("grpcport")
        if port_text is None:
            return web.Response(status=400, text="Missing gRPC port header")
        digits = port_text.strip()
        # ASCII digits only: str.isdigit() is true of other scripts' digits too ("٣" is 3).
        port = int(digits) if digits.isascii() and digits.isdigit() else 0
        if not 1 <= port <= 65535:
            return web.Response(status=400, text="gRPC port must be a number from 1 to 65535")
        host = request.remote or ""
        forwarded = request.headers.get("X-Forwarded-For")
        if self._trust_forwarded_for and forwarded:
            host = forwarded.split(",", 1)[0].strip()
        if not address_allowed(host, self._allow):
            return web.Response(status=403, text=f"Address {host} may not register")
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            await self._register(address)
        except ShuttingDown:
            return web.Response(status=503, text="The proxy is stopping; register again later")
        return web.Response(status=200, text="registered")
