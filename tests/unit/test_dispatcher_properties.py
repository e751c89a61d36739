"""Hypothesis: the dispatcher's promises hold under any interleaving of events."""

from __future__ import annotations

from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.unit.test_dispatcher import connect, frames_of
from triage_protocol import triage_pb2 as pb
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.pipeline.dispatch import Dispatcher, Session
from triage_proxy.pipeline.dispatch.window import NOT_ACQUITTED
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.server.outbox import Outbox
from triage_proxy.structs import DeadLetter, Record

KEYS = [b"a", b"b", b"c", None]


class DispatcherMachine(RuleBasedStateMachine):
    """Random fetches, acks, nacks, retries, expiries, disconnects and releases."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        raw = {
            "kafka": {"bootstrap_servers": "b", "topic": "t", "group_id": "g"},
            "auth": {"token": "unit-test-token-0123"},
            "dead_letters": {"table": "dlq"},
            "window": {"max_messages": 40},
            "delivery": {
                "max_attempts": 3,
                "ack_deadline_s": 5,
                "ordering": "key",
                "redelivery_span_s": 4,  # gaps 0 and 4 s after vanished instances
            },
            "retry": {"initial_backoff_s": 1, "max_backoff_s": 2},
        }
        self.tracker = CommitTracker(0)
        self.dead: list[DeadLetter] = []
        self.d = Dispatcher(
            settings_from_dict(raw, {}),
            0,
            self.tracker,
            self.dead.append,
            monotonic=lambda: self.now,
        )
        self.sessions: list[Session] = []
        self.next_offset = 0
        self.keys: dict[int, bytes | None] = {}
        self.first_delivery: list[int] = []  # offsets in the order first delivered
        self.settled: set[int] = set()

    def _drain(self) -> None:
        for s in self.sessions:
            for frame in frames_of(s):
                if frame is None:
                    continue
                for d in frame.deliveries.deliveries:
                    if d.attempt == 1 and d.offset not in self.first_delivery:
                        self.first_delivery.append(d.offset)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5))
    def fetch(self, keys: list[bytes | None]) -> None:
        room = self.d.room_for
        records = []
        for key in keys[:room]:
            records.append(Record("t", 0, self.next_offset, key, b"v", (), 0))
            self.keys[self.next_offset] = key
            self.next_offset += 1
        self.d.add(records)
        self._drain()

    @rule(credits=st.integers(1, 4))
    def connect(self, credits: int) -> None:
        self.sessions.append(connect(self.d, f"i{len(self.sessions)}", credits))
        self._drain()

    @rule(credits=st.integers(1, 4))
    def connect_isolating(self, credits: int) -> None:
        """An instance whose Hello set `isolation` (its suspects go flagged, alone)."""
        outbox = Outbox("t", 0, 1 << 20, False)
        session = self.d.open_session(f"i{len(self.sessions)}", credits, outbox, isolating=True)
        self.sessions.append(session)
        self._drain()

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def report_started(self, data: st.DataObject) -> None:
        """An isolating instance's process starts the suspect it holds (Started)."""
        s = data.draw(st.sampled_from(self.sessions))
        self.d.started(s, [o for o, e in s.held.items() if e.suspect])

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def settle_some(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self.sessions))
        held = sorted(s.held)
        if not held:
            return
        chosen = data.draw(st.lists(st.sampled_from(held), unique=True, max_size=3))
        kind = data.draw(st.sampled_from(["ack", "range", "nack", "retry"]))
        if kind == "ack":
            self.d.settle(s, chosen, [])
            self.settled.update(chosen)
        elif kind == "range" and chosen:
            # One ack range over them: what it names and `s` does not hold is rejected.
            first, last = min(chosen), max(chosen)
            mine = [o for o in range(first, last + 1) if o in s.held]
            span = pb.OffsetRange(first=first, last=last)
            rejected = self.d.settle(s, [], [], [span])
            assert sorted(rejected) == [o for o in range(first, last + 1) if o not in mine]
            self.settled.update(mine)
        else:
            nacks = [pb.Nack(offset=o, reason="r", retry=kind == "retry") for o in chosen]
            self.d.settle(s, [], nacks)
        self._drain()

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def disconnect(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self.sessions))
        self.sessions.remove(s)
        self.d.close_session(s)
        self._drain()

    @rule(dt=st.floats(0.1, 6))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.d.tick()
        self._drain()

    @rule()
    def dead_letters_written(self) -> None:
        for dl in self.dead:
            self.d.dead_letter_written(dl)
            self.settled.add(dl.record.offset)
        self.dead.clear()
        self._drain()

    @invariant()
    def a_key_is_never_in_flight_twice(self) -> None:
        in_flight = [o for s in self.sessions for o in s.held]
        keys = [self.keys[o] for o in in_flight if self.keys[o] is not None]
        assert len(keys) == len(set(keys))

    @invariant()
    def same_key_goes_in_offset_order(self) -> None:
        for key in (b"a", b"b", b"c"):
            order = [o for o in self.first_delivery if self.keys[o] == key]
            assert order == sorted(order)

    @invariant()
    def credits_are_respected(self) -> None:
        for s in self.sessions:
            assert len(s.held) <= max(s.credits, 0)

    @invariant()
    def commit_never_passes_an_unsettled_offset(self) -> None:
        committable = self.tracker.committable
        assert all(o in self.settled for o in range(committable))

    @invariant()
    def an_instance_holds_at_most_one_suspect(self) -> None:
        for s in self.sessions:
            assert sum(1 for e in s.held.values() if e.suspect) == s.suspects <= 1

    @invariant()
    def a_suspect_is_never_acquitted_and_no_one_more_than_twice(self) -> None:
        for e in self.d._window.entries.values():
            assert not (e.suspect and e.acquittals != NOT_ACQUITTED)
            assert 0 <= e.acquittals[0] <= 2

    @invariant()
    def failed_counts_are_of_unsettled_records_within_the_limit(self) -> None:
        failures = self.d.failures()
        assert all(1 <= n <= 3 for n in failures.values())
        assert not set(failures) & self.settled

    @invariant()
    def window_is_bounded(self) -> None:
        assert self.d.in_window <= 40

    @invariant()
    def window_bytes_are_its_entries(self) -> None:
        window = self.d._window
        assert window.bytes == sum(e.size for e in window.entries.values())

    @invariant()
    def every_settlement_is_in_the_latency_histogram(self) -> None:
        counters = self.d.counters
        assert self.d.settle_latency.count == counters.acked + counters.nacked


DispatcherMachine.TestCase.settings = hsettings(max_examples=150, stateful_step_count=40)
TestDispatcherMachine = DispatcherMachine.TestCase
