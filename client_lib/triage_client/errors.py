"""Errors the client raises, grouped by what the caller does next.

    TriageClientError            root; `retriable` says whether running again can help
    +-- StreamError              the proxy refused the stream for good (wrong endpoint, bad
    |   |                        Hello): fix the target or the settings (not retriable)
    |   +-- AuthenticationError  the proxy refused the token: fix the token (not retriable)
    +-- StateError               run() called twice on one Consumer (a bug)

Transient stream failures (the proxy restarting, the network) are never raised: the
consumer reconnects. `error_for_status` decides which gRPC status is which, in one place.

`Retry` is not an error the client raises: a handler raises it to ask for redelivery.
"""

from __future__ import annotations

import grpc

__all__ = [
    "AuthenticationError",
    "Retry",
    "StateError",
    "StreamError",
    "TriageClientError",
    "error_for_status",
]


class TriageClientError(Exception):
    """Root of every error the client raises on purpose."""

    retriable: bool = False


class StreamError(TriageClientError):
    """The proxy ended the stream with a status that reconnecting will not fix."""

    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        super().__init__(f"proxy refused the stream: {code.name}: {details or 'no details'}")
        self.code = code
        """The gRPC status the proxy ended the stream with."""
        self.details = details
        """The proxy's explanation, if it gave one."""


class AuthenticationError(StreamError):
    """The proxy refused the token (missing, wrong or not allowed)."""


class StateError(TriageClientError, RuntimeError):
    """A lifecycle method was called in a state that does not allow it."""


# Named as an instruction rather than FooError: `raise Retry("downstream busy")`.
class Retry(Exception):
    """Raise from a handler to nack with retry=True: redeliver after backoff, not dead-letter."""


_AUTH_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
# Statuses that mean "this stream can never work as configured". Everything else (UNAVAILABLE,
# CANCELLED, INTERNAL, ...) is treated as a proxy or network hiccup and retried with backoff:
# a long-running consumer should outlive a proxy restart or a transient proxy bug.
_FATAL_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED})


def error_for_status(code: grpc.StatusCode, details: str | None) -> StreamError | None:
    """The error to raise for a failed stream, or None when reconnecting may help."""
    if code in _AUTH_CODES:
        return AuthenticationError(code, details)
    if code in _FATAL_CODES:
        return StreamError(code, details)
    return None
