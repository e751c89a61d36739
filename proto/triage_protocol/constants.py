"""The protocol's numbers and names that code on both ends of a stream must agree on.

This module is the one source: the proxy and the Python client import it, and
`proto/generate.py` writes the TypeScript client's `src/generated/constants.ts` from it
(tests/unit/test_proto_fresh.py fails when that copy is stale). Why a Python module rather
than JSON or .proto options: the Python code imports it with real types and no file to
find at run time, mypy checks every use, and the generator reads the same objects (each
`Final` constant and its docstring) instead of parsing a second syntax.

It imports nothing, so the proxy's configuration and storage layers may use it without
loading grpc or protobuf. Only plain int, float and str values: the generator refuses
anything else. PROTOCOL.md cites these names.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "AUTHORIZATION_METADATA",
    "BEARER_PREFIX",
    "CLIENT_MAX_FRAME_BYTES",
    "DEFAULT_FRAME_BYTES",
    "HELLO_TIMEOUT_S",
    "MAX_CONSUMER_ID_CHARS",
    "MAX_CREDITS",
    "MAX_REASON_CHARS",
    "MAX_STARTED_OFFSETS",
    "MIN_FRAME_BYTES",
    "OWNER_ENDPOINT_METADATA",
    "UINT32_MAX",
]

AUTHORIZATION_METADATA: Final = "authorization"
"""Metadata key of every call's credentials (gRPC metadata keys are lower case)."""
BEARER_PREFIX: Final = "Bearer "
"""The credentials are this prefix and the deployment's token, in exactly this case and
spacing."""
OWNER_ENDPOINT_METADATA: Final = "triage-owner-endpoint"
"""Trailing metadata key of a FAILED_PRECONDITION Hello refusal: the host:port that serves
the partition now, when the refusing proxy knows it."""

HELLO_TIMEOUT_S: Final = 10.0
"""Seconds the proxy waits for a stream's first frame, the Hello, before it ends the
stream with INVALID_ARGUMENT."""
MAX_CONSUMER_ID_CHARS: Final = 2048
"""Longest Hello.consumer_id accepted (characters; all printable)."""
MAX_CREDITS: Final = 100_000
"""Most unsettled deliveries one stream may hold (Hello.credits, Grant.credits), and most
offsets one Settle may ack (acks and ack_ranges together)."""
MAX_STARTED_OFFSETS: Final = 1024
"""Most offsets one Started frame may name (a client sends one at a time); the proxy's
answer repeats them, so it stays far below any frame limit."""
UINT32_MAX: Final = 2**32 - 1
"""Largest value of a protobuf uint32 field (the credits a client is configured with in
total, before they are split over its streams, must fit one)."""
MAX_REASON_CHARS: Final = 4000
"""The proxy keeps this many characters (Unicode code points) of a Nack.reason; the
official clients cut a longer reason to this many, ending in "..."."""

DEFAULT_FRAME_BYTES: Final = 4 * 1024 * 1024
"""The frame limit of a stream whose Hello.max_frame_bytes is 0 or absent: most gRPC
stacks' default receive limit."""
MIN_FRAME_BYTES: Final = 64 * 1024
"""Smallest non-zero Hello.max_frame_bytes accepted: below it ordinary records (and
Rejected frames) would not fit, so a smaller value is refused with INVALID_ARGUMENT."""
CLIENT_MAX_FRAME_BYTES: Final = 64 * 1024 * 1024
"""The receive limit the official clients set on their channel and send as
Hello.max_frame_bytes: a record up to this size reaches the handler."""
