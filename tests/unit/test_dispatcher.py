"""Dispatcher logic with the real (pure) commit tracker; no broker, no network."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable

import pytest

from tests.waiting import eventually
from triage_protocol import triage_pb2 as pb
from triage_protocol.constants import DEFAULT_FRAME_BYTES
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.settings import Settings
from triage_proxy.pipeline.dispatch import Dispatcher, Session
from triage_proxy.pipeline.dispatch.scheduler import REFILL_LINGER_S, REFILL_MIN_CREDITS
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.server.encoding import frame_limit
from triage_proxy.server.outbox import Outbox
from triage_proxy.structs import DeadLetter, Record

BASE = {
    "kafka": {"bootstrap_servers": "b", "topic": "t", "group_id": "g"},
    "auth": {"token": "unit-test-token-0123"},
    "dead_letters": {"table": "dlq"},
}


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(
    *,
    max_messages: int = 1000,
    max_attempts: int = 3,
    max_frame_bytes: int = 1 << 20,
    ordering: str = "none",
    clock: Callable[[], float] | None = None,
    already_settled: tuple[int, ...] = (),
    span_s: float = 60.0,
    prior_failures: dict[int, int] | None = None,
) -> tuple[Dispatcher, CommitTracker, list[DeadLetter]]:
    raw = {
        **BASE,
        "window": {"max_messages": max_messages},
        "delivery": {
            "max_attempts": max_attempts,
            "ack_deadline_s": 10,
            "ordering": ordering,
            "redelivery_span_s": span_s,
        },
        "retry": {"initial_backoff_s": 1, "multiplier": 2, "max_backoff_s": 3},
        "server": {"max_frame_bytes": max_frame_bytes},
    }
    settings: Settings = settings_from_dict(raw, {})
    tracker = CommitTracker(0)
    dead: list[DeadLetter] = []
    dispatcher = Dispatcher(
        settings,
        0,
        tracker,
        dead.append,
        clock=lambda: 1.5,
        monotonic=clock or Clock(),
        already_settled=already_settled,
        prior_failures=prior_failures,
    )
    _server_limits[dispatcher] = max_frame_bytes
    return dispatcher, tracker, dead


_server_limits: weakref.WeakKeyDictionary[Dispatcher, int] = weakref.WeakKeyDictionary()
"""server.max_frame_bytes of the dispatchers `make` built (the service caps a stream's
frame limit with it, see `connect`)."""


def connect(
    d: Dispatcher,
    consumer_id: str,
    credits: int,
    max_frame_bytes: int = 0,
    packed: bool = False,
) -> Session:
    """A session as the service opens one for a Hello with these fields: its outbox is
    the server's (`session.outlet` is an Outbox of ProxyFrames)."""
    limit = frame_limit(max_frame_bytes, _server_limits.get(d, DEFAULT_FRAME_BYTES))
    return d.open_session(consumer_id, credits, Outbox("t", d.partition, limit, packed))


def outbox_of(session: Session) -> Outbox:
    """`session`'s outlet, which `connect` made an Outbox."""
    outbox = session.outlet
    assert isinstance(outbox, Outbox)
    return outbox


def frames_of(session: Session) -> list[pb.ProxyFrame | None]:
    """Everything queued for `session` (None: its stream ends)."""
    outbox = outbox_of(session)
    out: list[pb.ProxyFrame | None] = []
    while not outbox.empty():
        out.append(outbox.get_nowait())
    return out


def records(start: int, stop: int, value: bytes = b"v") -> list[Record]:
    return [Record("t", 0, o, None, value, (), 0) for o in range(start, stop)]


def drain(session: Session) -> list[pb.Delivery]:
    out: list[pb.Delivery] = []
    for frame in frames_of(session):
        assert frame is not None
        out.extend(frame.deliveries.deliveries)
    return out


def nack(offset: int, reason: str = "boom", retry: bool = False) -> pb.Nack:
    return pb.Nack(offset=offset, reason=reason, retry=retry)


def test_never_exceeds_credits() -> None:
    d, _, _ = make()
    s = connect(d, "a", 3)
    d.add(records(0, 10))
    got = drain(s)
    assert [x.offset for x in got] == [0, 1, 2]
    assert all(x.attempt == 1 for x in got)
    d.settle(s, [1], [])
    assert [x.offset for x in drain(s)] == [3]


