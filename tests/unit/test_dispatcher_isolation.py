"""Isolated deliveries (Hello.isolation): the dispatcher's side, with the real Outbox."""

from __future__ import annotations

from tests.unit.test_dispatcher import frames_of, make, records
from triage_protocol import triage_pb2 as pb
from triage_proxy.pipeline.dispatch import Dispatcher, Session
from triage_proxy.server.outbox import Outbox


def isolating(d: Dispatcher, consumer_id: str, credits: int) -> Session:
    """A session as the service opens one for a Hello that set `isolation`."""
    return d.open_session(
        consumer_id, credits, Outbox("t", d.partition, 1 << 20, False), isolating=True
    )


def take(session: Session) -> tuple[list[pb.Delivery], list[int]]:
    """What `session` was sent: the deliveries, and the offsets flagged isolated."""
    deliveries: list[pb.Delivery] = []
    flagged: list[int] = []
    for frame in frames_of(session):
        assert frame is not None
        deliveries.extend(frame.deliveries.deliveries)
        if frame.deliveries.isolated:
            assert len(frame.deliveries.deliveries) == 1  # alone in its frame
            flagged.extend(frame.deliveries.isolated)
    return deliveries, flagged


def test_a_suspect_goes_alone_flagged_and_only_a_started_one_is_blamed() -> None:
    d, _, _ = make(max_attempts=5, span_s=0)
    d.add(records(0, 4))
    a = isolating(d, "a", 10)
    got, flagged = take(a)
    assert [x.offset for x in got] == [0, 1, 2, 3]
    assert flagged == []  # first deliveries are not suspects
    d.close_session(a)  # several held, none started: nobody blamed
    b = isolating(d, "b", 10)
    got, flagged = take(b)
    assert flagged == [0]  # one suspect per instance, alone and flagged
    assert [x.attempt for x in got if x.offset == 0] == [1]  # the crash cost no attempt
    d.close_session(b)  # 0 held, flagged but never started: not blamed
    c = isolating(d, "c", 10)
    got, flagged = take(c)
    assert len(flagged) == 1
    assert [x.attempt for x in got] == [1]
    d.started(c, flagged)
    d.close_session(c)  # it started that one: it is blamed, the others are not
    e = isolating(d, "e", 10)
    attempts: dict[int, int] = {}
    while True:  # every record is a suspect now: one at a time
        got, _ = take(e)
        if not got:
            break
        attempts.update((x.offset, x.attempt) for x in got)
        d.settle(e, [x.offset for x in got], [])
    assert attempts == {o: 2 if o == flagged[0] else 1 for o in range(4)}


def test_a_lone_delivery_of_an_isolating_instance_is_not_blamed() -> None:
    """An older client's lone delivery is blamed; an isolating one's is not (it may be the
    neighbour of a pill on another of its process's streams): it comes back a suspect."""
    for iso, expected in ((True, 1), (False, 2)):
        d, _, _ = make(max_attempts=5, span_s=0)
        d.add(records(0, 1))
        a = isolating(d, "a", 1) if iso else d.open_session("a", 1, Outbox("t", 0, 1 << 20, False))
        take(a)
        d.close_session(a)
        b = isolating(d, "b", 1)
        got, flagged = take(b)
        assert [(x.offset, x.attempt) for x in got] == [(0, expected)]
        assert flagged == [0]


def test_started_is_ignored_for_what_is_not_a_held_suspect() -> None:
    d, _, _ = make(max_attempts=5, span_s=0)
    d.add(records(0, 2))
    a = isolating(d, "a", 10)
    take(a)
    d.started(a, [0, 1, 99])  # not suspects (first deliveries), 99 not held
    assert a.started == set()
    old = d.open_session("old", 10, Outbox("t", 0, 1 << 20, False))
    d.started(old, [0])  # an older client's session never isolates
    assert old.started == set()


def test_a_crash_pill_among_16_in_flight_neighbours_of_an_isolating_process() -> None:
    """Instances crash whenever they start the pill; each reports Started for its isolated
    delivery before running it. Healthy neighbours are never blamed, the pill is
    dead-lettered after at most max_attempts + 1 crashes."""
    d, tracker, dead = make(max_attempts=5, span_s=0)
    pill = 7
    d.add(records(0, 16))
    crashes = 0
    written = False
    for turn in range(200):
        s = isolating(d, f"i{turn}", 16)
        crashed = False
        while not crashed:
            got, flagged = take(s)
            if not got:
                break
            d.started(s, flagged)
            if any(x.offset == pill for x in got):
                crashes += 1
                crashed = True
                d.close_session(s)
            else:
                assert all(x.attempt == 1 for x in got), got
                d.settle(s, [x.offset for x in got], [])
        if not crashed:
            d.close_session(s)
        if dead and not written:  # its dead letter is durable: the commit may pass it
            d.dead_letter_written(dead[0])
            written = True
        if tracker.committable == 16:
            break
    assert [dl.record.offset for dl in dead] == [pill]
    assert dead[0].attempts == 5
    assert crashes <= 5 + 1
    assert tracker.committable == 16


