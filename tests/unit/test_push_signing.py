"""The request signature (push/signing.py), checked the way docs/guides/push.md tells a receiver."""

from __future__ import annotations

import hashlib
import hmac

from triage_proxy.push.signing import sign, verify

SECRET = b"s3cret"


def test_the_signature_is_hmac_sha256_over_timestamp_dot_body() -> None:
    header = sign(SECRET, b'{"a":1}', 1_700_000_000)
    mac = hmac.new(SECRET, b'1700000000.{"a":1}', hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={mac}"


def test_verify_refuses_a_changed_body_a_wrong_secret_an_old_or_garbled_header() -> None:
    header = sign(SECRET, b"body", 1_000)
    assert verify(SECRET, b"body", header, now=1_010)
    assert not verify(SECRET, b"bodY", header, now=1_010)
    assert not verify(b"other", b"body", header, now=1_010)
    assert not verify(SECRET, b"body", header, now=2_000)
    assert not verify(SECRET, b"body", "v1=abc", now=1_000)
    assert not verify(SECRET, b"body", "t=x,v1=abc", now=1_000)
