"""Checkpoint codec: round trips, the size limit, typical sizes and hostile input."""

from __future__ import annotations

import base64
import contextlib
import itertools
import random
import tracemalloc
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triage_proxy.errors import TriageError
from triage_proxy.pipeline.settled import (
    DEFAULT_LIMIT,
    MAX_OFFSET,
    MAX_OFFSETS,
    MAX_PAYLOAD,
    CheckpointError,
    decode_settled,
    encode_settled,
    kafka_metadata,
)

UNLIMITED = 10**9


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def forge(payload: bytes, version: str = "t1") -> str:
    """Wrap a hand-made payload the way the codec does, to test the decoder's checks."""
    body = base64.urlsafe_b64encode(zlib.compress(payload)).rstrip(b"=").decode()
    return f"{version}:{body}"


def random_window(seed: int, committed: int, window: int, fraction: float) -> list[int]:
    """Each offset of (committed, committed + window) settled with probability ``fraction``."""
    rng = random.Random(seed)
    return [o for o in range(committed + 1, committed + window) if rng.random() < fraction]


# -- round trips ---------------------------------------------------------------------------


def test_empty_set_is_empty_string_and_back() -> None:
    assert encode_settled(5, []) == ""
    assert decode_settled(5, "") == []
    assert decode_settled(5, None) == []


@pytest.mark.parametrize(
    ("committed", "offsets"),
    [
        (0, [1]),
        (0, [2]),
        (10, [11, 12, 13]),
        (10, [12, 14, 16]),
        (0, [1, 2, 3, 10**12, 10**12 + 1]),
        (MAX_OFFSET - 2, [MAX_OFFSET]),
        (7, list(range(100, 1_000_100))),  # one long run
    ],
)
def test_round_trip_examples(committed: int, offsets: list[int]) -> None:
    text = encode_settled(committed, offsets)
    assert text is not None
    assert text.startswith("t1:")
    assert text.isascii()
    assert decode_settled(committed, text) == offsets


def test_long_run_is_tiny() -> None:
    text = encode_settled(0, range(2, 1_000_002))
    assert text is not None
    assert len(text) < 40


@st.composite
def settled_sets(draw: st.DrawFn) -> tuple[int, list[int]]:
    """A committed offset and a sorted set above it, as runs with gaps small to huge."""
    committed = draw(st.one_of(st.integers(0, 100), st.integers(0, 10**15)))
    gaps = st.one_of(
        st.integers(0, 3), st.integers(0, 1000), st.integers(0, 10**12), st.just(10**12)
    )
    lengths = st.one_of(st.integers(1, 3), st.integers(1, 100), st.just(3000))
    runs = draw(st.lists(st.tuples(gaps, lengths, st.booleans()), max_size=20))
    offsets: list[int] = []
    cursor = committed + 1
    for gap, length, touch in runs:
        start = cursor + gap
        offsets.extend(range(start, start + length))
        # Usually leave a hole after a run; with `touch` and gap 0 the next run merges.
        cursor = start + length + (0 if touch else 1)
    return committed, offsets


@given(case=settled_sets())
@settings(max_examples=200, deadline=None)
def test_round_trip(case: tuple[int, list[int]]) -> None:
    committed, offsets = case
    text = encode_settled(committed, offsets, limit=UNLIMITED)
    assert text is not None
    assert text.isascii()
    assert decode_settled(committed, text) == offsets
    # The limit is a hard boundary on the returned string's size.
    assert encode_settled(committed, offsets, limit=len(text)) == text
    if offsets:
        assert encode_settled(committed, offsets, limit=len(text) - 1) is None


@given(offsets=st.sets(st.integers(1, 200), max_size=120))
def test_round_trip_dense_small_sets(offsets: set[int]) -> None:
    ordered = sorted(offsets)
    assert decode_settled(0, encode_settled(0, ordered, limit=UNLIMITED)) == ordered


# -- size ----------------------------------------------------------------------------------


def test_incompressible_set_returns_none() -> None:
    # Isolated offsets with random gaps of ~2**40: about 6 random bytes each, which no
    # compressor can shrink, so 2,000 of them need far more than 4096 bytes.
    rng = random.Random(1)
    offsets, cursor = [], 0
    for _ in range(2_000):
        cursor += rng.randrange(2, 2**40)
        offsets.append(cursor)
    full = encode_settled(0, offsets, limit=UNLIMITED)
    assert full is not None
    assert len(full) > DEFAULT_LIMIT  # so the None below is about size, not a bug
    assert decode_settled(0, full) == offsets
    assert encode_settled(0, offsets) is None


@pytest.mark.parametrize("seed", range(20))
def test_typical_window_fits(seed: int) -> None:
    # A 10,000-offset window with 30% settled at random: measured 2.06-2.14 KB over
    # 200 seeds, about half the broker's default metadata limit.
    committed = 123_456_789
    offsets = random_window(seed, committed, 10_000, 0.30)
    text = encode_settled(committed, offsets)
    assert text is not None
    assert len(text) < 2600
    assert decode_settled(committed, text) == offsets


@pytest.mark.parametrize("fraction", [0.05, 0.5, 0.95])
def test_any_density_of_a_default_window_fits(fraction: float) -> None:
    # Half settled is the least compressible case (measured at most 2.27 KB).
    offsets = random_window(3, 0, 10_000, fraction)
    text = encode_settled(0, offsets)
    assert text is not None
    assert decode_settled(0, text) == offsets


# -- validation of the encoder's input ------------------------------------------------------


