"""Unit tests of the pure parts of dead-letter tooling: selection, time parsing, safe
rendering, provenance headers, the S3 payload format and the idempotent MemoryStore."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from triage_proxy.deadletter import (
    MAX_ITEM_BYTES,
    DeadLetterWriter,
    MemoryStore,
    decode_payload,
    encode_payload,
    fits_with_overflow,
    item_from_dead_letter,
    item_size,
    load_dead_letter,
    payload_size,
    pointer_item,
    writable,
)
from triage_proxy.dlqtable import (
    REPLAY_ID_HEADER,
    REPLAY_OF_HEADER,
    REPLAY_REASON_HEADER,
    Filters,
    hex_dump,
    item_key,
    item_summary,
    matches,
    parse_time,
    render_bytes,
    replay_headers,
    safe_text,
    short_text,
)
from triage_proxy.settings import DeadLetterSettings
from triage_proxy.structs import DeadLetter, Headers, Record

T0 = 1_714_564_800_000  # 2024-05-01T12:00:00Z


def make_dl(
    offset: int,
    *,
    topic: str = "orders",
    partition: int = 0,
    key: bytes | None = b"k",
    value: bytes | None = b"v",
    headers: Headers = (),
    reason: str = "ValueError: bad",
    at_ms: int = T0,
) -> DeadLetter:
    record = Record(topic, partition, offset, key, value, headers, T0 - 5)
    return DeadLetter(record, reason, 3, "worker-1", at_ms)


def item(offset: int, *, status: str = "pending", **kwargs: Any) -> dict[str, Any]:
    built = item_from_dead_letter(make_dl(offset, **kwargs))
    built["status"] = {"S": status}
    return built


# --- selection ------------------------------------------------------------------------


def test_empty_filters_select_every_dead_letter_but_never_a_checkpoint() -> None:
    checkpoint = {"source": {"S": "orders#0#checkpoint#g"}, "offset": {"N": "-1"}}
    assert matches(item(0), Filters())
    assert not matches(checkpoint, Filters())
    assert not Filters().narrows
    assert Filters(reason="x").narrows


@pytest.mark.parametrize(
    ("filters", "selected"),
    [
        (Filters(topic="orders"), {0, 1, 2, 3}),
        (Filters(topic="payments"), {4}),
        (Filters(partition=1), {1, 4}),
        (Filters(topic="orders", partition=1), {1}),
        (Filters(offset=2), {2}),
        (Filters(status="replayed"), {2}),
        (Filters(status="pending"), {0, 1, 3, 4}),
        (Filters(reason="timeout"), {3, 4}),
        (Filters(reason="TIMEOUT"), {3, 4}),
        (Filters(since_ms=T0 + 1000), {1, 2, 3, 4}),
        (Filters(until_ms=T0 + 2000), {0, 1}),
        (Filters(since_ms=T0 + 1000, until_ms=T0 + 3000), {1, 2}),
        (Filters(topic="orders", reason="timeout", since_ms=T0 + 3000), {3}),
    ],
)
def test_filters_select_exactly_what_they_say(filters: Filters, selected: set[int]) -> None:
    items = [
        item(0, at_ms=T0),
        item(1, partition=1, at_ms=T0 + 1000),
        item(2, status="replayed", at_ms=T0 + 2000),
        item(3, reason="TimeoutError: downstream timeout", at_ms=T0 + 3000),
        item(4, topic="payments", partition=1, reason="timeout", at_ms=T0 + 4000),
    ]
    assert {i["offset"]["N"] for i in items if matches(i, filters)} == {str(o) for o in selected}


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"partition": -1}, "partition"),
        ({"offset": -1}, "offset"),
        ({"status": "lost"}, "status"),
        ({"topic": "a#b"}, "topic"),
        ({"since_ms": 2, "until_ms": 2}, "empty time range"),
        ({"since_ms": 3, "until_ms": 2}, "empty time range"),
    ],
)
def test_filters_refuse_nonsense(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Filters(**kwargs)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("now", T0),
        ("90s", T0 - 90_000),
        ("15m", T0 - 15 * 60_000),
        ("1h", T0 - 3_600_000),
        ("1.5h", T0 - 5_400_000),
        ("2d", T0 - 2 * 86_400_000),
        ("1w", T0 - 7 * 86_400_000),
        ("2024-05-01T12:00:00Z", T0),
        ("2024-05-01T12:00:00.250Z", T0 + 250),
        ("2024-05-01T14:00:00+02:00", T0),
        ("2024-05-01T12:00:00", T0),
        ("2024-05-01", T0 - 12 * 3_600_000),
    ],
)
def test_parse_time(text: str, expected: int) -> None:
    assert parse_time(text, T0) == expected


@pytest.mark.parametrize("text", ["yesterday", "1y", "-1h", "2024-13-01", "", "12:00 tomorrow"])
def test_parse_time_refuses_malformed_text(text: str) -> None:
    with pytest.raises(ValueError, match="not a time"):
        parse_time(text, T0)


# --- rendering ------------------------------------------------------------------------


def test_render_text_json_and_binary() -> None:
    assert render_bytes(None).kind == "null"
    assert render_bytes(b"").kind == "empty"
    assert render_bytes("héllo\nworld".encode()) == render_bytes("héllo\nworld".encode())
    assert render_bytes("héllo\nworld".encode()).kind == "text"
    pretty = render_bytes(b'{"a":[1,2],"b":"\xc3\xa9"}')
    assert pretty.kind == "json"
    assert json.loads(pretty.text) == {"a": [1, 2], "b": "é"}
    assert "\n  " in pretty.text
    assert render_bytes(b"123").kind == "text"  # a bare number is text, not JSON
    dump = render_bytes(bytes(range(20)))
    assert dump.kind == "hex"
    assert dump.text.splitlines()[0].startswith("00000000  00 01 02")
    big = bytes(range(256)) * 20
    assert render_bytes(big) == render_bytes(big)
    assert render_bytes(big).kind == "base64"
    assert base64.b64decode(render_bytes(big).text) == big


def test_json_with_duplicate_keys_stays_text() -> None:
    assert render_bytes(b'{"a": 1, "a": 2}').kind == "text"


def test_terminal_control_characters_are_never_printed() -> None:
    hostile = "ok\x1b[2J\u202eevil\rover".encode()
    shown = render_bytes(hostile)
    assert shown.kind == "hex"  # ESC is a C0 control: not text
    assert "\x1b" not in shown.text
    formatted = render_bytes("plain \u202e bidi\rcr".encode())
    assert formatted.kind == "text"
    assert formatted.text == "plain \\u202e bidi\\rcr"
    assert safe_text("a\tb\nc\x00\x7f\x9b") == "a\tb\nc\\x00\\x7f\\x9b"


@given(st.binary(max_size=600))
def test_rendering_never_crashes_and_never_emits_controls(data: bytes) -> None:
    shown = render_bytes(data, hex_limit=300)
    assert all(c in "\n\t" or ord(c) >= 0x20 for c in shown.text)
    assert not any(0x7F <= ord(c) <= 0x9F for c in shown.text)


def test_hex_dump_layout() -> None:
    lines = hex_dump(b"ABCDEFGHIJKLMNOPQR\x00").splitlines()
    assert lines[0] == "00000000  41 42 43 44 45 46 47 48 49 4a 4b 4c 4d 4e 4f 50  ABCDEFGHIJKLMNOP"
    assert lines[1].startswith("00000010  51 52 00")
    assert lines[1].endswith("QR.")


def test_short_text_for_tables() -> None:
    assert short_text(None) == "(null)"
    assert short_text(b"a\nb") == "a\\nb"
    assert short_text(b"x" * 50, 10) == "x" * 9 + "…"
    assert short_text(b"\x00\x01\xff", 10) == "0x0001ff"


def test_item_summary_is_json_ready() -> None:
    summary = item_summary(item(7, key=b"\x00k", topic="orders", partition=2))
    json.dumps(summary)
    assert summary["topic"] == "orders"
    assert summary["partition"] == 2
    assert summary["offset"] == 7
    assert summary["status"] == "pending"
    assert base64.b64decode(summary["key_b64"]) == b"\x00k"
    assert summary["replayed_at"] is None
    assert item_key(item(7, partition=2)) == ("orders", 2, 7)


def test_replay_headers_keep_the_original_then_add_provenance() -> None:
    dl = make_dl(
        42,
        partition=3,
        headers=(("h", b"1"), ("h", None), ("", b"")),
        reason="KeyError: 'x' ✗",
    )
    assert replay_headers(dl, "run-1") == [
        ("h", b"1"),
        ("h", None),
        ("", b""),
        (REPLAY_OF_HEADER, b"orders/3/42"),
        (REPLAY_REASON_HEADER, "KeyError: 'x' ✗".encode()),
        (REPLAY_ID_HEADER, b"run-1"),
    ]


# --- the S3 payload format ------------------------------------------------------------


_headers = st.lists(st.tuples(st.text(max_size=10), st.none() | st.binary(max_size=20)), max_size=4)


@given(
    key=st.none() | st.binary(max_size=40),
    value=st.none() | st.binary(max_size=200),
    headers=_headers.map(tuple),
)
def test_payload_round_trip(key: bytes | None, value: bytes | None, headers: Headers) -> None:
    record = Record("t", 0, 1, key, value, headers, 0)
    data = encode_payload(record)
    assert len(data) == payload_size(record)
    assert decode_payload(data) == (key, value, headers)


@pytest.mark.parametrize(
    "mangle", [lambda d: d[:-1], lambda d: d + b"x", lambda d: b"XXXX" + d[4:]]
)
def test_malformed_payload_is_refused(mangle: Any) -> None:
    data = encode_payload(Record("t", 0, 1, b"k", b"value", (("h", b"v"),), 0))
    with pytest.raises(ValueError, match="payload"):
        decode_payload(mangle(data))


def test_pointer_item_keeps_everything_but_the_payload() -> None:
    dl = make_dl(5, value=b"x" * (MAX_ITEM_BYTES + 10), headers=(("h", b"1"),))
    item = pointer_item(dl, "bucket", "tbl/orders/0/5", 1234)
    assert "key" not in item
    assert "value" not in item
    assert "headers" not in item
    assert item["payload_s3"] == {"S": "s3://bucket/tbl/orders/0/5"}
    assert item["payload_bytes"] == {"N": "1234"}
    assert item["reason"] == {"S": "ValueError: bad"}
    assert item["status"] == {"S": "pending"}
    with pytest.raises(ValueError, match="S3 client"):
        load_dead_letter(item, None)


def test_overflow_fits_only_with_a_bucket() -> None:
    big = make_dl(1, value=b"x" * (MAX_ITEM_BYTES + 1))
    assert item_size(big) > MAX_ITEM_BYTES
    assert not fits_with_overflow(big, DeadLetterSettings(table="t"))
    assert fits_with_overflow(big, DeadLetterSettings(table="t", overflow_bucket="b"))
    huge_reason = make_dl(1, value=b"x" * MAX_ITEM_BYTES, reason="r" * MAX_ITEM_BYTES)
    assert not fits_with_overflow(huge_reason, DeadLetterSettings(table="t", overflow_bucket="b"))


# --- idempotent writes (the memory twin mirrors DynamoDBStore) ------------------------


@pytest.mark.parametrize(
    ("existing", "allowed"),
    [
        (None, True),
        ({"status": {"S": "pending"}}, True),
        ({"status": {"S": "pending"}, "replay_claim": {"S": "r"}}, False),
        ({"status": {"S": "replayed"}}, False),
        ({"status": {"S": "discarded"}}, False),
    ],
)
def test_write_condition(existing: dict[str, Any] | None, allowed: bool) -> None:
    assert writable(existing) is allowed


def test_memory_store_never_clobbers_a_replayed_item() -> None:
    store = MemoryStore()
    assert store.put_batch([make_dl(1, reason="first"), make_dl(2, reason="first")]) == []
    store.items[("orders#0", 1)]["status"] = {"S": "replayed"}
    assert store.put_batch([make_dl(1, reason="again"), make_dl(2, reason="again")]) == []
    assert store.items[("orders#0", 1)]["status"] == {"S": "replayed"}
    assert store.items[("orders#0", 1)]["reason"] == {"S": "first"}
    assert store.items[("orders#0", 2)]["reason"] == {"S": "again"}
    assert store.kept == 1


def test_writer_sends_large_payloads_to_the_bucket_instead_of_holding_them() -> None:
    store = MemoryStore(overflow_bucket="overflow")
    settings = DeadLetterSettings(table="dead-letters", flush_interval_ms=5, overflow_bucket="b")
    written: list[DeadLetter] = []
    big = make_dl(1, key=None, value=bytes(range(256)) * 2000, headers=(("h", None),))

    async def main() -> None:
        async with DeadLetterWriter(store, settings, written.append) as writer:
            writer.submit(big)
            writer.submit(make_dl(2))
            assert await writer.flush(5)
            assert writer.too_large == 0

    asyncio.run(main())
    assert store.dead_letters() == [big, make_dl(2)]
    assert list(store.objects) == [("overflow", "dead-letters/orders/0/1")]
    assert "value" not in store.items[("orders#0", 1)]


def test_a_timeout_without_a_response_is_translated_not_crashed() -> None:
    """botocore's ReadTimeoutError has no AWS error response: still DeadLetterUnavailable."""
    from botocore.exceptions import ReadTimeoutError

    from triage_proxy.dlqtable import DeadLetterTable
    from triage_proxy.errors import DeadLetterUnavailable

    class TimingOut:
        def scan(self, **kwargs: Any) -> Any:
            raise ReadTimeoutError(endpoint_url="http://127.0.0.1:9/")

    settings = DeadLetterSettings(table="t", endpoint_url="http://127.0.0.1:9")
    table = DeadLetterTable(settings, dynamodb=TimingOut())  # type: ignore[arg-type]
    with pytest.raises(DeadLetterUnavailable, match="ReadTimeoutError"):
        list(table.scan(Filters()))
