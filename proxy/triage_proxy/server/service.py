"""The gRPC service: one bidirectional `Consume` stream per consumer instance and
partition, and the unary `Topology` call (which endpoint serves which partition now).

Authentication happens in an interceptor, before any handler runs, so a wrong
or missing token gets UNAUTHENTICATED and never a byte of data, on every method. Each
accepted stream gets a session of its partition's dispatcher and an outbox (outbox.py)
that encodes the deliveries the dispatcher hands it; a reader task applies its
settlements while the handler itself writes the outbox to the wire.

The service knows the set of partitions its process serves now (a dispatcher each; a
pipeline adds its partition once it delivers and withdraws it when it drains, see
partition.py). A Hello names its partition, or none: then the only one served (so a
client that predates partitions keeps working against a one-partition proxy). A Hello
without a partition at a process serving none or several is refused with
INVALID_ARGUMENT, naming the partitions served (such a client must name its partition:
ask Topology). A partition not served here is refused with FAILED_PRECONDITION, and the
trailing metadata `triage-owner-endpoint` names where it is served now, from the same
source as the Topology answer (topology.py), when that is known.

Tokens are named (one per consumer app). The service remembers which app each
stream belongs to (by name: a token is never logged), so `update_tokens` can
revoke one app's token and end only its streams, with UNAUTHENTICATED.
With `[tls]` the listener speaks TLS, and with `tls.client_ca_file` it also
requires a client certificate signed by that CA (mTLS).

An authenticated client is still not trusted with the proxy's logs or items: its Hello's
`consumer_id` is bounded and must be printable (clienttext.py), else the stream is
refused with INVALID_ARGUMENT; every log line shows it through `clienttext.for_log`.
Its `max_frame_bytes` (absent: 4 MiB) bounds every frame sent to it (server/encoding.py); the
Welcome says the limit applied. The Welcome also says `grants`: a Grant frame changes the
stream's credits from then on (bounded like Hello.credits; a Grant out of bounds ends the
stream with INVALID_ARGUMENT), and `ack_ranges`: a Settle may ack offset ranges, each
offset of a range checked (and Rejected) like a plain ack (server/grammar.py bounds them). A Hello
with `packed_deliveries` gets most deliveries as packed columns (encoding.fill_packed); a
Hello without it (a client that predates the field) gets repeated Delivery messages only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, NoReturn, TypeAlias

import grpc

from triage_protocol import triage_pb2 as pb
from triage_protocol import triage_pb2_grpc as pb_grpc
from triage_protocol.constants import HELLO_TIMEOUT_S, MAX_CREDITS
from triage_proxy.clienttext import consumer_id_problem, for_log
from triage_proxy.config.checks import bind_error, check_tls
from triage_proxy.config.files import read_regular_file
from triage_proxy.config.sections import TlsSettings
from triage_proxy.config.settings import Settings
from triage_proxy.errors import (
    AuthError,
    ConfigError,
    FrameError,
    PartitionNotServed,
    ShuttingDown,
    TriageError,
)
from triage_proxy.observe.logthrottle import LogThrottle
from triage_proxy.pipeline.dispatch import Dispatcher, Session
from triage_proxy.server.encoding import frame_limit, frame_limit_problem
from triage_proxy.server.grammar import checked_frames, topology_request
from triage_proxy.server.outbox import Outbox
from triage_proxy.server.status import grpc_status, grpc_trailers
from triage_proxy.server.topology import RouteState, Topology, TopologyAnswer

logger = logging.getLogger(__name__)

REJECTED_REASON = "offset not held by this instance"


_refusals = LogThrottle(logger)
"""Refused calls and streams: one line per cause per interval, with the caller's address
(a client retrying a wrong token thousands of times a second writes one line)."""


def refused(context: grpc.aio.ServicerContext[Any, Any], what: str, why: str) -> None:
    """Log a refused call or stream, rate-limited per cause (`why`), naming the peer."""
    _refusals.warning(why, "refused %s from %s: %s", what, context.peer(), why)


# Generic only in the type stubs, hence the string.
_Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"


async def _refuse(context: grpc.aio.ServicerContext[Any, Any], exc: TriageError) -> NoReturn:
    """End the call with the status `status.grpc_status` maps `exc` to, its message and
    the trailing metadata `status.grpc_trailers` gives it."""
    await context.abort(grpc_status(exc), str(exc), trailing_metadata=grpc_trailers(exc))


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose `authorization` metadata is not `Bearer <token>` for one
    of the active named tokens; `replace` swaps the set (a reload) for calls after it."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._expected: dict[str, bytes] = {}
        self.replace(tokens)

        async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            refused(context, "a call", "missing or wrong token")
            await _refuse(context, AuthError("missing or wrong token"))

        # One per kind of method, so a unary call is refused as a unary call.
        self._deny: dict[tuple[bool, bool], _Handler] = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(deny),
        }

    @property
    def expected(self) -> Mapping[str, bytes]:
        """name -> the `authorization` value that app presents."""
        return self._expected

    def replace(self, tokens: Mapping[str, str]) -> None:
        self._expected = {name: f"Bearer {token}".encode() for name, token in tokens.items()}

    def identify(self, metadata: Any) -> str | None:
        """The name of the app whose token `metadata` carries, or None."""
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                # Constant time, so the token cannot be guessed byte by byte; every
                # candidate is compared, so timing does not tell which name matched.
                found = None
                for name, expected in self._expected.items():
                    if hmac.compare_digest(given, expected) and found is None:
                        found = name
                return found
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> _Handler | None:
        if self.identify(details.invocation_metadata) is not None:
            return await continuation(details)
        handler = await continuation(details)  # only to learn the method's kind
        if handler is None:
            return self._deny[True, True]
        return self._deny[handler.request_streaming, handler.response_streaming]


class TriageService(pb_grpc.TriageServicer):
    """Streams deliveries to instances and feeds their settlements to the dispatcher of
    their partition; answers Topology calls."""

    def __init__(
        self, settings: Settings, dispatchers: Mapping[int, Dispatcher], topology: Topology
    ) -> None:
        self._settings = settings
        self._dispatchers = dict(dispatchers)
        """The partitions this process serves, each with its dispatcher."""
        self._topology = topology
        self._readers: set[asyncio.Task[None]] = set()
        self._accepting = True
        self.auth = TokenInterceptor(settings.auth.active())
        """Checks every call's token; the server runs it before any handler."""
        self._apps: dict[Session, str] = {}
        """Open streams -> the name of the app whose token opened them."""
        self._revoked: set[Session] = set()
        """Streams ended because their app's token was revoked (they end UNAUTHENTICATED)."""
        self._dispatcher_of: dict[Session, Dispatcher] = {}
        """Open streams -> the dispatcher of their partition."""
        self._coming: dict[int, asyncio.Event] = {}
        """Partitions starting here (`expect_partition`), set once they serve or withdraw."""
        self._broken: dict[Session, FrameError] = {}
        """Streams whose frames broke the protocol after Hello (they end INVALID_ARGUMENT)."""

    def expect_partition(self, partition: int) -> None:
        """`partition` is starting here (its lease is held, Kafka opening): a Hello for it
        waits until it serves, up to HELLO_TIMEOUT_S, rather than being refused. Why: a
        pinned process listens once its leases are held, and a client that connects at
        once (an old one treats an INVALID_ARGUMENT for a Hello without a partition as
        final) would otherwise be refused for the few moments the start takes."""
        self._coming.setdefault(partition, asyncio.Event())

    def serve_partition(self, partition: int, dispatcher: Dispatcher) -> None:
        """Route Hellos for `partition` to `dispatcher` from now on."""
        self._dispatchers[partition] = dispatcher
        if (arrived := self._coming.pop(partition, None)) is not None:
            arrived.set()

    def withdraw_partition(self, partition: int) -> None:
        """No new stream for `partition` (its streams open now go on until they end)."""
        self._dispatchers.pop(partition, None)
        if (gone := self._coming.pop(partition, None)) is not None:
            gone.set()  # whoever waits is refused now

    async def _await_coming(self, hello: pb.Hello) -> None:
        """Wait (bounded) for the partition a Hello asks for when it is starting here; a
        Hello without one waits for this process's only partition while none serves."""
        if hello.HasField("partition"):
            arrival = self._coming.get(hello.partition)
        elif not self._dispatchers and len(self._coming) == 1:
            arrival = next(iter(self._coming.values()))
        else:
            return
        if arrival is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arrival.wait(), HELLO_TIMEOUT_S)

    def stop_accepting(self) -> None:
        """New streams are refused with UNAVAILABLE from now on (shutdown)."""
        self._accepting = False

    def update_tokens(self, tokens: Mapping[str, str]) -> list[str]:
        """Accept exactly `tokens` (name -> token) from now on. Streams of an app whose
        token is gone or changed end with UNAUTHENTICATED; other apps' streams go on.
        Returns the names revoked."""
        old = dict(self.auth.expected)
        self.auth.replace(tokens)
        new = self.auth.expected
        gone = sorted(name for name, value in old.items() if new.get(name) != value)
        ended = [s for s, app in self._apps.items() if app in gone and s not in self._revoked]
        for session in ended:
            self._end_revoked(session)
        logger.info(
            "tokens reloaded: %d active (%s); revoked %s; ended %d streams",
            len(new),
            ", ".join(sorted(new)),
            ", ".join(gone) or "none",
            len(ended),
        )
        return gone

    def _end_revoked(self, session: Session) -> None:
        """End a revoked app's stream now: what is queued for it is not sent, and goes
        back to the queue without using an attempt."""
        self._revoked.add(session)
        self._dispatcher_of[session].end_session_now(session)

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
        try:
            if not self._accepting:
                raise ShuttingDown("proxy is shutting down")
            app = self.auth.identify(context.invocation_metadata())
            if app is None:  # revoked since the interceptor let it in
                raise AuthError("missing or wrong token")
            request_iterator = checked_frames(request_iterator)  # FrameError, not a traceback
            hello = await _hello(request_iterator)
            partition = await self._partition_for(hello)
            dispatcher = self._dispatchers[partition]
            consumer_id = hello.consumer_id or context.peer()
            delivery = self._settings.delivery
            max_frame = frame_limit(hello.max_frame_bytes, self._settings.server.max_frame_bytes)
            yield pb.ProxyFrame(
                welcome=pb.Welcome(
                    topic=self._settings.kafka.topic,
                    partition=partition,
                    ack_deadline_ms=int(delivery.ack_deadline_s * 1000),
                    max_attempts=delivery.max_attempts,
                    max_frame_bytes=max_frame,
                    grants=True,
                    ack_ranges=True,
                )
            )
            logger.info("instance %s authenticated as app %r", for_log(consumer_id), app)
            outbox = Outbox(
                self._settings.kafka.topic, partition, max_frame, hello.packed_deliveries
            )
            session = dispatcher.open_session(
                consumer_id, hello.credits, outbox, isolating=hello.isolation
            )
            self._apps[session] = app
            self._dispatcher_of[session] = dispatcher
            reader = asyncio.create_task(self._read(session, dispatcher, outbox, request_iterator))
            self._readers.add(reader)
            reader.add_done_callback(self._readers.discard)
            try:
                while True:
                    frame = await outbox.get()
                    if frame is None:
                        break
                    yield frame
                broken = self._broken.pop(session, None)
                if broken is not None:
                    raise broken
                if session in self._revoked:
                    logger.info(
                        "ended the stream of %s: app %r was revoked", for_log(consumer_id), app
                    )
                    raise AuthError("token revoked")
            finally:
                self._apps.pop(session, None)
                self._revoked.discard(session)
                self._broken.pop(session, None)
                self._dispatcher_of.pop(session, None)
                reader.cancel()
                dispatcher.close_session(session)
        except TriageError as exc:
            if isinstance(exc, FrameError | PartitionNotServed):  # no unescaped client text
                refused(context, "a stream", str(exc))
            await _refuse(context, exc)

    async def _partition_for(self, hello: pb.Hello) -> int:
        """The partition a Hello asks for, if this process serves it: absent means the
        only one served. FrameError for a malformed or missing one, PartitionNotServed
        (with its owner's endpoint when known) for one served elsewhere."""
        if self._coming:
            await self._await_coming(hello)
        served = sorted(self._dispatchers)
        if not hello.HasField("partition"):
            if len(served) != 1:
                raise FrameError(
                    "Hello must name a partition: this proxy serves "
                    f"{', '.join(map(str, served)) or 'no partition now'} "
                    "(only a proxy serving exactly one takes a Hello without one; ask Topology)"
                )
            return served[0]
        partition = hello.partition
        if partition < 0:
            raise FrameError(f"Hello.partition must be >= 0, got {partition}")
        if partition in self._dispatchers:
            return partition
        topic = self._settings.kafka.topic
        answer = await self._topology.answer()
        route = answer.route(partition)
        here = f"this proxy serves {', '.join(map(str, served)) or 'no partition now'}"
        if route is None:
            raise PartitionNotServed(
                f"partition {partition} of {topic} does not exist "
                f"(it has {answer.partition_count}); {here}",
                partition,
            )
        endpoint = route.endpoint if route.state is RouteState.SERVING else ""
        where = f"it is served at {endpoint}" if endpoint else "ask Topology again soon"
        raise PartitionNotServed(
            f"partition {partition} of {topic} is not served here ({here}); {where}",
            partition,
            endpoint,
        )

    async def Topology(
        self,
        request: pb.TopologyRequest | None,
        context: grpc.aio.ServicerContext[pb.TopologyRequest, pb.TopologyReply],
    ) -> pb.TopologyReply:
        try:
            if self.auth.identify(context.invocation_metadata()) is None:
                raise AuthError("missing or wrong token")  # revoked since the interceptor
            if request is None:  # grammar.topology_request: bytes that do not parse
                why = "the request is not a TopologyRequest (it does not parse)"
                refused(context, "a Topology call", why)
                raise FrameError(why)
            return topology_reply(await self._topology.answer())
        except TriageError as exc:
            await _refuse(context, exc)

    async def _read(
        self,
        session: Session,
        dispatcher: Dispatcher,
        outbox: Outbox,
        frames: AsyncIterator[pb.ConsumerFrame],
    ) -> None:
        """Apply the instance's settlements until it half-closes or the stream breaks."""
        try:
            async for frame in frames:
                kind = frame.WhichOneof("frame")
                if kind == "settle":
                    settle = frame.settle
                    rejected = dispatcher.settle(
                        session, settle.acks, settle.nacks, settle.ack_ranges
                    )
                elif kind == "release":
                    rejected = dispatcher.release(session, frame.release.offsets)
                elif kind == "grant":
                    dispatcher.grant(session, frame.grant.credits)  # bounded by checked_frames
                    continue
                elif kind == "started":
                    offsets = frame.started.offsets  # bounded by checked_frames
                    dispatcher.started(session, offsets)
                    # Answered only once recorded: the handler runs after this arrives.
                    outbox.put_nowait(pb.ProxyFrame(started=pb.Started(offsets=offsets)))
                    continue
                else:
                    if kind == "extend":
                        dispatcher.extend(session, frame.extend.offsets)
                    continue
                # Split so no frame exceeds the instance's limit (an offset is at most 10
                # bytes; a few hundred bytes of framing and reason to spare).
                chunk = (outbox.max_frame_bytes - 1024) // 10
                for at in range(0, len(rejected), chunk):
                    rejected_frame = pb.Rejected(
                        offsets=rejected[at : at + chunk], reason=REJECTED_REASON
                    )
                    outbox.put_nowait(pb.ProxyFrame(rejected=rejected_frame))
        except grpc.aio.AioRpcError as exc:
            logger.debug("stream of %s broke: %s", for_log(session.consumer_id), exc.code())
        except FrameError as exc:
            # Garbage or a second Hello after the first: the stream ends INVALID_ARGUMENT.
            self._broken[session] = exc
            dispatcher.end_session_now(session)
        except Exception:
            # A bug (in the dispatcher, say): nobody awaits this task, so say it here.
            logger.exception(
                "settlements of %s failed; ending its stream", for_log(session.consumer_id)
            )
        finally:
            # The instance closed its side or vanished: it will settle nothing more.
            dispatcher.close_session(session)


