"""The settled-above-committed set, packed into a Kafka commit's metadata string; and the
failed-delivery counts of the window, packed for the checkpoint item.

Why: Kafka stores one committed offset per partition, but the proxy settles messages
out of order. Offsets already settled above the committed one would be redelivered
after a restart unless they ride along with the commit. The commit's metadata string
is the natural place (it is written atomically with the offset), but brokers cap it
(``offset.metadata.max.bytes``, 4096 by default), so the set must be compact, and it
is read back from the broker on startup, so decoding must distrust it.

Format (version ``t1``)::

    "t1:" + urlsafe_base64_nopad(zlib(varint(committed) + varint(gap) varint(len - 1) ...))

The set is split into maximal runs of consecutive offsets. A cursor starts at
``committed + 1``; each run ``[start, end]`` is stored as ``start - cursor`` and
``end - start`` as unsigned LEB128 varints, then the cursor moves to ``end + 2`` (runs
are maximal, so the next one starts there or later). Every byte sequence therefore
decodes to strictly increasing offsets, and the encoding of a set is unique.

``committed`` itself is inside the payload so that metadata paired with the wrong
offset (a commit made by other means, an old checkpoint) is refused rather than
trusted: trusting it would skip messages that were never settled. Decoding caps the
decompressed size and the number of offsets, so hostile metadata cannot exhaust memory.

Failed-delivery counts (version ``a1``), so a crash-type pill's attempts survive a
restart (written to the checkpoint item, see store/checkpoints.py)::

    "a1:" + urlsafe_base64_nopad(zlib(varint(committed) + varint(gap) varint(count - 1) ...))

for each offset at or above ``committed`` in increasing order, ``gap`` from a cursor
that starts at ``committed`` and moves to ``offset + 1``. At most MAX_ATTEMPT_ENTRIES
offsets are kept, the lowest ones (the head of the window is what holds the commit).

This module is pure logic: no I/O, no clock, no logging.
"""

from __future__ import annotations

import base64
import binascii
import heapq
import itertools
import re
import zlib
from collections.abc import Mapping, Sequence

from triage_proxy.errors import TriageError

__all__ = [
    "DEFAULT_LIMIT",
    "ITEM_LIMIT",
    "MAX_ATTEMPT_ENTRIES",
    "MAX_OFFSETS",
    "CheckpointError",
    "decode_attempts",
    "decode_settled",
    "encode_attempts",
    "encode_settled",
    "kafka_metadata",
]

DEFAULT_LIMIT = 4096
"""Broker default of ``offset.metadata.max.bytes``."""
ITEM_LIMIT = 256 * 1024
"""Most bytes of the encoding the checkpoint item holds (a DynamoDB item holds 400 KB):
a set fragmented by pills and suspects outgrows the broker's limit long before this."""


def kafka_metadata(text: str | None) -> str | None:
    """`text` if a commit may carry it as Kafka metadata (at most DEFAULT_LIMIT bytes),
    else None: the one place that decides what the broker is sent."""
    return text if text is not None and len(text) <= DEFAULT_LIMIT else None


MAX_OFFSETS = 10_000_000
"""Most offsets one checkpoint may hold; more is refused on both sides."""
MAX_PAYLOAD = 4 * 1024 * 1024
"""Most decompressed payload bytes; more is refused on both sides."""
MAX_OFFSET = (1 << 63) - 1
"""Kafka offsets are signed 64-bit."""
MAX_ATTEMPT_ENTRIES = 1000
"""Most offsets whose failed-delivery counts a checkpoint keeps (a few KB at most)."""
MAX_ATTEMPT_COUNT = (1 << 32) - 1
"""Largest count: delivery.max_attempts is a uint32."""

_VERSION = "t1:"
_ATTEMPTS_VERSION = "a1:"
_MAX_VARINT_BYTES = 10  # enough for 64 bits
_BODY = re.compile(r"[A-Za-z0-9_-]*")


