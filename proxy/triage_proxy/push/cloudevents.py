"""Kafka records as CloudEvents 1.0 over HTTP: binary mode (one record per POST) and the
JSON batch format (`application/cloudevents-batch+json`).

What a receiver gets, and how it recovers every byte of the record:

    attribute        binary mode          batch (JSON)     meaning
    id               ce-id                id               "<topic>/<partition>/<offset>"
    source           ce-source            source           the target's `source`
    type             ce-type              type             the target's `type`
    time             ce-time              time             record timestamp (RFC 3339)
    partitionkey     ce-partitionkey      partitionkey     the key as text, when UTF-8
    triagekey        ce-triagekey         triagekey        base64 of the key bytes
    triageheaders    ce-triageheaders     triageheaders    base64 of a JSON list
    triagetombstone  ce-triagetombstone   triagetombstone  "true" for a null value
    (data)           the body             data_base64      the record value, byte-exact

- The key: absent (no `triagekey`) means a null key; `triagekey` is the exact bytes,
  including an empty key ("") and keys that are not UTF-8. `partitionkey` (the Kafka
  protocol binding's attribute) is added for convenience when the key is UTF-8; in a
  header it is percent-encoded as the HTTP binding requires for non-printable text.
- The headers: `triageheaders` is base64 of the UTF-8 JSON `[[name, b64value|null], ...]`
  in broker order, so duplicate names, binary values and null values all survive. Absent
  when the record has no headers.
- The value: in binary mode the body is the value; an empty body is an empty value unless
  `triagetombstone` says the value was null. In a batch, `data_base64` is the value
  (absent for a null value, with `triagetombstone`).

The encoders are written for throughput (a batch of 500 is one string join) and take the
constant parts of every event (`EventShape`) once per target.
"""

from __future__ import annotations

import base64
import functools
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import quote

from triage_proxy.structs import Headers, Record

__all__ = [
    "BATCH_CONTENT_TYPE",
    "SPECVERSION",
    "EventShape",
    "batch_body",
    "batch_event",
    "batch_size",
    "binary_headers",
    "encode_headers",
    "event_id",
]

SPECVERSION = "1.0"
BATCH_CONTENT_TYPE = "application/cloudevents-batch+json"
DEFAULT_TYPE = "dev.triage.kafka.record"
"""`ce-type` unless a target names its own."""
DEFAULT_CONTENT_TYPE = "application/octet-stream"
"""`Content-Type` of a binary-mode body unless a target names its own."""

# Printable ASCII except space, '"' and '%' passes through a header unencoded (the HTTP
# binding's rule for string attributes); everything else is percent-encoded as UTF-8.
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"%')
_PLAIN = re.compile(r"[!#$&-~]*")
"""Text that needs no percent-encoding (the usual key): checked in C, not per character."""


def event_id(record: Record) -> str:
    """The event's id: unique per record of a topic, and what a batch response names."""
    return f"{record.topic}/{record.partition}/{record.offset}"


def encode_headers(headers: Headers) -> str:
    """`triageheaders`: base64 of the JSON list of [name, base64 value or null]."""
    rows = [
        [name, None if value is None else base64.b64encode(value).decode("ascii")]
        for name, value in headers
    ]
    return base64.b64encode(json.dumps(rows, separators=(",", ":")).encode()).decode("ascii")


@functools.lru_cache(maxsize=64)
def _second(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


def _rfc3339(timestamp_ms: int) -> str:
    seconds, ms = divmod(timestamp_ms, 1000)
    return f"{_second(seconds)}.{ms:03d}Z"  # records of one second share the formatting


def _key_text(key: bytes) -> str | None:
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return None


@dataclass(frozen=True)
class EventShape:
    """The attributes every event of one target shares."""

    source: str
    """`source`: a URI-reference naming where the events come from."""
    type: str = DEFAULT_TYPE
    """`type`: what kind of event this is, for the receiver's routing."""
    content_type: str = DEFAULT_CONTENT_TYPE
    """The value's media type: binary mode's Content-Type, a batch's datacontenttype."""
    _json_tail: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tail = (
            f',"source":{json.dumps(self.source)},"type":{json.dumps(self.type)}'
            f',"datacontenttype":{json.dumps(self.content_type)}'
        )
        object.__setattr__(self, "_json_tail", tail)


def binary_headers(record: Record, shape: EventShape) -> dict[str, str]:
    """The request headers of one record sent in binary mode (the body is its value)."""
    headers = {
        "content-type": shape.content_type,
        "ce-specversion": SPECVERSION,
        "ce-id": event_id(record),
        "ce-source": shape.source,
        "ce-type": shape.type,
    }
    if record.timestamp_ms >= 0:
        headers["ce-time"] = _rfc3339(record.timestamp_ms)
    key = record.key
    if key is not None:
        headers["ce-triagekey"] = base64.b64encode(key).decode("ascii")
        text = _key_text(key)
        if text is not None:
            plain = _PLAIN.fullmatch(text) is not None
            headers["ce-partitionkey"] = text if plain else quote(text, safe=_HEADER_SAFE)
    if record.headers:
        headers["ce-triageheaders"] = encode_headers(record.headers)
    if record.value is None:
        headers["ce-triagetombstone"] = "true"
    return headers


def batch_event(record: Record, shape: EventShape) -> bytes:
    """One record as a structured event of a batch (JSON, UTF-8)."""
    parts = [
        f'{{"specversion":"1.0","id":"{record.topic}/{record.partition}/{record.offset}"',
        shape._json_tail,
    ]
    if record.timestamp_ms >= 0:
        parts.append(f',"time":"{_rfc3339(record.timestamp_ms)}"')
    key = record.key
    if key is not None:
        parts.append(f',"triagekey":"{base64.b64encode(key).decode("ascii")}"')
        text = _key_text(key)
        if text is not None:
            parts.append(f',"partitionkey":{json.dumps(text)}')
    if record.headers:
        parts.append(f',"triageheaders":"{encode_headers(record.headers)}"')
    if record.value is None:
        parts.append(',"triagetombstone":"true"}')
    else:
        parts.append(f',"data_base64":"{base64.b64encode(record.value).decode("ascii")}"}}')
    return "".join(parts).encode()


def batch_body(events: Sequence[bytes]) -> bytes:
    """The body of a batched request: the encoded events as one JSON array."""
    return b"[" + b",".join(events) + b"]"


def batch_size(events: Sequence[bytes]) -> int:
    """The exact length of `batch_body(events)`, without building it."""
    return sum(map(len, events)) + max(len(events) - 1, 0) + 2
