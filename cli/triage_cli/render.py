"""Dead letters rendered for people: bytes that never crash a terminal or drive it.

Why in the CLI: only commands print dead letters (`triage dlq list/show`); the table
package holds bytes, this module decides how a person sees them. `render_bytes` shows
UTF-8 text as is, JSON objects and arrays pretty-printed, other bytes as a hex dump
(base64 above `HEX_DUMP_LIMIT`), and escapes every control character (`safe_text`).
"""

from __future__ import annotations

import base64
import binascii
import json
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from triage_proxy.store.items import (
    CLAIM_ATTR,
    EXPIRES_AT_ATTR,
    PAYLOAD_BYTES_ATTR,
    PAYLOAD_S3_ATTR,
)

HEX_DUMP_LIMIT = 4096
"""Binary payloads up to this size render as a hex dump, larger ones as base64."""


@dataclass(frozen=True)
class Rendering:
    """Bytes made safe to print."""

    kind: str
    """`null`, `empty`, `json`, `text`, `hex` or `base64`."""
    text: str
    """What to print: no control characters but newlines and tabs."""


def render_bytes(data: bytes | None, *, hex_limit: int = HEX_DUMP_LIMIT) -> Rendering:
    """UTF-8 text if it decodes cleanly (JSON objects and arrays pretty-printed), else a
    hex dump up to `hex_limit` bytes, else base64. Never raises."""
    if data is None:
        return Rendering("null", "(null)")
    if not data:
        return Rendering("empty", "(empty)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and not any(
        unicodedata.category(c) == "Cc" and c not in "\t\n\r" for c in text
    ):
        pretty = _pretty_json(text)
        if pretty is not None:
            return Rendering("json", safe_text(pretty))
        return Rendering("text", safe_text(text))
    if len(data) <= hex_limit:
        return Rendering("hex", hex_dump(data))
    return Rendering("base64", base64.b64encode(data).decode("ascii"))


def _pretty_json(text: str) -> str | None:
    stripped = text.strip()
    if not stripped or stripped[0] not in "{[":
        return None

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate key")  # pretty-printing would drop one
        return dict(pairs)

    try:
        parsed = json.loads(stripped, object_pairs_hook=no_duplicates)
    except (ValueError, RecursionError):
        return None
    return json.dumps(parsed, indent=2, ensure_ascii=False)


def safe_text(text: str) -> str:
    """`text` with every control or format character but newline and tab escaped
    (\\r, \\x1b, \\u202e ...), so printing it cannot drive the terminal."""
    out: list[str] = []
    for c in text:
        if c in "\n\t" or unicodedata.category(c) not in ("Cc", "Cf", "Cs", "Zl", "Zp"):
            out.append(c)
        elif c == "\r":
            out.append("\\r")
        elif ord(c) <= 0xFF:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(f"\\u{ord(c):04x}")
    return "".join(out)


def one_line(text: str) -> str:
    """`text` on one line: `safe_text`, and newline and tab escaped too (\\n, \\t), so a
    reason or a name that holds them stays one visible line in a table or a field."""
    return safe_text(text).replace("\n", "\\n").replace("\t", "\\t")


def hex_dump(data: bytes, width: int = 16) -> str:
    """`xxd`-style lines: offset, hex bytes, printable ASCII (others as '.')."""
    lines = []
    for start in range(0, len(data), width):
        chunk = data[start : start + width]
        hexes = " ".join(f"{b:02x}" for b in chunk)
        ascii_ = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in chunk)
        lines.append(f"{start:08x}  {hexes:<{width * 3 - 1}}  {ascii_}")
    return "\n".join(lines)


def short_text(data: bytes | None, limit: int = 32) -> str:
    """A one-line rendering of a key for tables, cut to `limit` characters."""
    shown = render_bytes(data, hex_limit=0)
    if shown.kind == "base64":  # binary: show hex, it reads better in a column
        assert data is not None
        text = binascii.hexlify(data[: limit // 2]).decode() + (
            "…" if len(data) > limit // 2 else ""
        )
        return f"0x{text}"
    one_line = shown.text.replace("\n", "\\n").replace("\t", "\\t")
    return one_line if len(one_line) <= limit else one_line[: limit - 1] + "…"


def item_summary(item: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON-ready dict of an item's metadata (no value or headers): what
    `triage dlq list --json` prints per line and what an export can keep."""

    def s(name: str) -> str | None:
        attr = item.get(name)
        return None if attr is None else str(attr["S"])

    def n(name: str) -> int | None:
        attr = item.get(name)
        return None if attr is None else int(attr["N"])

    key = item.get("key")
    return {
        "topic": s("topic"),
        "partition": n("partition"),
        "offset": n("offset"),
        "status": s("status"),
        "reason": s("reason"),
        "attempts": n("attempts"),
        "consumer_id": s("consumer_id"),
        "dead_lettered_at": s("dead_lettered_at"),
        "timestamp_ms": n("timestamp_ms"),
        "key_b64": None if key is None else base64.b64encode(bytes(key["B"])).decode("ascii"),
        "payload_s3": s(PAYLOAD_S3_ATTR),
        "payload_bytes": n(PAYLOAD_BYTES_ATTR),
        "replayed_at": s("replayed_at"),
        "replayed_to": s("replayed_to"),
        "replay_count": n("replay_count"),
        "replay_id": s("replay_id"),
        "discarded_at": s("discarded_at"),
        "expires_at": n(EXPIRES_AT_ATTR),
        "replay_claim": s(CLAIM_ATTR),
    }
