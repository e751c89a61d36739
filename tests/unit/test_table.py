"""Unit tests of the pure parts of the table package: selection, time parsing,
provenance headers, the S3 payload format and the idempotent MemoryStore."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.samples import GROUP, T0, item, make_dl
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.deadletters.writer import DeadLetterWriter
from triage_proxy.errors import DeadLetterUnavailable
from triage_proxy.store import provisioning
from triage_proxy.store.deadletter_store import MemoryStore, writable
from triage_proxy.store.items import (
    MAX_ITEM_BYTES,
    fits_with_overflow,
    item_size,
    pointer_item,
)
from triage_proxy.store.payload import decode_payload, encode_payload, payload_size
from triage_proxy.store.query import Filters, load_dead_letter, matches, parse_time
from triage_proxy.store.replay import (
    REPLAY_ID_HEADER,
    REPLAY_OF_HEADER,
    REPLAY_REASON_HEADER,
    Outcome,
    ReplayResult,
    before_claim,
    replay_headers,
)
from triage_proxy.structs import DeadLetter, Headers, Record

# --- selection ------------------------------------------------------------------------


def test_empty_filters_select_every_dead_letter_but_never_a_checkpoint() -> None:
    checkpoint = {"source": {"S": "orders#0#checkpoint#g"}, "offset": {"N": "-1"}}
    assert matches(item(0), Filters(), group=GROUP)
    assert not matches(checkpoint, Filters(), group=GROUP)
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
    assert {i["offset"]["N"] for i in items if matches(i, filters, group=GROUP)} == {
        str(o) for o in selected
    }


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


# --- replay headers -----------------------------------------------------------------


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
    item = pointer_item(dl, GROUP, "bucket", "tbl/orders/0/5", 1234)
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
    assert item_size(big, GROUP) > MAX_ITEM_BYTES
    assert not fits_with_overflow(big, DeadLetterSettings(table="t"), GROUP)
    assert fits_with_overflow(big, DeadLetterSettings(table="t", overflow_bucket="b"), GROUP)
    huge_reason = make_dl(1, value=b"x" * MAX_ITEM_BYTES, reason="r" * MAX_ITEM_BYTES)
    assert not fits_with_overflow(
        huge_reason, DeadLetterSettings(table="t", overflow_bucket="b"), GROUP
    )


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


SOURCE = f"orders#0#dead#{GROUP}"
"""The partition key of orders/0's dead letters in the sample deployment."""


def test_memory_store_never_clobbers_a_replayed_item() -> None:
    store = MemoryStore()
    assert store.put_batch([make_dl(1, reason="first"), make_dl(2, reason="first")]) == []
    store.items[(SOURCE, 1)]["status"] = {"S": "replayed"}
    assert store.put_batch([make_dl(1, reason="again"), make_dl(2, reason="again")]) == []
    assert store.items[(SOURCE, 1)]["status"] == {"S": "replayed"}
    assert store.items[(SOURCE, 1)]["reason"] == {"S": "first"}
    assert store.items[(SOURCE, 2)]["reason"] == {"S": "again"}
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
    assert list(store.objects) == [("overflow", f"dead-letters/orders/0/1/{GROUP}")]
    assert "value" not in store.items[(SOURCE, 1)]


def test_a_timeout_without_a_response_is_translated_not_crashed() -> None:
    """botocore's ReadTimeoutError has no AWS error response: still DeadLetterUnavailable."""
    from botocore.exceptions import ReadTimeoutError

    from triage_proxy.errors import DeadLetterUnavailable
    from triage_proxy.store.query import DeadLetterTable

    class TimingOut:
        def scan(self, **kwargs: Any) -> Any:
            raise ReadTimeoutError(endpoint_url="http://127.0.0.1:9/")

    settings = DeadLetterSettings(table="t", endpoint_url="http://127.0.0.1:9")
    table = DeadLetterTable(settings, group=GROUP, dynamodb=TimingOut())  # type: ignore[arg-type]
    with pytest.raises(DeadLetterUnavailable, match="ReadTimeoutError"):
        list(table.scan(Filters()))


# --- the replay policy ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "claim", "until", "take_over", "expected"),
    [
        ("pending", None, None, False, None),
        ("replayed", None, None, True, Outcome.SKIPPED),
        ("discarded", None, None, True, Outcome.SKIPPED),
        ("pending", "other", T0 + 1, True, Outcome.IN_DOUBT),  # live: never taken over
        ("pending", "other", T0 - 1, True, None),  # stale: taken over when asked
        ("pending", "other", T0 - 1, False, Outcome.IN_DOUBT),
        ("pending", "mine", T0 - 1, True, Outcome.IN_DOUBT),  # an earlier attempt of this run
    ],
)
def test_what_a_replay_claims(
    status: str, claim: str | None, until: int | None, take_over: bool, expected: Outcome | None
) -> None:
    scanned = item(1, status=status)
    if claim is not None:
        scanned["replay_claim"] = {"S": claim}
        scanned["replay_claim_until"] = {"N": str(until)}
    verdict = before_claim(scanned, replay_id="mine", now_ms=T0, take_over_stale=take_over)
    assert (verdict and verdict[0]) == expected


def test_replay_result_sorts_outcomes() -> None:
    result = ReplayResult()
    result.add(Outcome.REPLAYED, ("t", 0, 1))
    result.add(Outcome.IN_DOUBT, ("t", 0, 2), "maybe")
    result.add(Outcome.FAILED, ("t", 0, 3), "no")
    result.add(Outcome.SKIPPED, ("t", 0, 4), "done")
    assert result.replayed == [("t", 0, 1)]
    assert result.in_doubt == [(("t", 0, 2), "maybe")]
    assert result.failed == [(("t", 0, 3), "no")]
    assert result.skipped == [(("t", 0, 4), "done")]


class _Clock:
    """A clock that moves only when the poll sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def poll(self, ask: Callable[[], str], timeout_s: float) -> str:
        """`provisioning.poll` until "ACTIVE", every second, on this clock."""
        return provisioning.poll(
            ask,
            lambda s: s == "ACTIVE",
            timeout_s=timeout_s,
            every_s=1.0,
            sleep=self.sleep,
            clock=lambda: self.now,
        )


def test_poll_returns_the_first_answer_that_is_done_without_sleeping_after_it() -> None:
    clock = _Clock()
    answers = iter(["CREATING", "CREATING", "ACTIVE", "unreached"])
    got = clock.poll(lambda: next(answers), timeout_s=10.0)
    assert got == "ACTIVE"
    assert clock.slept == [1.0, 1.0]


def test_poll_gives_the_last_answer_once_the_time_is_up() -> None:
    clock = _Clock()
    asked: list[float] = []

    def ask() -> str:
        asked.append(clock.now)
        return "CREATING"

    got = clock.poll(ask, timeout_s=2.5)
    assert got == "CREATING"
    # asked at 100, 101, 102 and once past the deadline (102.5), then no further sleep
    assert asked == [100.0, 101.0, 102.0, 103.0]
    assert clock.slept == [1.0, 1.0, 1.0]


def test_poll_lets_an_error_of_the_question_through() -> None:
    clock = _Clock()

    def ask() -> str:
        raise DeadLetterUnavailable("describing table 't' failed: refused")

    with pytest.raises(DeadLetterUnavailable, match="refused"):
        clock.poll(ask, timeout_s=5.0)
    assert clock.slept == []
