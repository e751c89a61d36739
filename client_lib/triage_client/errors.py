"""Errors the client raises, grouped by what the caller does next.

    TriageClientError            root; `retriable` says whether running again can help
    +-- StreamError              the proxy refused the stream for good (bad Hello): fix the
    |   |                        settings (not retriable)
    |   +-- AuthenticationError  the proxy refused the token: fix the token (not retriable)
    |   +-- EndpointError        the endpoint is not a Triage proxy (not gRPC at all, or a gRPC
    |                            server without Triage's service): fix the endpoint
    +-- PartitionError           `partitions=[...]` names a partition the topic lacks: fix the
    |                            list (also a ValueError; not retriable)
    +-- StateError               run() called twice on one Consumer (a bug)

Transient failures (a proxy restarting, a partition failing over, the network) are never
raised: the consumer reconnects. `error_for_status` and `speaks_grpc` decide which gRPC
outcome is which, in one place.

`Retry` is not an error the client raises: a handler raises it to ask for redelivery.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc

__all__ = [
    "AuthenticationError",
    "EndpointError",
    "PartitionError",
    "Retry",
    "StateError",
    "StreamError",
    "TriageClientError",
    "error_for_status",
    "speaks_grpc",
]


class TriageClientError(Exception):
    """Root of every error the client raises on purpose."""

    retriable: bool = False


class StreamError(TriageClientError):
    """The proxy ended the stream with a status that reconnecting will not fix."""

    def __init__(
        self, code: grpc.StatusCode, details: str | None, message: str | None = None
    ) -> None:
        super().__init__(
            message or f"proxy refused the stream: {code.name}: {details or 'no details'}"
        )
        self.code = code
        """The gRPC status the proxy ended the stream with."""
        self.details = details
        """The proxy's explanation, if it gave one."""


class AuthenticationError(StreamError):
    """The proxy refused the token (missing, wrong or not allowed)."""


class EndpointError(StreamError):
    """The endpoint the Consumer was given is not a Triage proxy."""

    def __init__(self, endpoint: str, code: grpc.StatusCode, details: str | None, why: str) -> None:
        super().__init__(
            code,
            details,
            f"{endpoint} is not a Triage proxy: {why} ({code.name}: {details or 'no details'})",
        )
        self.endpoint = endpoint
        """The endpoint as the Consumer was given it."""


class PartitionError(TriageClientError, ValueError):
    """`partitions=[...]` names partitions this deployment's topic does not have."""

    def __init__(self, missing: Iterable[int], message: str) -> None:
        super().__init__(message)
        self.missing = sorted(missing)
        """The partitions asked for that the topic lacks."""


class StateError(TriageClientError, RuntimeError):
    """A lifecycle method was called in a state that does not allow it."""


# Named as an instruction rather than FooError: `raise Retry("downstream busy")`.
class Retry(Exception):
    """Raise from a handler to nack with retry=True: redeliver after backoff, not dead-letter."""


_AUTH_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
# Statuses that mean "this stream can never work as configured". Everything else (UNAVAILABLE,
# CANCELLED, INTERNAL, FAILED_PRECONDITION ...) is treated as a proxy or network hiccup, or a
# partition that moved, and retried: a long-running consumer should outlive a proxy restart,
# a failover or a transient proxy bug.
_FATAL_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT})
# gRPC's own words when the peer answered, but not in HTTP/2 (an HTTP/1 server such as the
# proxy's metrics port, a database, ...) or with a plain HTTP/2 error page instead of gRPC.
_NOT_GRPC = ("Failed parsing HTTP/2", "http1.x server", "Received http2 header with status")


def speaks_grpc(details: str | None) -> bool:
    """False when a failed call's details show that the peer is not a gRPC server at all."""
    return not any(words in (details or "") for words in _NOT_GRPC)


def error_for_status(
    code: grpc.StatusCode, details: str | None, endpoint: str = "the endpoint"
) -> StreamError | None:
    """The error to raise for a failed stream, or None when reconnecting may help."""
    if code in _AUTH_CODES:
        return AuthenticationError(code, details)
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return EndpointError(endpoint, code, details, "it does not serve Triage's Consume")
    if code in _FATAL_CODES:
        return StreamError(code, details)
    return None
