"""The gRPC service: one bidirectional `Consume` stream per consumer instance.

Authentication happens in an interceptor, before any handler runs, so a wrong
or missing token gets UNAUTHENTICATED and never a byte of data. Each accepted
stream gets a dispatcher session; a reader task applies its settlements while
the handler itself writes the session's outbox to the wire.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeAlias

import grpc

from triage_client._proto import triage_pb2 as pb
from triage_client._proto import triage_pb2_grpc as pb_grpc
from triage_proxy.dispatcher import Dispatcher, Session
from triage_proxy.settings import Settings

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
MAX_CREDITS = 100_000


# Generic only in the type stubs, hence the string.
_Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose `authorization` metadata is not `Bearer <token>` for one
    of the active named tokens."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._expected = [f"Bearer {token}".encode() for token in tokens.values()]

        async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

        self._deny: _Handler = grpc.stream_stream_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> _Handler | None:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                # Constant time, so the token cannot be guessed byte by byte; every
                # candidate is compared, so timing does not tell which name matched.
                matched = False
                for expected in self._expected:
                    matched |= hmac.compare_digest(given, expected)
                if matched:
                    return await continuation(details)
                break
        logger.warning("refused a call to %s: missing or wrong token", details.method)
        return self._deny


class TriageService(pb_grpc.TriageServicer):
    """Streams deliveries to instances and feeds their settlements to the dispatcher."""

    def __init__(self, settings: Settings, partition: int, dispatcher: Dispatcher) -> None:
        self._settings = settings
        self._partition = partition
        self._dispatcher = dispatcher
        self._readers: set[asyncio.Task[None]] = set()
        self._accepting = True

    def stop_accepting(self) -> None:
        """New streams are refused with UNAVAILABLE from now on (shutdown)."""
        self._accepting = False

    async def stop(self) -> None:
        """Cancel and await the per-stream reader tasks that are left."""
        for task in list(self._readers):
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)

    async def Consume(
        self,
        request_iterator: AsyncIterator[pb.ConsumerFrame],
        context: grpc.aio.ServicerContext[pb.ConsumerFrame, pb.ProxyFrame],
    ) -> AsyncIterator[pb.ProxyFrame]:
        if not self._accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "proxy is shutting down")
        try:
            first = await asyncio.wait_for(anext(request_iterator), HELLO_TIMEOUT_S)
        except (TimeoutError, StopAsyncIteration):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "expected a Hello frame")
        if first.WhichOneof("frame") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first frame must be Hello")
        hello = first.hello
        if not 1 <= hello.credits <= MAX_CREDITS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"credits must be 1..{MAX_CREDITS}"
            )
        consumer_id = hello.consumer_id or context.peer()
        delivery = self._settings.delivery
        yield pb.ProxyFrame(
            welcome=pb.Welcome(
                topic=self._settings.kafka.topic,
                partition=self._partition,
                ack_deadline_ms=int(delivery.ack_deadline_s * 1000),
                max_attempts=delivery.max_attempts,
            )
        )
        session = self._dispatcher.open_session(consumer_id, hello.credits)
        reader = asyncio.create_task(self._read(session, request_iterator))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        try:
            outbox = session.outbox
            while True:
                frame = await outbox.get()
                if frame is None:
                    break
                yield frame
        finally:
            reader.cancel()
            self._dispatcher.close_session(session)

    async def _read(self, session: Session, frames: AsyncIterator[pb.ConsumerFrame]) -> None:
        """Apply the instance's settlements until it half-closes or the stream breaks."""
        dispatcher = self._dispatcher
        try:
            async for frame in frames:
                kind = frame.WhichOneof("frame")
                if kind == "settle":
                    rejected = dispatcher.settle(session, frame.settle.acks, frame.settle.nacks)
                    if rejected:
                        session.outbox.put_nowait(
                            pb.ProxyFrame(
                                rejected=pb.Rejected(
                                    offsets=rejected, reason="offset not held by this instance"
                                )
                            )
                        )
                elif kind == "release":
                    rejected = dispatcher.release(session, frame.release.offsets)
                    if rejected:
                        session.outbox.put_nowait(
                            pb.ProxyFrame(
                                rejected=pb.Rejected(
                                    offsets=rejected, reason="offset not held by this instance"
                                )
                            )
                        )
                elif kind == "extend":
                    dispatcher.extend(session, frame.extend.offsets)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            logger.debug("stream of %s broke: %s", session.consumer_id, exc.code())
        finally:
            # The instance closed its side or vanished: it will settle nothing more.
            dispatcher.close_session(session)


def create_server(
    settings: Settings, partition: int, service: TriageService
) -> tuple[grpc.aio.Server, int]:
    """A gRPC server for `service` bound to the partition's address; returns (server, port)."""
    limit = settings.server.max_frame_bytes
    server = grpc.aio.server(
        interceptors=[TokenInterceptor(settings.auth.active())],
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_TriageServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port(settings.listen_address(partition))
    if port == 0:
        raise OSError(f"cannot listen on {settings.listen_address(partition)}")
    return server, port
