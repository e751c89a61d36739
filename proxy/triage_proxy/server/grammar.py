"""A consumer's frames read distrustfully: what does not parse, or breaks the stream's
grammar, is a `FrameError` (INVALID_ARGUMENT), never an ERROR traceback or a stream
that ends OK.

The grammar of one `Consume` stream from the consumer's side: exactly one Hello, first,
then any number of other frames. The service reads every frame through `checked_frames`,
so both places that read (the Hello, then the settlement reader) see the same rules:

- bytes that are not a `ConsumerFrame` (protobuf's DecodeError, raised by gRPC's
  deserializer while the service iterates) -> FrameError naming the frame's position;
- a second Hello -> FrameError (it would silently be ignored: its credits and its
  partition would never apply);
- a Grant whose credits are outside the bounds of Hello.credits -> FrameError;
- a Settle with an ack range that is empty or negative, or settling more than MAX_CREDITS
  offsets in all (acks, ranges and nacks together), an Extend or Release naming more
  than MAX_CREDITS offsets, or a Started naming more than MAX_STARTED_OFFSETS (its answer
  repeats them) -> FrameError. No stream ever holds more, and each offset is
  looked up and possibly Rejected one by one: a longer list is a broken or hostile client,
  and 2,000,000 acks would hold the event loop for seconds.

A Topology request is one message, read by `topology_request`: bytes that do not parse
become None, which the service refuses with INVALID_ARGUMENT (gRPC itself would end the
call UNKNOWN and log an ERROR traceback for each one).

Why a wrapper for the stream and not a custom deserializer: a deserializer sees one
message and cannot know its position (a second Hello), and a wrapper keeps the
translation of protobuf's error in this one module for both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from google.protobuf.message import DecodeError

from triage_protocol import triage_pb2 as pb
from triage_protocol.constants import MAX_CREDITS, MAX_STARTED_OFFSETS
from triage_proxy.errors import FrameError


async def checked_frames(
    frames: AsyncIterator[pb.ConsumerFrame],
) -> AsyncIterator[pb.ConsumerFrame]:
    """`frames`, each checked against the stream's grammar (see the module docstring)."""
    seen = 0
    while True:
        try:
            frame = await anext(frames)
        except StopAsyncIteration:
            return
        except DecodeError:
            raise FrameError(
                f"frame {seen + 1} of the stream is not a ConsumerFrame (it does not parse)"
            ) from None
        seen += 1
        kind = frame.WhichOneof("frame")
        if seen > 1 and kind == "hello":
            raise FrameError(f"frame {seen} is a second Hello: a stream has exactly one, first")
        if kind == "grant" and not 1 <= frame.grant.credits <= MAX_CREDITS:
            raise FrameError(f"Grant.credits must be 1..{MAX_CREDITS}, got {frame.grant.credits}")
        problem = None
        if kind == "settle":
            problem = settle_problem(frame.settle)
        elif kind in ("extend", "release"):
            problem = offsets_problem(kind.capitalize(), len(getattr(frame, kind).offsets))
        elif kind == "started" and len(frame.started.offsets) > MAX_STARTED_OFFSETS:
            problem = (
                f"a Started names at most {MAX_STARTED_OFFSETS} offsets (MAX_STARTED_OFFSETS), "
                f"got {len(frame.started.offsets)}: a client starts one isolated delivery at a time"
            )
        if problem is not None:
            raise FrameError(f"frame {seen}: {problem}")
        yield frame


def settle_problem(settle: pb.Settle) -> str | None:
    """Why a Settle breaks the grammar (see the module docstring), or None."""
    total = len(settle.acks) + len(settle.nacks)
    for r in settle.ack_ranges:
        if r.first < 0 or r.last < r.first:
            return f"Settle.ack_ranges needs 0 <= first <= last, got {r.first}..{r.last}"
        total += r.last - r.first + 1
        if total > MAX_CREDITS:
            break
    if total > MAX_CREDITS:
        return (
            f"a Settle settles at most {MAX_CREDITS} offsets (MAX_CREDITS; acks, ack_ranges "
            "and nacks together): send them in several Settles"
        )
    return None


def offsets_problem(kind: str, count: int) -> str | None:
    """Why an Extend or Release of `count` offsets breaks the grammar, or None."""
    if count <= MAX_CREDITS:
        return None
    return (
        f"{'an' if kind == 'Extend' else 'a'} {kind} names at most {MAX_CREDITS} offsets "
        f"(MAX_CREDITS, the most a stream holds), got {count}: send them in several"
    )


def topology_request(data: bytes) -> pb.TopologyRequest | None:
    """The TopologyRequest in `data`, or None when it does not parse (see the module
    docstring): the deserializer the service registers for Topology."""
    try:
        return pb.TopologyRequest.FromString(data)
    except DecodeError:
        return None