def test_a_blocking_suspect_says_it_waits_for_its_turn_not_for_credit_or_a_handler() -> None:
    """After a consumer crash every record it held is a suspect: an instance takes one at a
    time, and its process runs one at a time. /status must not say the others wait for "an
    instance with credit" (the instance has credit) or "a handler" (none runs them)."""
    d, _, _ = make(max_attempts=5, span_s=0)
    d.add(records(0, 3))
    a = isolating(d, "a", 10)
    take(a)
    d.close_session(a)  # it crashed holding all three: all suspects, none blamed
    b = isolating(d, "b", 10)
    assert take(b)[1] == [0]
    c = isolating(d, "c", 10)
    assert take(c)[1] == [1]
    d.close_session(b)  # never started 0: not blamed, queued again; c holds a suspect
    blocking = d.blocking
    assert blocking is not None
    assert (blocking.offset, blocking.state, blocking.holder) == (0, "ready", None)
    assert c.available > 0
    assert blocking.waiting_for == "its turn as a suspect"
    assert blocking.to_json(0.0)["suspect"] is True

    d.settle(c, [1], [])
    assert take(c)[1] == [0]  # smallest offset first: c's turn for 0, not yet started
    blocking = d.blocking
    assert blocking is not None
    assert (blocking.offset, blocking.state, blocking.holder) == (0, "held", "c")
    assert blocking.waiting_for == "its turn in the consumer process"
    d.started(c, [0])  # the process's turn came: now a handler runs it
    blocking = d.blocking
    assert blocking is not None
    assert blocking.waiting_for == "a handler"


def test_a_blamed_suspect_back_from_its_backoff_goes_before_the_later_suspects() -> None:
    """A crash pill blocks the commit at the smallest offset. Back from its redelivery gap
    it must not wait behind every other suspect of its partition (after a crash, all the
    deliveries the process held, each run one at a time): measured on a local fleet, the
    pill's third delivery came 55 s after its second, not after the 8.6 s gap. Suspects go
    out in offset order."""
    d, tracker, dead = make(max_attempts=5, span_s=0)  # no gaps: back at once
    d.add(records(0, 10))
    a = isolating(d, "a", 10)
    take(a)
    d.close_session(a)  # crashed holding all ten: all suspects, none blamed
    b = isolating(d, "b", 10)
    assert take(b)[1] == [0]
    d.started(b, [0])
    d.close_session(b)  # the pill crashed it again: 0 is blamed and comes back
    c = isolating(d, "c", 10)
    order: list[int] = []
    while True:
        got, flagged = take(c)
        if not got:
            break
        order += flagged
        d.settle(c, [x.offset for x in got], [])
    assert order == list(range(10))  # 0 first again, not after 1..9
    assert not dead
    assert tracker.committable == 10


def test_the_neighbours_of_a_blamed_isolated_pill_go_out_beside_it_not_one_at_a_time() -> None:
    """The pill, a suspect its process started, crashes it holding 15 fresh records: it
    is blamed and they go back as ordinary deliveries, so the next process gets them all
    at once, unflagged and at their first counted attempt, beside the pill. The pill goes
    out again at once and crashes that process too: blamed on the same record, they stay
    ordinary. A crash nothing explains makes them suspects, one per instance again."""
    d, _, dead = make(max_attempts=5, span_s=0)
    d.add(records(0, 1))
    a = isolating(d, "a", 16)
    take(a)
    d.close_session(a)  # the pill's first crash, nothing started: it is a suspect
    d.add(records(1, 16))
    b = isolating(d, "b", 16)
    got, flagged = take(b)
    assert flagged == [0]
    assert sorted(x.offset for x in got) == list(range(16))
    d.started(b, flagged)
    d.close_session(b)  # blamed on 0; 1..15 acquitted

    for name in ("c", "e"):
        s = isolating(d, name, 16)
        got, flagged = take(s)
        assert flagged == [0]  # the pill, alone and flagged
        neighbours = sorted((x.offset, x.attempt) for x in got if x.offset != 0)
        assert neighbours == [(o, 1) for o in range(1, 16)]  # all at once, no attempt used
        d.started(s, flagged)
        d.close_session(s)  # blamed on 0 again
    assert len(dead) == 0

    f = isolating(d, "f", 16)
    got, flagged = take(f)
    assert flagged == [0]
    assert sorted(x.offset for x in got) == [0]  # 1..15 were acquitted twice: suspects now
    d.settle(f, [0], [])  # say the pill was handled this time
    got, flagged = take(f)
    assert [x.offset for x in got] == flagged == [1]  # one suspect at a time again


def test_an_older_clients_crash_blamed_on_its_suspect_acquits_no_one() -> None:
    """An older client runs its one suspect beside the others: that is weaker evidence, so
    the others of its crash come back as suspects, one per instance."""
    d, _, _ = make(max_attempts=5, span_s=0)
    d.add(records(0, 1))
    a = d.open_session("a", 4, Outbox("t", 0, 1 << 20, False))
    take(a)
    d.close_session(a)  # its lone delivery: blamed, back as a suspect
    d.add(records(1, 4))
    b = d.open_session("b", 4, Outbox("t", 0, 1 << 20, False))
    assert sorted(x.offset for x in take(b)[0]) == [0, 1, 2, 3]
    d.close_session(b)  # blamed on its suspect 0; 1..3 are suspects
    c = d.open_session("c", 4, Outbox("t", 0, 1 << 20, False))
    assert len(take(c)[0]) == 1
