"""A stream's outbox: the dispatcher's batches encoded into `Deliveries` frames, queued
for the stream handler (service.py) to write.

The dispatcher hands a session's outlet a batch of entries it has just marked held
(their `attempt` counts this delivery); `send` turns it into frames on the spot, so a
frame's attempts are the ones the window counted, and says which entries no frame to
this instance can carry (the dispatcher takes those back). The service also queues its
own frames here (Rejected), and `None` ends the stream.

Frames are filled up to FRAME_TARGET_BYTES (or the instance's limit when smaller),
counted in serialized bytes (encoding.py); a record alone may take a frame up to the
limit. To an instance that reads packed deliveries, records without headers and up to
PACKED_MAX_RECORD_BYTES go in the frame's packed columns (`fill_packed`), the rest as
repeated Delivery messages. A batch without headers that fits one frame even at the
largest size each delivery could take is encoded without sizing each one: with C-level
passes only when it packs whole (the common case for a current client).
"""

from __future__ import annotations

import asyncio
import operator
import sys
from array import array
from collections.abc import Sequence

from triage_protocol import triage_pb2 as pb
from triage_proxy.pipeline.dispatch.window import SIZE, Entry
from triage_proxy.server.encoding import (
    FRAME_TARGET_BYTES,
    PACKED_ITEM_BYTES,
    PACKED_MAX_RECORD_BYTES,
    PACKED_OVERHEAD_BYTES,
    PLAIN_ITEM_MAX_OVERHEAD_BYTES,
    attempt_size,
    delivery_base_size,
    fill_packed,
    frame_header_size,
    frame_room,
    frame_size,
    item_size,
)
from triage_proxy.structs import Record

_RECORD = operator.attrgetter("record")
_ATTEMPT = operator.attrgetter("attempt")
_HEADERS = operator.itemgetter(5)
_NONE: tuple[Entry, ...] = ()