_STATES = {
    RouteState.SERVING: pb.PartitionRoute.SERVING,
    RouteState.STANDBY_ONLY: pb.PartitionRoute.STANDBY_ONLY,
    RouteState.NONE: pb.PartitionRoute.NONE,
}


def topology_reply(answer: TopologyAnswer) -> pb.TopologyReply:
    """The wire form of a Topology answer."""
    return pb.TopologyReply(
        topic=answer.topic,
        partition_count=answer.partition_count,
        partitions=[
            pb.PartitionRoute(
                partition=r.partition, endpoint=r.endpoint, state=_STATES[r.state], owner_id=r.owner
            )
            for r in answer.routes
        ],
        complete=answer.complete,
        problem=answer.problem,
    )


async def _hello(frames: AsyncIterator[pb.ConsumerFrame]) -> pb.Hello:
    """The stream's first frame, which must be a valid Hello (FrameError otherwise): credits
    in range, a consumer id within `clienttext`'s bounds, a frame limit `encoding` accepts."""
    try:
        first = await asyncio.wait_for(anext(frames), HELLO_TIMEOUT_S)
    except (TimeoutError, StopAsyncIteration):
        raise FrameError("expected a Hello frame") from None
    if first.WhichOneof("frame") != "hello":
        raise FrameError("first frame must be Hello")
    if not 1 <= first.hello.credits <= MAX_CREDITS:
        raise FrameError(f"credits must be 1..{MAX_CREDITS}")
    problem = consumer_id_problem(first.hello.consumer_id) or frame_limit_problem(
        first.hello.max_frame_bytes
    )
    if problem is not None:
        raise FrameError(problem)
    return first.hello


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials | None:
    """TLS credentials for the listener from `[tls]` (None: plaintext). Reads the PEM
    files now, so a missing, unreadable or non-PEM file is a ConfigError naming its key
    before anything else starts. mTLS when `client_ca_file` is set."""
    if tls.cert_file is None or tls.key_file is None:
        return None
    check_tls(tls)  # garbage, an encrypted key or a mismatch: named, not "Failed to bind"
    chain = _read_pem("tls.cert_file", tls.cert_file, b"CERTIFICATE")
    key = _read_pem("tls.key_file", tls.key_file, b"PRIVATE KEY")
    client_ca = None
    if tls.client_ca_file is not None:
        client_ca = _read_pem("tls.client_ca_file", tls.client_ca_file, b"CERTIFICATE")
    return grpc.ssl_server_credentials(
        [(key, chain)],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def _read_pem(key: str, path: str, label: bytes) -> bytes:
    """The file's bytes, if it holds a PEM block of `label`; the error never quotes it."""
    data = read_regular_file(key, path)  # a FIFO or a device: ConfigError, not a hang
    if b"-----BEGIN " not in data or label not in data:
        raise ConfigError(key, f"{path} is not a PEM file with a {label.decode()}")
    return data


def _register(service: TriageService, server: grpc.aio.Server) -> None:
    """What the generated `add_TriageServicer_to_server` does, but Topology's requests
    are read by `grammar.topology_request`, so garbage is refused, not an ERROR traceback."""
    handlers: dict[str, _Handler] = {
        "Consume": grpc.stream_stream_rpc_method_handler(
            service.Consume,
            request_deserializer=pb.ConsumerFrame.FromString,
            response_serializer=pb.ProxyFrame.SerializeToString,
        ),
        "Topology": grpc.unary_unary_rpc_method_handler(
            service.Topology,
            request_deserializer=topology_request,
            response_serializer=pb.TopologyReply.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


SERVICE = "triage.v1.Triage"

GRPC_CYTHON_LOGGER = "grpc._cython.cygrpc"


def keep_grpc_deallocation_log_off() -> None:
    """Keep gRPC's Cython logger at INFO or above (unless it is set higher already).

    Why: gRPC's aio server (grpcio 1.85) logs itself at DEBUG from its own deallocator when
    it was never started or never finished stopping, e.g. a server whose port was taken
    (`create_server` raises, the server is dropped). A handler that keeps log records (a
    test's log capture, a queue handler) then holds an object that has been freed, and
    the process segfaults when that record goes."""
    grpc_logger = logging.getLogger(GRPC_CYTHON_LOGGER)
    if grpc_logger.level < logging.INFO:  # NOTSET too: it would inherit the root's DEBUG
        grpc_logger.setLevel(logging.INFO)


def create_server(
    settings: Settings,
    partition: int,
    service: TriageService,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A gRPC server for `service` bound to the partition's address; returns (server, port).

    `credentials` (from `server_credentials`) makes the listener TLS; when not given they
    are read from `settings.tls` here."""
    limit = settings.server.max_frame_bytes
    keep_grpc_deallocation_log_off()
    server = grpc.aio.server(
        interceptors=[service.auth],
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ],
    )
    _register(service, server)
    if credentials is None:
        credentials = server_credentials(settings.tls)
    address = settings.listen_address(partition)
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # gRPC's "Failed to bind to address": the port, most often
        raise bind_error(address, exc) from exc
    if port == 0:
        raise bind_error(address, None)
    return server, port
