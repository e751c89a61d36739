"""Settle.ack_ranges: the client's compression, the grammar's bounds, the tracker's span
settle and the dispatcher's per-offset checks (a range settles exactly what plain acks of
the same offsets would, and rejects the rest)."""

from __future__ import annotations

import random

import pytest

from tests.unit.test_dispatcher import connect, drain, make, records
from triage_client.writer import settle_frame
from triage_protocol import triage_pb2 as pb
from triage_protocol.constants import MAX_CREDITS
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.server.grammar import settle_problem


def expand(settle: pb.Settle) -> list[int]:
    out = list(settle.acks)
    for r in settle.ack_ranges:
        out.extend(range(r.first, r.last + 1))
    return sorted(out)


@pytest.mark.parametrize(
    "acks",
    [[7], [3, 1, 2], [1, 2, 4, 5, 6, 9], [5, 5, 6], [10, 8, 9, 20, 22, 21, 30], [0, 2, 4]],
)
def test_settle_frame_names_exactly_the_acks(acks: list[int]) -> None:
    nack = pb.Nack(offset=99, reason="ValueError: x")
    settle = settle_frame(acks, [nack])
    assert expand(settle) == sorted(acks)
    assert list(settle.nacks) == [nack]
    assert all(r.last > r.first for r in settle.ack_ranges)


def test_settle_frame_makes_one_range_of_a_contiguous_batch() -> None:
    acks = list(range(1000, 1256))
    random.Random(3).shuffle(acks)
    settle = settle_frame(acks, [])
    assert list(settle.acks) == []
    assert [(r.first, r.last) for r in settle.ack_ranges] == [(1000, 1255)]


def _settle(*ranges: tuple[int, int], acks: tuple[int, ...] = ()) -> pb.Settle:
    return pb.Settle(
        acks=list(acks), ack_ranges=[pb.OffsetRange(first=f, last=la) for f, la in ranges]
    )


def test_grammar_refuses_backwards_negative_and_oversized_ranges() -> None:
    assert settle_problem(_settle((0, 0), (5, 9))) is None
    assert settle_problem(_settle((0, MAX_CREDITS - 1))) is None
    assert "first <= last" in (settle_problem(_settle((5, 4))) or "")
    assert "first <= last" in (settle_problem(_settle((-1, 4))) or "")
    assert "at most" in (settle_problem(_settle((0, MAX_CREDITS))) or "")
    assert "at most" in (settle_problem(_settle((0, MAX_CREDITS - 1), acks=(7,))) or "")


@pytest.mark.parametrize("seed", range(20))
def test_settle_span_matches_settling_each_offset(seed: int) -> None:
    rng = random.Random(seed)
    one, span = CommitTracker(5), CommitTracker(5)
    offset = 5
    tracked: list[int] = []
    for _ in range(3000):
        offset += 1 if rng.random() < 0.9 else rng.randint(2, 2500)  # gaps across pages
        tracked.append(offset)
        one.track(offset)
        span.track(offset)
    for _ in range(300):
        first = rng.choice(tracked) + rng.randint(-3, 3)
        last = first + rng.randint(0, 1500)
        expected = 0
        for o in range(first, last + 1):
            expected += one.settle(o)
        assert span.settle_span(first, last) == expected
        assert span.committable == one.committable
        assert span.pending == one.pending
        assert span.settled_above() == one.settled_above()
    assert span.settle_span(10, 9) == 0


def test_a_range_settles_what_the_stream_holds_and_rejects_the_rest() -> None:
    d, tracker, _ = make()
    a = connect(d, "a", 5)
    b = connect(d, "b", 5)
    d.add(records(0, 10))
    mine = sorted(x.offset for x in drain(a))
    theirs = sorted(x.offset for x in drain(b))
    rejected = d.settle(a, [mine[0]], [], [pb.OffsetRange(first=0, last=9)])
    # mine[0] is settled by the plain ack first, so the range finds it gone: rejected once.
    assert sorted(rejected) == sorted([*theirs, mine[0]])
    assert not a.held
    assert d.counters.acked == 5
    assert d.counters.rejected == 6
    assert tracker.pending == 5
    assert d.settle(b, [], [], [pb.OffsetRange(first=theirs[0], last=theirs[-1])]) == [
        o for o in range(theirs[0], theirs[-1] + 1) if o not in theirs
    ]
    assert tracker.committable == 10
    assert tracker.pending == 0
