"""The signature a push request carries, so a receiver can tell Triage's requests from a
forger's and a fresh request from a replayed one.

    triage-signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>

The timestamp is inside the signed bytes, so a receiver that refuses signatures older than
a few minutes also refuses replays. A receiver verifies with a constant-time comparison
(docs/guides/push.md has the ten lines in Python and TypeScript).
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["SIGNATURE_HEADER", "sign", "verify"]

SIGNATURE_HEADER = "triage-signature"


def sign(secret: bytes, body: bytes, timestamp: int) -> str:
    """The `triage-signature` header value for `body` sent at `timestamp` (unix seconds)."""
    mac = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(secret: bytes, body: bytes, header: str, now: int, tolerance_s: int = 300) -> bool:
    """Whether `header` signs `body` with `secret` within `tolerance_s` of `now`: what a
    receiver does, here so that the tests hold the documented recipe to the signer."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    try:
        timestamp = int(fields["t"])
    except (KeyError, ValueError):
        return False
    if abs(now - timestamp) > tolerance_s:
        return False
    expected = sign(secret, body, timestamp).split("v1=", 1)[1]
    return hmac.compare_digest(expected, fields.get("v1", ""))
