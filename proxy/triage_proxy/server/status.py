"""The gRPC status (and trailing metadata) a client sees for each of the proxy's errors.

Why here: the error tree (`errors.py`) is shared with code that never serves gRPC (the
CLI, the Spark executors), so it must not import grpc; the mapping to gRPC statuses is
the server's concern and lives with the service that ends calls through it. This is
the one place that maps an error to a status.
"""

from __future__ import annotations

import grpc

from triage_protocol.constants import OWNER_ENDPOINT_METADATA
from triage_proxy.errors import AuthError, FrameError, PartitionNotServed, UnavailableError


def grpc_status(exc: BaseException) -> grpc.StatusCode:
    """Map an error to the gRPC status a client sees; the one place that does."""
    if isinstance(exc, AuthError):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(exc, FrameError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, PartitionNotServed):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, UnavailableError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def grpc_trailers(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that goes with `grpc_status(exc)`; empty for most errors."""
    if isinstance(exc, PartitionNotServed) and exc.owner_endpoint:
        return ((OWNER_ENDPOINT_METADATA, exc.owner_endpoint),)
    return ()
