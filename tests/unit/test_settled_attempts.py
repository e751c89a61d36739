"""Failed-delivery counts in the checkpoint item: codec round trips, the bound, hostile
input, and the in-memory store twin."""

from __future__ import annotations

import base64
import contextlib
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from triage_proxy.pipeline.settled import (
    MAX_ATTEMPT_COUNT,
    MAX_ATTEMPT_ENTRIES,
    MAX_OFFSET,
    CheckpointError,
    decode_attempts,
    encode_attempts,
    encode_settled,
)
from triage_proxy.store.checkpoints import Checkpoint, MemoryCheckpoints


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def forge(payload: bytes, version: str = "a1") -> str:
    body = base64.urlsafe_b64encode(zlib.compress(payload)).rstrip(b"=").decode()
    return f"{version}:{body}"


def test_no_counts_is_empty_string_and_back() -> None:
    assert encode_attempts(5, {}) == ""
    assert decode_attempts(5, "") == {}
    assert decode_attempts(5, None) == {}  # an item written before counts existed


def test_round_trip_example() -> None:
    counts = {100: 2, 101: 1, 5000: 4, 2**40: 3}
    text = encode_attempts(100, counts)
    assert text.startswith("a1:")
    assert decode_attempts(100, text) == counts


def test_offsets_below_committed_and_empty_counts_are_left_out() -> None:
    text = encode_attempts(10, {3: 5, 9: 1, 10: 2, 11: 0, 12: 1})
    assert decode_attempts(10, text) == {10: 2, 12: 1}
    assert encode_attempts(10, {3: 5, 11: 0}) == ""


def test_the_lowest_offsets_are_kept_up_to_the_bound_in_a_few_kb() -> None:
    counts = {o: 1 + o % 7 for o in range(0, 2 * MAX_ATTEMPT_ENTRIES * 3, 3)}
    text = encode_attempts(0, counts)
    got = decode_attempts(0, text)
    assert len(got) == MAX_ATTEMPT_ENTRIES
    assert got == dict(sorted(counts.items())[:MAX_ATTEMPT_ENTRIES])
    assert len(text) < 4096


def test_sparse_large_offsets_stay_small() -> None:
    counts = {10**12 + o * 997: 4 for o in range(MAX_ATTEMPT_ENTRIES)}
    text = encode_attempts(10**12, counts)
    assert decode_attempts(10**12, text) == counts
    assert len(text) < 8192


def test_huge_counts_are_clamped_to_a_uint32() -> None:
    text = encode_attempts(0, {1: MAX_ATTEMPT_COUNT + 5})
    assert decode_attempts(0, text) == {1: MAX_ATTEMPT_COUNT}


def test_counts_for_another_committed_offset_are_refused() -> None:
    text = encode_attempts(100, {102: 1})
    for other in (0, 99, 101):
        with pytest.raises(CheckpointError, match="written for committed offset 100"):
            decode_attempts(other, text)


def test_a_settled_set_is_not_taken_for_counts() -> None:
    settled = encode_settled(0, [2, 3])
    assert settled
    with pytest.raises(CheckpointError, match="version"):
        decode_attempts(0, settled)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (varint(0), "no offsets"),
        (varint(0) + varint(1), "inside an entry"),
        (varint(0) + b"\x80", "inside a number"),
        (varint(0) + varint(MAX_OFFSET + 1) + varint(0), "range"),
        (varint(0) + varint(1) + varint(MAX_ATTEMPT_COUNT), "uint32"),
        (varint(0) + (varint(0) + varint(0)) * 3, "more than 2"),
    ],
)
def test_malformed_payloads_are_refused(payload: bytes, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        decode_attempts(0, forge(payload), max_entries=2)


@pytest.mark.parametrize("text", ["garbage", "a1", "a1:", "a1:!!!!", "a1:a", "a2:AAAA"])
def test_garbage_is_refused(text: str) -> None:
    with pytest.raises(CheckpointError):
        decode_attempts(0, text)


COUNTS = st.dictionaries(
    st.integers(0, 10**15), st.integers(1, MAX_ATTEMPT_COUNT), max_size=MAX_ATTEMPT_ENTRIES
)


@given(committed=st.integers(0, 10**15), counts=COUNTS)
def test_round_trip(committed: int, counts: dict[int, int]) -> None:
    expected = {o: n for o, n in counts.items() if o >= committed}
    assert decode_attempts(committed, encode_attempts(committed, counts)) == expected


@given(text=st.text(max_size=200))
def test_arbitrary_text_never_crashes(text: str) -> None:
    with contextlib.suppress(CheckpointError):
        decode_attempts(0, text)


@given(data=st.binary(max_size=200))
def test_arbitrary_payloads_never_crash(data: bytes) -> None:
    with contextlib.suppress(CheckpointError):
        decode_attempts(0, forge(data))


def test_the_twin_keeps_counts_beside_the_settled_set() -> None:
    store = MemoryCheckpoints()
    assert store.get() is None
    store.put(5, "settled")  # as an older writer would
    assert store.get() == Checkpoint(5, "settled", "")
    store.put(6, "", "a1:xyz")
    assert store.get() == Checkpoint(6, "", "a1:xyz")
    assert store.value == (6, "")
    assert store.attempts == "a1:xyz"