@pytest.mark.parametrize(
    ("committed", "offsets"),
    [
        (5, [5]),
        (5, [4, 6]),
        (5, [6, 8, 7]),
        (5, [6, 6]),
        (0, [1, MAX_OFFSET + 1]),
        (-1, [1]),
    ],
)
def test_encode_rejects_bad_input(committed: int, offsets: list[int]) -> None:
    with pytest.raises(ValueError, match=r"committed|offset"):
        encode_settled(committed, offsets)


def test_encode_refuses_more_than_max_offsets() -> None:
    assert encode_settled(0, range(1, MAX_OFFSETS + 2)) is None


# -- hostile or stale metadata ---------------------------------------------------------------


def test_checkpoint_error_is_a_triage_error_and_not_retriable() -> None:
    assert issubclass(CheckpointError, TriageError)
    assert CheckpointError.retriable is False


def test_mismatched_committed_is_refused() -> None:
    text = encode_settled(100, [102, 103])
    assert text is not None
    assert decode_settled(100, text) == [102, 103]
    for other in (0, 99, 101, 103):
        with pytest.raises(CheckpointError, match="written for committed offset 100"):
            decode_settled(other, text)


@pytest.mark.parametrize(
    "text",
    [
        "garbage",
        "t1",
        ":",
        "t1:",
        "t1:!!!!",
        "t1:abc=",
        "t1:a",
        "t1:AAAA",
        "t1:" + base64.urlsafe_b64encode(b"not zlib at all").decode().rstrip("="),
        "{'offsets': [1, 2]}",
        "t1:\u00e9\u00e9\u00e9\u00e9",
    ],
)
def test_garbage_is_refused(text: str) -> None:
    with pytest.raises(CheckpointError):
        decode_settled(0, text)


def test_unknown_version_is_refused() -> None:
    good = encode_settled(0, [2, 3])
    assert good is not None
    with pytest.raises(CheckpointError, match="version"):
        decode_settled(0, "t2:" + good.removeprefix("t1:"))


def test_truncated_input_is_refused() -> None:
    offsets = random_window(5, 0, 2_000, 0.3)
    text = encode_settled(0, offsets)
    assert text is not None
    for cut in range(len("t1:"), len(text)):
        with pytest.raises(CheckpointError):
            decode_settled(0, text[:cut])


def test_trailing_bytes_are_refused() -> None:
    payload = varint(0) + varint(1) + varint(0)
    assert decode_settled(0, forge(payload)) == [2]
    body = base64.urlsafe_b64encode(zlib.compress(payload) + b"xx").decode().rstrip("=")
    with pytest.raises(CheckpointError, match="trailing"):
        decode_settled(0, "t1:" + body)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (varint(0), "no offsets"),
        (varint(0) + varint(1), "inside a run"),
        (varint(0) + b"\x80", "inside a number"),
        (varint(0) + b"\xff" * 11 + b"\x01" + varint(0), "too long"),
        (varint(0) + varint(MAX_OFFSET) + varint(0), "range"),
        (varint(0) + varint(0) + varint(MAX_OFFSET), "range"),  # ends at MAX_OFFSET + 1
        (varint(0) + varint(0) + varint(MAX_OFFSETS), "more than"),  # refused before allocating
    ],
)
def test_malformed_payloads_are_refused(payload: bytes, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        decode_settled(0, forge(payload))


def test_offset_count_cap_spans_runs() -> None:
    # Three runs of 400 (with holes between): the cap counts offsets across runs.
    payload = varint(0) + (varint(0) + varint(399)) * 3
    assert len(decode_settled(0, forge(payload))) == 1200
    with pytest.raises(CheckpointError, match="more than 1000"):
        decode_settled(0, forge(payload), max_offsets=1000)


def test_decompression_bomb_is_refused_without_inflating_it() -> None:
    # 64 MiB of zeros compress ~1000:1 into a ~90 KB string; decoding must stop at the
    # payload cap instead of inflating all of it.
    squeeze = zlib.compressobj(9)
    parts = [squeeze.compress(varint(0))]
    chunk = bytes(1 << 20)
    parts += [squeeze.compress(chunk) for _ in range(64)]
    parts.append(squeeze.flush())
    text = "t1:" + base64.urlsafe_b64encode(b"".join(parts)).decode().rstrip("=")
    assert len(text) < 200_000
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="inflates beyond"):
            decode_settled(0, text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * MAX_PAYLOAD + 1_000_000


def test_max_offsets_can_be_tightened() -> None:
    text = encode_settled(0, range(1, 1001))
    assert text is not None
    assert len(decode_settled(0, text, max_offsets=1000)) == 1000
    with pytest.raises(CheckpointError, match="more than 999"):
        decode_settled(0, text, max_offsets=999)


@given(data=st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(data: bytes) -> None:
    # Any well-formed zlib stream either decodes to strictly increasing offsets above
    # committed, or raises CheckpointError: nothing else escapes.
    try:
        offsets = decode_settled(3, forge(varint(3) + data), max_offsets=10_000)
    except CheckpointError:
        return
    assert 0 < len(offsets) <= 10_000
    assert offsets[0] > 3
    assert all(a < b for a, b in itertools.pairwise(offsets))


@given(text=st.text(max_size=60))
def test_arbitrary_text_never_crashes(text: str) -> None:
    with contextlib.suppress(CheckpointError):
        decode_settled(0, text)


def test_kafka_metadata_passes_what_fits_the_broker_and_nothing_else() -> None:
    assert kafka_metadata("") == ""
    assert kafka_metadata("x" * DEFAULT_LIMIT) == "x" * DEFAULT_LIMIT
    assert kafka_metadata("x" * (DEFAULT_LIMIT + 1)) is None
    assert kafka_metadata(None) is None