class Outbox(asyncio.Queue["pb.ProxyFrame | None"]):
    """The frames waiting for one stream, and the encoder that makes its Deliveries."""

    def __init__(self, topic: str, partition: int, max_frame_bytes: int, packed: bool) -> None:
        super().__init__()
        self._topic = topic
        self._partition = partition
        self._limit = max_frame_bytes
        self._packed = packed
        """The instance reads Deliveries.packed (its Hello said so)."""
        self._header = frame_header_size(topic, partition)
        """Serialized bytes of the topic and partition every Deliveries frame carries."""
        self._room = frame_room(max_frame_bytes, self._header)
        self._target = frame_room(min(max_frame_bytes, FRAME_TARGET_BYTES), self._header)

    @property
    def max_frame_bytes(self) -> int:
        """Largest frame (serialized bytes) this instance receives; no frame exceeds it."""
        return self._limit

    def end(self) -> None:
        self.put_nowait(None)

    def fits(self, entry: Entry) -> bool:
        return self._item(entry) <= self._room

    def frame_needed(self, entry: Entry) -> int:
        return frame_size(self._header, self._item(entry))

    def _item(self, entry: Entry) -> int:
        """Bytes `entry`'s next delivery adds to a frame, as a repeated Delivery."""
        return item_size(delivery_base_size(entry.record) + attempt_size(entry.attempt + 1))

    def _frame(self) -> pb.ProxyFrame:
        frame = pb.ProxyFrame()
        deliveries = frame.deliveries
        deliveries.topic = self._topic
        deliveries.partition = self._partition
        return frame

    def send(self, entries: list[Entry]) -> tuple[int, Sequence[Entry]]:
        """Queue `entries` in frames; returns (frames queued, entries no frame carries)."""
        records = list(map(_RECORD, entries))
        if not any(map(_HEADERS, records)):
            size = sum(map(SIZE, entries))
            if self._packed:
                if (
                    max(map(SIZE, entries)) <= PACKED_MAX_RECORD_BYTES
                    and PACKED_OVERHEAD_BYTES + size + PACKED_ITEM_BYTES * len(entries)
                    <= self._target
                ):
                    frame = self._frame()
                    attempts = list(map(_ATTEMPT, entries))
                    retried = max(attempts) > 1
                    fill_packed(frame.deliveries.packed, records, attempts if retried else None)
                    self.put_nowait(frame)
                    return 1, _NONE
            elif size + PLAIN_ITEM_MAX_OVERHEAD_BYTES * len(entries) <= self._target:
                # One frame even at the largest size each delivery may take: no sizing.
                frame = self._frame()
                add = frame.deliveries.deliveries.add
                for entry, (_, _, offset, key, value, _, timestamp) in zip(
                    entries, records, strict=True
                ):
                    add(
                        offset=offset,
                        key=key,
                        value=value,
                        timestamp_ms=timestamp,
                        attempt=entry.attempt,
                    )
                self.put_nowait(frame)
                return 1, _NONE
        return self._send(entries)

    def send_isolated(self, entry: Entry) -> tuple[int, Sequence[Entry]]:
        """`send` one suspect alone in its frame, its offset in `Deliveries.isolated`."""
        frames, refused = self.send([entry])
        if frames:
            # asyncio.Queue keeps its items in `_queue`: the frame just put is the last.
            frame = self._queue[-1]  # type: ignore[attr-defined]
            frame.deliveries.isolated.append(entry.record.offset)
        return frames, refused

    def _send(self, entries: list[Entry]) -> tuple[int, Sequence[Entry]]:
        """`send` one record at a time: several frames, headers, large records."""
        room, target = self._room, self._target
        packing = self._packed
        # A packing session reserves the packed sub-message's framing in every frame.
        start = PACKED_OVERHEAD_BYTES if packing else 0
        frame: pb.ProxyFrame | None = None
        used = 0
        frames = 0
        packed: list[Record] = []
        attempts: list[int] = []
        retried = False  # a packed record of this frame is a redelivery: send attempts
        refused: list[Entry] = []
        add = None
        for entry in entries:
            attempt = entry.attempt
            record = entry.record
            _, _, offset, key, value, headers, timestamp = record
            pack = packing and not headers and entry.size <= PACKED_MAX_RECORD_BYTES
            if pack:
                item = entry.size + PACKED_ITEM_BYTES
            else:
                # item_size(delivery_base_size(record) + attempt_size(attempt)), inlined for
                # a record without headers: an attempt below 128 is a 2-byte field, and a
                # Delivery is never empty (it has its attempt).
                if headers:
                    d = delivery_base_size(record)
                else:
                    d = 0
                    if key is not None:
                        k = len(key)
                        d = 1 + (1 if k < 128 else (k.bit_length() + 6) // 7) + k
                    if value is not None:
                        v = len(value)
                        d += 1 + (1 if v < 128 else (v.bit_length() + 6) // 7) + v
                    if offset:
                        d += 11 if offset < 0 else 1 + (offset.bit_length() + 6) // 7
                    if timestamp:
                        d += 11 if timestamp < 0 else 1 + (timestamp.bit_length() + 6) // 7
                d += 2 if attempt < 128 else attempt_size(attempt)
                item = 1 + (d.bit_length() + 6) // 7 + d
            if frame is not None and used + item > target:
                if packed:
                    fill_packed(frame.deliveries.packed, packed, attempts if retried else None)
                    packed, attempts, retried = [], [], False
                self.put_nowait(frame)
                frames += 1
                frame = None
            if frame is None:
                if item > room:
                    refused.append(entry)
                    continue
                frame, used = self._frame(), start
                add = frame.deliveries.deliveries.add
            used += item
            if pack:
                packed.append(record)
                attempts.append(attempt)
                if attempt != 1:
                    retried = True
                continue
            assert add is not None
            # One add() with every field (None leaves an optional unset): as fast as
            # setting them one by one on protobuf's upb backend, and fewer bytecodes.
            delivery = add(
                offset=offset, key=key, value=value, timestamp_ms=timestamp, attempt=attempt
            )
            if headers:
                for name, data in headers:
                    delivery.headers.add(key=name, value=data)
        if frame is not None:
            if packed:
                fill_packed(frame.deliveries.packed, packed, attempts if retried else None)
            self.put_nowait(frame)
            frames += 1
        return frames, refused or _NONE

    def take_unsent(self) -> list[int]:
        """Empty the queue; return the offsets of the deliveries it still held (their
        frames never reached the wire)."""
        unsent: list[int] = []
        while not self.empty():
            frame = self.get_nowait()
            if frame is not None and frame.HasField("deliveries"):
                deliveries = frame.deliveries
                unsent.extend(d.offset for d in deliveries.deliveries)
                if deliveries.HasField("packed"):
                    offsets = array("q", deliveries.packed.offsets)
                    if sys.byteorder == "big":
                        offsets.byteswap()
                    unsent.extend(offsets)
        return unsent