class CheckpointError(TriageError):
    """Commit metadata that cannot be trusted: garbage, unknown version or another offset's.

    Not retriable: the caller ignores the metadata and redelivers (at-least-once).
    """


def encode_settled(
    committed: int, settled_above: Sequence[int], limit: int = DEFAULT_LIMIT
) -> str | None:
    """Pack the sorted offsets settled above ``committed``; None if it would exceed ``limit``.

    An empty set packs to "". None means the caller commits without metadata (plain
    at-least-once for those offsets).
    """
    _check_committed(committed)
    if not settled_above:
        return ""
    out = bytearray()
    _put_varint(out, committed)
    cursor = committed + 1
    start = prev = settled_above[0]
    if start < cursor:
        raise ValueError(f"offset {start} is not above committed {committed}")
    for offset in itertools.islice(settled_above, 1, None):
        if offset <= prev:
            raise ValueError(f"offsets are not strictly increasing: {prev} then {offset}")
        if offset != prev + 1:
            _put_varint(out, start - cursor)
            _put_varint(out, prev - start)
            cursor = prev + 2
            start = offset
        prev = offset
    if prev > MAX_OFFSET:
        raise ValueError(f"offset {prev} is beyond Kafka's offset range")
    _put_varint(out, start - cursor)
    _put_varint(out, prev - start)
    if len(settled_above) > MAX_OFFSETS or len(out) > MAX_PAYLOAD:
        return None
    packed = base64.urlsafe_b64encode(zlib.compress(out, 9)).rstrip(b"=")
    if len(_VERSION) + len(packed) > limit:
        return None
    return _VERSION + packed.decode("ascii")


def decode_settled(
    committed: int, text: str | None, *, max_offsets: int = MAX_OFFSETS
) -> list[int]:
    """Offsets settled above ``committed`` according to ``text``; [] for None or "".

    Raises CheckpointError for garbage, an unknown version, more than ``max_offsets``
    offsets, or a checkpoint written for a different committed offset.
    """
    _check_committed(committed)
    if not text:
        return []
    return _parse(committed, _unpack(text, _VERSION), max_offsets)


def encode_attempts(
    committed: int, failures: Mapping[int, int], max_entries: int = MAX_ATTEMPT_ENTRIES
) -> str:
    """Pack ``failures`` (offset -> failed deliveries) of the offsets at or above
    ``committed``, the lowest ``max_entries`` of them; "" when there are none.

    Offsets below ``committed`` (settled and committed meanwhile) and counts below 1 are
    left out; a count above MAX_ATTEMPT_COUNT is stored as MAX_ATTEMPT_COUNT.
    """
    _check_committed(committed)
    kept = heapq.nsmallest(
        max_entries, ((o, n) for o, n in failures.items() if o >= committed and n >= 1)
    )
    if not kept:
        return ""
    out = bytearray()
    _put_varint(out, committed)
    cursor = committed
    for offset, count in kept:
        if offset > MAX_OFFSET:
            raise ValueError(f"offset {offset} is beyond Kafka's offset range")
        _put_varint(out, offset - cursor)
        _put_varint(out, min(count, MAX_ATTEMPT_COUNT) - 1)
        cursor = offset + 1
    packed = base64.urlsafe_b64encode(zlib.compress(out, 9)).rstrip(b"=")
    return _ATTEMPTS_VERSION + packed.decode("ascii")