def test_a_stream_with_many_credits_is_refilled_half_of_them_at_a_time() -> None:
    """A settlement that frees fewer than half the stream's credits is held back until
    another frees the rest of the half: one frame of half the credits, not one per Settle
    (bench_fleet_throughput: per-frame costs on both sides)."""
    clock = Clock()
    d, _, _ = make(clock=clock)
    credits = REFILL_MIN_CREDITS * 2
    s = connect(d, "a", credits)
    d.add(records(0, 1000))
    assert len(drain(s)) == credits
    d.settle(s, list(range(credits // 2 - 1)), [])
    assert frames_of(s) == [], "fewer than half its credits free: held back"
    d.settle(s, [credits // 2 - 1], [])
    refill = frames_of(s)
    assert len(refill) == 1, "one frame"
    assert refill[0] is not None
    offsets = [x.offset for x in refill[0].deliveries.deliveries]
    assert offsets == list(range(credits, credits + credits // 2))
    d.settle(s, [credits // 2], [])
    d.tick()
    assert frames_of(s) == [], "held back while it waited less than the linger"
    clock.now += REFILL_LINGER_S + 1e-6
    d.tick()
    assert [x.offset for x in drain(s)] == [credits + credits // 2], "not longer"


def test_a_stream_with_few_credits_is_refilled_as_each_frees() -> None:
    d, _, _ = make()
    s = connect(d, "a", REFILL_MIN_CREDITS - 1)
    d.add(records(0, 1000))
    assert len(drain(s)) == REFILL_MIN_CREDITS - 1
    d.settle(s, [0], [])
    assert [x.offset for x in drain(s)] == [REFILL_MIN_CREDITS - 1]


def test_a_held_back_refill_goes_out_after_the_linger_without_a_tick() -> None:
    """The scheduler's own timer ends the wait: nothing else pumps here."""

    async def scenario() -> list[int]:
        d, _, _ = make(clock=time.monotonic)
        credits = REFILL_MIN_CREDITS * 2
        s = connect(d, "a", credits)
        d.add(records(0, 1000))
        assert len(drain(s)) == credits
        d.settle(s, [0, 1, 2], [])
        frame = await asyncio.wait_for(outbox_of(s).get(), timeout=10)
        assert frame is not None
        return [x.offset for x in frame.deliveries.deliveries]

    assert asyncio.run(scenario()) == [REFILL_MIN_CREDITS * 2 + i for i in range(3)]


def test_even_share_between_instances() -> None:
    d, _, _ = make()
    a, b = connect(d, "a", 10), connect(d, "b", 10)
    d.add(records(0, 6))
    assert len(drain(a)) == 3
    assert len(drain(b)) == 3


def test_out_of_order_acks_commit_only_the_contiguous_prefix() -> None:
    d, tracker, _ = make()
    s = connect(d, "a", 10)
    d.add(records(0, 5))
    d.settle(s, [1, 3, 4], [])
    assert tracker.committable == 0
    d.settle(s, [0], [])
    assert tracker.committable == 2
    d.settle(s, [2], [])
    assert tracker.committable == 5
    assert d.in_window == 0
    assert d.quiet.is_set()


def test_caught_up_is_set_each_time_everything_fetched_got_settled() -> None:
    """The committer's cue (committer.py): set on the step to nothing pending, not by a
    settlement that leaves a record pending, not again while nothing changed."""
    d, tracker, dead = make()
    assert not d.caught_up.is_set()  # nothing fetched yet: nothing to commit early
    s = connect(d, "a", 10)
    d.add(records(0, 4))
    d.settle(s, [0, 1, 2], [])
    assert not d.caught_up.is_set()  # 3 is pending
    d.settle(s, [], [], [pb.OffsetRange(first=3, last=3)])
    assert d.caught_up.is_set()
    assert tracker.pending == 0
    d.caught_up.clear()  # the committer looked
    d.tick()
    assert not d.caught_up.is_set()  # no new catch-up since
    d.add(records(4, 6))
    d.settle(s, [4], [nack(5, retry=False)])
    assert not d.caught_up.is_set()  # 5 is being dead-lettered: still pending
    d.dead_letter_written(dead[-1])
    assert d.caught_up.is_set()


def test_settlement_for_unheld_offset_is_rejected_and_counted() -> None:
    d, tracker, _ = make()
    a, b = connect(d, "a", 1), connect(d, "b", 1)
    d.add(records(0, 2))
    held_by_a = drain(a)[0].offset
    held_by_b = drain(b)[0].offset
    assert (held_by_a, held_by_b) == (0, 1)
    assert d.settle(b, [held_by_a, 99], []) == [held_by_a, 99]
    assert d.settle(a, [held_by_a], []) == []
    assert d.settle(a, [held_by_a], [nack(held_by_a)]) == [held_by_a, held_by_a]
    assert d.counters.rejected == 4
    assert tracker.committable == 1


def test_nack_settles_only_after_dead_letter_is_written() -> None:
    d, tracker, dead = make()
    s = connect(d, "a", 10)
    d.add(records(0, 2, value=b"\x00\xff"))
    d.settle(s, [1], [nack(0, "ValueError: bad")])
    assert [(x.record.offset, x.reason, x.attempts, x.consumer_id) for x in dead] == [
        (0, "ValueError: bad", 1, "a")
    ]
    assert dead[0].record.value == b"\x00\xff"
    assert dead[0].dead_lettered_at_ms == 1500
    assert tracker.committable == 0
    d.dead_letter_written(dead[0])
    assert tracker.committable == 2
    assert d.counters.dead_lettered == 1


def test_disconnect_holding_several_blames_none_and_redelivers_one_suspect_at_a_time() -> None:
    """An instance that vanished with two deliveries proved nothing about either: both
    come back as suspects without losing an attempt, one suspect per instance."""
    d, tracker, dead = make()
    a = connect(d, "a", 2)
    d.add(records(0, 2))
    assert [x.attempt for x in drain(a)] == [1, 1]
    d.close_session(a)
    b = connect(d, "b", 5)
    assert [(x.offset, x.attempt) for x in drain(b)] == [(0, 1)]
    d.settle(b, [0], [])
    assert [(x.offset, x.attempt) for x in drain(b)] == [(1, 1)]
    assert d.failures() == {}
    assert not dead
    assert tracker.committable == 1


def test_disconnect_holding_one_suspect_blames_only_the_suspect() -> None:
    d, tracker, dead = make(span_s=0)
    a = connect(d, "a", 2)
    d.add(records(0, 2))
    drain(a)
    d.close_session(a)  # both are suspects now, neither blamed
    b = connect(d, "b", 5)
    assert [(x.offset, x.attempt) for x in drain(b)] == [(0, 1)]
    d.add(records(2, 3))
    assert [(x.offset, x.attempt) for x in drain(b)] == [(2, 1)]  # ordinary work beside it
    d.close_session(b)  # its one suspect, offset 0, is blamed; offset 2 is not
    assert d.failures() == {0: 1}
    c = connect(d, "c", 5)
    got: list[tuple[int, int]] = []
    while batch := drain(c):  # one suspect at a time
        got += [(x.offset, x.attempt) for x in batch]
        d.settle(c, [x.offset for x in batch], [])
    assert sorted(got) == [(0, 2), (1, 1), (2, 1)]
    assert not dead
    assert tracker.committable == 3


def test_crash_type_poison_pill_is_dead_lettered_after_max_attempts() -> None:
    d, tracker, dead = make(max_attempts=3, span_s=0)  # no gaps (see the backoff tests)
    d.add(records(0, 1))
    for attempt in range(1, 4):
        s = connect(d, f"i{attempt}", 1)
        assert [x.attempt for x in drain(s)] == [attempt]
        d.close_session(s)
    assert len(dead) == 1
    assert dead[0].attempts == 3
    assert dead[0].reason == (
        "delivery attempts exhausted (3): its instance disconnected while handling it"
    )
    assert dead[0].consumer_id == "i3"  # in its own field: the reason is every pill's
    d.dead_letter_written(dead[0])
    assert tracker.committable == 1


def test_records_of_an_endpoint_gone_mid_request_blame_only_a_suspect() -> None:
    """A push lane's session stays open when its receiver crashes during requests
    (`suspect`): even one record alone comes back a suspect without an attempt; a
    suspect uses one. A pill that crashes the receiver each time is dead-lettered after
    `max_attempts + 1` crashes; the records beside it keep their attempts."""
    d, tracker, dead = make(max_attempts=2, span_s=0)
    lane = connect(d, "push:r", 4)
    d.add(records(0, 1))
    assert [(x.offset, x.attempt) for x in drain(lane)] == [(0, 1)]
    d.suspect(lane, [0], "reset")  # alone, but not yet a suspect: no attempt
    assert d.failures() == {}
    d.add(records(1, 4))
    for crash in (1, 2):
        got = [(x.offset, x.attempt) for x in drain(lane)]
        assert (0, crash) in got  # the pill, now a suspect, beside ordinary records
        offsets = [o for o, _ in got]
        d.suspect(lane, offsets, f"reset {crash}")  # the pill crashes it with them
        assert d.failures().get(0) == crash
    (dl,) = dead
    assert (dl.record.offset, dl.attempts, dl.reason) == (
        0,
        2,
        "delivery attempts exhausted (2): reset 2",
    )
    d.dead_letter_written(dl)
    while batch := drain(lane):
        assert all(x.attempt == 1 for x in batch)  # the neighbours lost nothing
        d.settle(lane, [x.offset for x in batch], [])
    assert tracker.committable == 4


def test_retry_nack_waits_out_its_backoff_without_blocking_others() -> None:
    clock = Clock()
    d, _, dead = make(max_attempts=3, clock=clock)
    s = connect(d, "a", 1)
    d.add(records(0, 2))
    assert [x.offset for x in drain(s)] == [0]
    d.settle(s, [], [nack(0, "Retry: later", retry=True)])
    assert [(x.offset, x.attempt) for x in drain(s)] == [(1, 1)]  # not blocked by 0
    d.settle(s, [1], [])
    clock.now += 0.9
    d.tick()
    assert drain(s) == []  # initial backoff is 1 s
    clock.now += 0.2
    d.tick()
    assert [(x.offset, x.attempt) for x in drain(s)] == [(0, 2)]
    d.settle(s, [], [nack(0, "Retry: later", retry=True)])
    clock.now += 1.5
    d.tick()
    assert drain(s) == []  # second backoff is 2 s
    clock.now += 0.6
    d.tick()
    assert [x.attempt for x in drain(s)] == [3]
    d.settle(s, [], [nack(0, "TimeoutError: still down", retry=True)])
    assert [(x.attempts, x.reason) for x in dead] == [
        (3, "delivery attempts exhausted (3): TimeoutError: still down")
    ]


def test_full_window_clears_room_until_settled() -> None:
    d, _, _ = make(max_messages=4)
    s = connect(d, "a", 10)
    d.add(records(0, 4))
    assert d.room_for == 0
    assert not d.room.is_set()
    d.settle(s, [0, 1], [])
    assert d.room_for == 2
    assert d.room.is_set()


def test_oversized_record_is_dead_lettered_not_delivered() -> None:
    d, _, dead = make(max_frame_bytes=128 * 1024)
    s = connect(d, "a", 10)
    d.add(records(0, 1, value=b"x" * (200 * 1024)))
    assert drain(s) == []
    assert "exceeds server.max_frame_bytes" in dead[0].reason


def test_large_batches_split_into_frames_within_budget() -> None:
    d, _, _ = make(max_frame_bytes=64 << 20)
    s = connect(d, "a", 100)
    d.add(records(0, 10, value=b"x" * (1 << 20)))
    frames = frames_of(s)
    assert len(frames) >= 3
    assert sum(len(f.deliveries.deliveries) for f in frames if f) == 10


def test_headers_and_nulls_travel_byte_exact() -> None:
    d, _, _ = make()
    s = connect(d, "a", 1)
    rec = Record("t", 0, 0, None, None, (("h", b"\x00"), ("h", None)), 42)
    d.add([rec])
    got = drain(s)[0]
    assert not got.HasField("key")
    assert not got.HasField("value")
    assert [(h.key, h.value if h.HasField("value") else None) for h in got.headers] == [
        ("h", b"\x00"),
        ("h", None),
    ]
    assert got.timestamp_ms == 42


@pytest.mark.parametrize("gap", [1, 7, 10**9])
def test_gaps_in_offsets_commit_past_them(gap: int) -> None:
    d, tracker, _ = make()
    s = connect(d, "a", 10)
    d.add([*records(0, 1), records(0, 1)[0]._replace(offset=gap + 1)])
    d.settle(s, [0, gap + 1], [])
    assert tracker.committable == gap + 2


def test_stop_delivering_keeps_held_work_settleable() -> None:
    d, tracker, _ = make()
    s = connect(d, "a", 2)
    d.add(records(0, 5))
    assert len(drain(s)) == 2
    d.stop_delivering()
    assert not d.quiet.is_set()
    d.settle(s, [0, 1], [])
    assert drain(s) == []
    assert d.quiet.is_set()
    assert tracker.committable == 2


def test_released_deliveries_come_back_without_using_an_attempt() -> None:
    d, _, dead = make(max_attempts=1)
    a = connect(d, "a", 3)
    d.add(records(0, 3))
    assert [x.attempt for x in drain(a)] == [1, 1, 1]
    d.settle(a, [0], [])
    assert d.release(a, [2, 1, 7]) == [7]
    d.close_session(a)
    b = connect(d, "b", 3)
    assert [(x.offset, x.attempt) for x in drain(b)] == [(1, 1), (2, 1)]
    assert not dead


def test_ending_a_session_now_gives_back_only_what_never_left_its_outbox() -> None:
    d, _, dead = make(max_attempts=1)
    a = connect(d, "a", 4)
    d.add(records(0, 2))
    assert [x.offset for x in drain(a)] == [0, 1]  # these reached the wire
    d.add(records(2, 4))  # these wait in a's outbox
    d.end_session_now(a)  # its token was revoked
    outbox = outbox_of(a)
    assert outbox.get_nowait() is None
    assert outbox.empty()
    d.close_session(a)  # the stream ends holding two: neither is blamed (no attempt used)
    b = connect(d, "b", 4)
    assert [(x.offset, x.attempt) for x in drain(b)] == [(0, 1), (2, 1), (3, 1)]
    assert dead == []


def test_expired_lease_redelivers_and_a_late_ack_is_rejected() -> None:
    clock = Clock()
    d, tracker, _ = make(clock=clock)
    a = connect(d, "a", 1)
    b = connect(d, "b", 1)
    d.add(records(0, 1))
    assert [x.attempt for x in drain(a)] == [1]
    a.credits = 0  # a is stuck; it takes nothing more
    d.add(records(1, 2))
    assert [x.offset for x in drain(b)] == [1]
    clock.now += 5
    d.extend(b, [1])
    clock.now += 5.1
    d.tick()  # a's lease on 0 expired; b's on 1 was extended
    assert d.counters.expired == 1
    d.settle(b, [1], [])
    assert [(x.offset, x.attempt) for x in drain(b)] == [(0, 2)]
    assert d.settle(a, [0], []) == [0]  # late: its lease expired, b holds it now
    assert tracker.committable == 0
    assert d.settle(b, [0], []) == []
    assert tracker.committable == 2


def test_extend_keeps_a_long_delivery_from_expiring() -> None:
    clock = Clock()
    d, _, _ = make(clock=clock)
    a = connect(d, "a", 1)
    d.add(records(0, 1))
    drain(a)
    for _ in range(5):
        clock.now += 6
        d.extend(a, [0, 99])  # 99 is not held: ignored
        d.tick()
    assert d.counters.expired == 0
    assert d.counters.extended == 5
    clock.now += 10.1
    d.tick()
    assert d.counters.expired == 1


def test_expiry_counts_as_an_attempt_until_dead_lettered() -> None:
    clock = Clock()
    d, _, dead = make(max_attempts=2, clock=clock, span_s=0)  # no gaps
    a = connect(d, "a", 1)
    d.add(records(0, 1))
    for _ in range(2):
        drain(a)
        clock.now += 11
        d.tick()
    assert [x.attempts for x in dead] == [2]
    assert "ack deadline of 10 s passed at its instance" in dead[0].reason
    assert dead[0].consumer_id == "a"


def key_records(keys: list[bytes | None]) -> list[Record]:
    return [Record("t", 0, o, k, b"v", (), 0) for o, k in enumerate(keys)]


def test_ordering_by_key_never_has_a_key_in_flight_twice() -> None:
    d, tracker, dead = make(ordering="key")
    a = connect(d, "a", 10)
    d.add(key_records([b"x", b"y", b"x", None, None, b"x", b"y"]))
    assert [x.offset for x in drain(a)] == [0, 1, 3, 4]
    d.settle(a, [1], [])
    assert [x.offset for x in drain(a)] == [6]
    d.settle(a, [], [nack(0, "boom")])  # dead-lettering moves the key on
    assert [x.offset for x in drain(a)] == [2]
    d.settle(a, [2], [])
    assert [x.offset for x in drain(a)] == [5]
    d.dead_letter_written(dead[0])
    d.settle(a, [3, 4, 5, 6], [])
    assert tracker.committable == 7


def test_ordering_by_key_holds_the_key_through_retries_and_disconnects() -> None:
    clock = Clock()
    d, _, _ = make(ordering="key", clock=clock, span_s=0)  # no gap after the disconnect
    a = connect(d, "a", 10)
    d.add(key_records([b"k", b"k"]))
    assert [x.offset for x in drain(a)] == [0]
    d.settle(a, [], [nack(0, "later", retry=True)])
    clock.now += 5
    d.tick()
    assert [(x.offset, x.attempt) for x in drain(a)] == [(0, 2)]
    d.close_session(a)
    b = connect(d, "b", 10)
    assert [(x.offset, x.attempt) for x in drain(b)] == [(0, 3)]


def test_offsets_settled_by_a_previous_run_are_not_delivered() -> None:
    d, tracker, _ = make(already_settled=(1, 3))
    a = connect(d, "a", 10)
    d.add(records(0, 5))
    assert [x.offset for x in drain(a)] == [0, 2, 4]
    d.settle(a, [0, 2, 4], [])
    assert tracker.committable == 5
    assert d.counters.skipped_settled == 2


def test_a_previous_runs_settled_offsets_stay_known_until_fetched() -> None:
    # What the committer adds to the settled-above set while the fetch has not reached them.
    d, tracker, _ = make(already_settled=(1, 3, 7, 8))
    assert d.settled_ahead() == [1, 3, 7, 8]
    d.add(records(0, 4))
    assert d.settled_ahead() == [7, 8]
    assert tracker.settled_above() == [1, 3]
    d.add(records(4, 8))  # 7 fetched (settled in the tracker); 8 is next
    assert d.settled_ahead() == [8]
    d.add(records(8, 10))
    assert d.settled_ahead() == []


def test_lease_bookkeeping_stays_bounded_and_still_expires_after_compaction() -> None:
    clock = Clock()
    d, _, _ = make(max_messages=10, clock=clock)
    a = connect(d, "a", 5)
    d.add(records(0, 1))  # held, never settled: must still expire
    drain(a)
    for start in range(1, 20_001, 4):
        d.add(records(start, start + 4))
        got = [x.offset for x in drain(a)]
        d.settle(a, got, [])
        clock.now += 0.0001
    assert d._leases.references <= 4 * 1024 + 5
    clock.now += 10.1
    d.tick()
    assert d.counters.expired == 1


def test_compaction_drops_batches_below_the_commit_and_keeps_the_held_ones() -> None:
    """Batches wholly below the committable offset go at once (no look at each offset);
    a held delivery above it keeps its lease and still expires."""
    clock = Clock()
    d, tracker, _ = make(max_messages=10, clock=clock)
    a = connect(d, "a", 5)
    for start in range(0, 20_000, 4):
        d.add(records(start, start + 4))
        got = [x.offset for x in drain(a)]
        d.settle(a, got, [])
        clock.now += 0.0001
    assert tracker.committable == 20_000
    d.add(records(20_000, 20_002))
    held = [x.offset for x in drain(a)]
    d.settle(a, held[1:], [])  # 20_000 stays held
    d._leases.compact()
    assert d._leases.references == 1
    clock.now += 10.1
    d.tick()
    assert d.counters.expired == 1


def test_a_vanished_instances_records_go_out_one_suspect_per_instance() -> None:
    d, tracker, _ = make()
    a = connect(d, "a", 10)
    d.add(records(0, 10))
    drain(a)
    others = [connect(d, name, 10) for name in "bcde"]
    d.close_session(a)  # it crashed holding all ten: any of them may be the pill
    d.add(records(10, 14))  # fresh records still flow beside the suspects
    delivered = 0
    while delivered < 14:
        progressed = False
        for s in others:
            got = drain(s)
            assert sum(1 for x in s.held.values() if x.suspect) <= 1
            d.settle(s, [x.offset for x in got], [])
            delivered += len(got)
            progressed = progressed or bool(got)
        assert progressed
    assert tracker.committable == 14


# --- redelivery backoff after a vanished instance or a lapsed lease ------------------------


def test_disconnects_back_off_so_the_limit_takes_the_span() -> None:
    # max_attempts 5, span 7 s: gaps 0, 1, 2, 4 s between the failed deliveries.
    clock = Clock()
    d, tracker, dead = make(max_attempts=5, span_s=7.0, clock=clock)
    d.add(records(0, 1))
    first_failure = None
    seen: list[int] = []
    for n in range(5):
        s = connect(d, f"i{n}", 1)
        while not (got := drain(s)):
            assert d.counters.delivered == len(seen)  # waiting out its gap: not delivered
            clock.now += 0.05
            d.tick()
        seen.extend(x.attempt for x in got)
        d.close_session(s)  # it crashed on it
        if first_failure is None:
            first_failure = clock.now
    assert seen == [1, 2, 3, 4, 5]
    assert [(x.attempts, x.record.offset) for x in dead] == [(5, 0)]
    assert first_failure is not None
    assert clock.now - first_failure >= 7.0
    d.dead_letter_written(dead[0])
    assert tracker.committable == 1


def test_the_first_redelivery_after_a_disconnect_is_immediate_and_waits_in_backoff_after() -> None:
    clock = Clock()
    d, _, _ = make(max_attempts=5, span_s=7.0, clock=clock)
    a = connect(d, "a", 1)
    d.add(records(0, 3))
    assert [(x.offset, x.attempt) for x in drain(a)] == [(0, 1)]
    d.close_session(a)  # it held only 0: blamed, and back at once as a suspect
    b = connect(d, "b", 1)
    assert [(x.offset, x.attempt) for x in drain(b)] == [(0, 2)]
    d.close_session(b)  # 0 failed twice: 1 s
    c = connect(d, "c", 3)
    assert [(x.offset, x.attempt) for x in drain(c)] == [(1, 1), (2, 1)]
    d.settle(c, [1, 2], [])
    assert drain(c) == []
    assert d.queued == 0
    clock.now += 1.0
    d.tick()
    got = drain(c)
    assert [(x.offset, x.attempt) for x in got] == [(0, 3)]
    assert c.held[0].suspect  # back from its backoff as a suspect
    assert c.suspects == 1


def test_a_lapsed_lease_backs_off_like_a_disconnect() -> None:
    clock = Clock()
    d, _, dead = make(max_attempts=3, span_s=5.0, clock=clock)  # gaps 0, 5 s
    a = connect(d, "a", 1)
    d.add(records(0, 1))
    assert [x.attempt for x in drain(a)] == [1]
    clock.now += 10.1
    d.tick()  # lapsed: redelivered at once
    assert [x.attempt for x in drain(a)] == [2]
    clock.now += 10.1
    d.tick()  # lapsed again: 5 s in backoff
    assert drain(a) == []
    clock.now += 4.9
    d.tick()
    assert drain(a) == []
    clock.now += 0.2
    d.tick()
    assert [x.attempt for x in drain(a)] == [3]
    assert d.counters.expired == 2
    assert not dead


def test_retry_nacks_keep_their_own_backoff() -> None:
    clock = Clock()
    d, _, _ = make(max_attempts=5, span_s=700.0, clock=clock)  # the span would be long
    a = connect(d, "a", 1)
    d.add(records(0, 1))
    drain(a)
    d.settle(a, [], [nack(0, "later", retry=True)])
    d.settle(a, [], [])
    clock.now += 1.0
    d.tick()
    assert [(x.offset, x.attempt) for x in drain(a)] == [(0, 2)]  # [retry] 1 s, not the span
    assert not a.held[0].suspect


def test_a_flapping_fleet_cannot_exhaust_healthy_messages() -> None:
    # 100 messages; 300 instances with 1 credit come and go in a row, each failing what it
    # took; then a healthy one settles everything: nothing was dead-lettered.
    clock = Clock()
    d, tracker, dead = make(max_attempts=5, span_s=6.0, clock=clock)
    d.add(records(0, 100))
    took = 0
    for n in range(300):
        s = connect(d, f"flap{n}", 1)
        took += len(drain(s))
        clock.now += 0.001  # 0.3 s for the whole storm, well inside the first gap
        d.tick()
        d.close_session(s)
    assert took == 200  # each failed twice: once redelivered at once, then backing off
    assert dead == []
    healthy = connect(d, "healthy", 100)
    while tracker.committable < 100:
        d.settle(healthy, [x.offset for x in drain(healthy)], [])
        clock.now += 0.05
        d.tick()
    assert dead == []
    assert clock.now - 100.0 < 6.0  # the longest wait was the second gap (3 x 6/7 s)


# --- failed-delivery counts across restarts -----------------------------------------------


def test_failures_counts_the_failed_deliveries_of_unsettled_records() -> None:
    clock = Clock()
    d, _, _ = make(max_attempts=5, span_s=0, clock=clock)
    a = connect(d, "a", 1)
    d.add(records(0, 3))
    drain(a)
    version = d.failures_version
    assert d.failures() == {}
    d.close_session(a)  # it held only 0: blamed
    assert d.failures() == {0: 1}
    assert d.failures_version > version
    b = connect(d, "b", 1)
    drain(b)  # 0, as a suspect
    d.settle(b, [0], [])
    drain(b)  # 1
    d.settle(b, [], [nack(1, "later", retry=True)])
    assert d.failures() == {1: 1}  # 0 settled: gone; the retry nack counts


def test_prior_failures_go_on_where_the_last_run_stopped() -> None:
    clock = Clock()
    d, tracker, dead = make(
        max_attempts=5, span_s=7.0, clock=clock, prior_failures={0: 2, 3: 5, 9: 1}
    )
    assert d.failures() == {0: 2, 3: 5, 9: 1}  # kept until fetched, so a checkpoint keeps them
    a = connect(d, "a", 10)
    d.add(records(0, 5))
    # 3 failed all five times before the restart: dead-lettered without a sixth delivery.
    assert [(x.record.offset, x.attempts) for x in dead] == [(3, 5)]
    assert dead[0].reason == "delivery attempts exhausted (5) before a proxy restart"
    assert [(x.offset, x.attempt) for x in drain(a)] == [(1, 1), (2, 1), (4, 1)]
    d.settle(a, [1, 2, 4], [])
    clock.now += 0.9
    d.tick()
    assert drain(a) == []  # 0 waits its gap after a second failure: 1 s
    clock.now += 0.2
    d.tick()
    assert [(x.offset, x.attempt) for x in drain(a)] == [(0, 3)]
    assert a.held[0].suspect
    d.settle(a, [0], [])
    d.dead_letter_written(dead[0])
    assert tracker.committable == 5
    assert d.failures() == {9: 1}


def test_prior_failures_of_a_settled_offset_are_dropped() -> None:
    d, _, _ = make(already_settled=(2,), prior_failures={2: 1, 3: 1})
    assert d.failures() == {3: 1}


def test_prior_failures_wait_for_their_key() -> None:
    clock = Clock()
    d, _, dead = make(ordering="key", max_attempts=3, span_s=0, clock=clock, prior_failures={1: 2})
    a = connect(d, "a", 10)
    d.add(key_records([b"k", b"k"]))
    assert [(x.offset, x.attempt) for x in drain(a)] == [(0, 1)]
    d.settle(a, [0], [])
    got = drain(a)
    assert [(x.offset, x.attempt) for x in got] == [(1, 3)]  # the count went on
    assert a.held[1].suspect
    d.close_session(a)
    assert [(x.record.offset, x.attempts) for x in dead] == [(1, 3)]


def test_the_count_of_failures_stays_bounded_without_readers() -> None:
    d, _, _ = make(max_attempts=5, span_s=0, max_messages=10)
    for start in range(0, 5000, 5):
        s = connect(d, "s", 5)
        d.add(records(start, start + 5))
        drain(s)
        d.close_session(s)  # each fails once...
        t = connect(d, "t", 5)
        while d.in_window:
            got = drain(t)
            d.settle(t, [x.offset for x in got], [])  # ...and is acked next
        d.close_session(t)
    assert len(d._window.carryover.counts) <= 2048
    assert d.failures() == {}


def test_streams_ended_by_a_shutdown_use_no_attempt() -> None:
    # The proxy stopping is not the messages' doing: nothing is counted (or persisted).
    d, _, dead = make(max_attempts=1, span_s=0)
    a = connect(d, "a", 3)
    d.add(records(0, 3))
    drain(a)
    d.stop_delivering()
    d.end_sessions()
    d.close_session(a)
    assert dead == []  # max_attempts 1: a counted failure would have dead-lettered them
    assert d.failures() == {}
    assert d.queued == 3
    assert d.in_flight == 0
    assert d.quiet.is_set()


def test_a_grant_changes_credits_without_revoking_what_is_held() -> None:
    d, _, _ = make()
    a = connect(d, "a", 2)
    d.add(records(0, 10))
    assert [x.offset for x in drain(a)] == [0, 1]
    d.grant(a, 5)  # raised: three more at once
    assert [x.offset for x in drain(a)] == [2, 3, 4]
    d.grant(a, 2)  # lowered below the 5 held: nothing taken back, nothing new
    assert drain(a) == []
    assert len(a.held) == 5
    d.settle(a, [0, 1, 2], [])  # holds 2: still not under the grant
    assert drain(a) == []
    d.settle(a, [3], [])  # holds 1: room for one
    assert [x.offset for x in drain(a)] == [5]
    d.release(a, [])  # stopping: a later grant sends nothing more
    d.grant(a, 10)
    assert a.credits == 0
    assert drain(a) == []


def test_a_contiguous_batch_and_a_batch_with_a_gap_fill_the_window_alike() -> None:
    """`add` takes a gapless batch in bulk (`_add_run`); the result is the per-record one:
    same entries, sizes, order of delivery, tracker state, and the oversized record is
    dead-lettered in both."""
    big = b"x" * ((1 << 20) - 64 * 1024 + 1)  # over server.max_frame_bytes - overhead
    outcomes = []
    for batch in (
        [*records(0, 3), Record("t", 0, 3, None, big, (), 0), *records(4, 8)],  # contiguous
        [*records(0, 3), Record("t", 0, 3, None, big, (), 0), *records(4, 7), *records(9, 10)],
    ):
        d, tracker, dead = make()
        session = connect(d, "a", 100)
        d.add(batch)
        offsets = [x.offset for x in drain(session)]
        outcomes.append((offsets, d.in_window, tracker.pending, [x.record.offset for x in dead]))
        assert d.window_bytes == sum(len(r.value or b"") for r in batch)
    contiguous, gapped = outcomes
    assert contiguous == ([0, 1, 2, 4, 5, 6, 7], 8, 8, [3])
    assert gapped == ([0, 1, 2, 4, 5, 6, 9], 8, 8, [3])


def test_a_crash_pill_among_16_in_flight_neighbours_costs_them_no_attempt() -> None:
    """Instances crash whenever they hold the pill; every healthy neighbour is acked on
    its first counted attempt, and the pill is dead-lettered after at most
    max_attempts + 1 crashes (its first crash, before it was a suspect, blames no one)."""
    d, tracker, dead = make(max_attempts=5, span_s=0)
    pill = 7
    d.add(records(0, 16))
    crashes = 0
    written = False
    for turn in range(100):
        s = connect(d, f"i{turn}", 16)
        crashed = False
        while not crashed and (got := drain(s)):
            if any(x.offset == pill for x in got):
                crashes += 1
                crashed = True
                d.close_session(s)  # the pill takes the instance and all it held down
            else:
                assert all(x.attempt == 1 for x in got), got  # healthy: never blamed
                d.settle(s, [x.offset for x in got], [])
        if not crashed:
            d.close_session(s)  # it holds nothing: a clean stop
        if dead and not written:  # its dead letter is durable: the commit may pass it
            d.dead_letter_written(dead[0])
            written = True
        if tracker.committable == 16:
            break
    assert [dl.record.offset for dl in dead] == [pill]
    assert dead[0].attempts == 5
    assert crashes <= 5 + 1
    assert tracker.committable == 16


def test_the_timers_sleep_while_the_window_is_empty_and_tick_once_records_come() -> None:
    """An idle partition costs no timer wake-ups: with nothing in the window nothing can come
    due, so `run_timers` waits for `add`; with records in it, leases expire on the tick."""
    clock = Clock()
    d, _, _ = make(clock=clock)
    a = connect(d, "a", 10)

    async def scenario() -> None:
        closing = asyncio.Event()
        timers = asyncio.create_task(d.run_timers(closing))
        await eventually(lambda: d.timers_asleep)
        d.add(records(0, 1))
        assert [x.offset for x in drain(a)] == [0]
        await eventually(lambda: not d.timers_asleep)
        assert d.settle(a, [0], []) == []
        await eventually(lambda: d.timers_asleep)  # empty again: asleep again
        d.add(records(1, 2))  # held, never settled: its lease must still expire
        clock.now += 11  # past the 10 s ack deadline
        await eventually(lambda: d.counters.expired == 1)
        closing.set()
        await asyncio.wait_for(timers, 10)

    asyncio.run(scenario())
