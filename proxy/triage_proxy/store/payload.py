"""The S3 object that holds a large dead letter's key, value and headers.

Why a module of its own: the byte format is a contract between the proxy that writes
the object and every tool that reads it back (`triage dlq`, the Spark job), possibly
years apart, so it lives in one place, versioned by its magic, with no I/O. Which item
points to which object is `items.pointer_item`; writing and reading the objects is the
stores' (`deadletters.py`, `query.py`).
"""

from __future__ import annotations

import struct
from urllib.parse import urlsplit

from triage_proxy.structs import Headers, Record

PAYLOAD_MAGIC = b"TDL\x01"
"""First bytes of every S3 payload object (format version 1)."""
S3_SETTLED_TAG = ("triage-status", "settled")
"""Tag put on the S3 payload of a replayed/discarded item; a lifecycle rule expires them."""
S3_LIFECYCLE_RULE_ID = "triage-expire-settled-payloads"
"""The bucket lifecycle rule that expires settled payloads (`provisioning.create_bucket`)."""


def payload_object_key(table: str, topic: str, partition: int, offset: int, group: str) -> str:
    """S3 key of a dead letter's payload: `<table>/<topic>/<partition>/<offset>/<group>`.

    The table name leads so that several tables (environments) can share one bucket. The
    group (the deployment) comes last, after fields that cannot hold a `/` (table and
    topic names cannot), so it may hold anything and two deployments never share an
    object. Objects written before deployment keys are `<table>/<topic>/<partition>/
    <offset>`; their items point to them by URL (`payload_s3`), so they never move.
    """
    return f"{table}/{topic}/{partition}/{offset}/{group}"


def encode_payload(record: Record) -> bytes:
    """Key, value and headers of `record` as one byte string (the S3 object).

    Format 1, all integers big-endian: `PAYLOAD_MAGIC`; key as i64 length (-1 for null)
    and bytes; value likewise; u32 header count; per header u32 name length, UTF-8 name,
    i64 value length (-1 for null) and bytes.
    """
    parts = [PAYLOAD_MAGIC, *_blob(record.key), *_blob(record.value)]
    parts.append(struct.pack(">I", len(record.headers)))
    for name, value in record.headers:
        raw = name.encode()
        parts.extend((struct.pack(">I", len(raw)), raw, *_blob(value)))
    return b"".join(parts)


def payload_size(record: Record) -> int:
    """len(encode_payload(record)) without building it."""
    size = len(PAYLOAD_MAGIC) + 8 + len(record.key or b"") + 8 + len(record.value or b"") + 4
    for name, value in record.headers:
        size += 4 + len(name.encode()) + 8 + len(value or b"")
    return size


def decode_payload(data: bytes) -> tuple[bytes | None, bytes | None, Headers]:
    """Inverse of encode_payload: (key, value, headers); ValueError if malformed."""
    if not data.startswith(PAYLOAD_MAGIC):
        raise ValueError("not a Triage dead-letter payload (bad magic)")
    view = memoryview(data)
    pos = len(PAYLOAD_MAGIC)

    def take(n: int) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise ValueError("truncated dead-letter payload")
        chunk = bytes(view[pos : pos + n])
        pos += n
        return chunk

    def blob() -> bytes | None:
        (length,) = struct.unpack(">q", take(8))
        return None if length == -1 else take(length)

    key = blob()
    value = blob()
    (count,) = struct.unpack(">I", take(4))
    headers: list[tuple[str, bytes | None]] = []
    for _ in range(count):
        (length,) = struct.unpack(">I", take(4))
        headers.append((take(length).decode(), blob()))
    if pos != len(data):
        raise ValueError("trailing bytes after the dead-letter payload")
    return key, value, tuple(headers)


def _blob(data: bytes | None) -> tuple[bytes, ...]:
    if data is None:
        return (struct.pack(">q", -1),)
    return (struct.pack(">q", len(data)), data)


def parse_s3_url(url: str) -> tuple[str, str]:
    """("bucket", "key") of "s3://bucket/key"; ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or len(parts.path) < 2:
        raise ValueError(f"not an s3://bucket/key URL: {url!r}")
    return parts.netloc, parts.path[1:]