def decode_attempts(
    committed: int, text: str | None, *, max_entries: int = MAX_ATTEMPT_ENTRIES
) -> dict[int, int]:
    """Failed-delivery counts by offset according to ``text``; {} for None or "" (an item
    written before the counts existed).

    Raises CheckpointError for garbage, an unknown version, more than ``max_entries``
    offsets, or counts packed for a different committed offset.
    """
    _check_committed(committed)
    if not text:
        return {}
    payload = _unpack(text, _ATTEMPTS_VERSION)
    pos, embedded = _get_varint(payload, 0)
    if embedded != committed:
        raise CheckpointError(
            f"attempts were written for committed offset {embedded}, not {committed}"
        )
    out: dict[int, int] = {}
    cursor = committed
    end = len(payload)
    while pos < end:
        pos, gap = _get_varint(payload, pos)
        if pos >= end:
            raise CheckpointError("attempts end inside an entry")
        pos, count = _get_varint(payload, pos)
        offset = cursor + gap
        if offset > MAX_OFFSET:
            raise CheckpointError("attempts offset beyond Kafka's offset range")
        if count >= MAX_ATTEMPT_COUNT:
            raise CheckpointError("attempts count beyond a uint32")
        if len(out) >= max_entries:
            raise CheckpointError(f"attempts hold more than {max_entries} offsets")
        out[offset] = count + 1
        cursor = offset + 1
    if not out:
        raise CheckpointError("attempts hold no offsets")
    return out


def _unpack(text: str, expected: str) -> bytes:
    """The payload of ``text`` (version ``expected``): base64 checked, then inflated."""
    version, sep, body = text.partition(":")
    if not sep or not version.isascii() or not version.isalnum():
        raise CheckpointError("commit metadata is not a checkpoint")
    if version + sep != expected:
        raise CheckpointError(f"unsupported checkpoint version {version!r}")
    if not _BODY.fullmatch(body) or len(body) % 4 == 1:
        raise CheckpointError("checkpoint is not valid base64")
    try:
        compressed = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except binascii.Error as exc:
        raise CheckpointError("checkpoint is not valid base64") from exc
    return _inflate(compressed)


def _inflate(compressed: bytes) -> bytes:
    """Decompress at most MAX_PAYLOAD bytes; the stream must end exactly."""
    inflater = zlib.decompressobj()
    try:
        payload = inflater.decompress(compressed, MAX_PAYLOAD + 1)
    except zlib.error as exc:
        raise CheckpointError("checkpoint is corrupt") from exc
    if len(payload) > MAX_PAYLOAD:
        raise CheckpointError(f"checkpoint inflates beyond {MAX_PAYLOAD} bytes")
    if not inflater.eof or inflater.unused_data:
        raise CheckpointError("checkpoint is truncated or has trailing bytes")
    return payload


def _parse(committed: int, payload: bytes, max_offsets: int) -> list[int]:
    pos, embedded = _get_varint(payload, 0)
    if embedded != committed:
        raise CheckpointError(
            f"checkpoint was written for committed offset {embedded}, not {committed}"
        )
    out: list[int] = []
    cursor = committed + 1
    end = len(payload)
    while pos < end:
        pos, gap = _get_varint(payload, pos)
        if pos >= end:
            raise CheckpointError("checkpoint ends inside a run")
        pos, length = _get_varint(payload, pos)
        start = cursor + gap
        stop = start + length + 1
        if stop - 1 > MAX_OFFSET:
            raise CheckpointError("checkpoint offset beyond Kafka's offset range")
        if len(out) + length + 1 > max_offsets:
            raise CheckpointError(f"checkpoint holds more than {max_offsets} offsets")
        out.extend(range(start, stop))
        cursor = stop + 1
    if not out:
        raise CheckpointError("checkpoint holds no offsets")
    return out


def _check_committed(committed: int) -> None:
    if not 0 <= committed <= MAX_OFFSET:
        raise ValueError(f"committed offset must be in 0..2**63-1, got {committed}")


def _put_varint(out: bytearray, value: int) -> None:
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _get_varint(data: bytes, pos: int) -> tuple[int, int]:
    """Read an unsigned LEB128 varint at ``pos``; returns (next position, value)."""
    value = 0
    for shift in range(0, 7 * _MAX_VARINT_BYTES, 7):
        if pos >= len(data):
            raise CheckpointError("checkpoint ends inside a number")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return pos, value
    raise CheckpointError("checkpoint number is too long")
