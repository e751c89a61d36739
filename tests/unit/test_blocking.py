"""What blocks a partition's commit, as /status says it: the dispatcher's smallest
unsettled record, its state in words, holder and attempt (pure: the real dispatcher and
tracker, a hand-moved clock)."""

from __future__ import annotations

from tests.unit.test_dispatcher import Clock, connect, make, nack, records
from triage_proxy.observe.snapshot import BLOCKING_REASONS, Blocking, ProxySnapshot
from triage_proxy.pipeline.dispatch.window import EntryState


def test_nothing_blocks_an_empty_window() -> None:
    d, _, _ = make()
    assert d.blocking is None


def test_the_smallest_unsettled_offset_blocks_with_what_it_waits_for() -> None:
    clock = Clock()
    d, _, _ = make(clock=clock, max_attempts=3)
    d.add(records(0, 3))
    first = d.blocking
    assert first is not None
    assert (first.offset, first.state, first.holder, first.attempt) == (0, "ready", None, 0)

    s = connect(d, "worker-1", 3)  # delivered: a handler holds it
    held = d.blocking
    assert held is not None
    assert (held.offset, held.state, held.holder, held.attempt) == (0, "held", "worker-1", 1)

    d.settle(s, [0], [])
    moved = d.blocking
    assert moved is not None
    assert moved.offset == 1  # the commit moved past 0

    d.settle(s, [], [nack(1, retry=True)])  # retry: it waits out a backoff
    backoff = d.blocking
    assert backoff is not None
    assert (backoff.offset, backoff.state, backoff.holder) == (1, "backoff", None)
    assert backoff.attempt == 1


def test_a_nacked_record_blocks_until_its_dead_letter_is_written() -> None:
    d, _, dead = make()
    d.add(records(0, 1))
    s = connect(d, "w", 1)
    d.settle(s, [], [nack(0, "cannot parse")])
    blocking = d.blocking
    assert blocking is not None
    assert blocking.state == "dead_lettering"
    d.dead_letter_written(dead[0])
    assert d.blocking is None


def test_status_json_ages_it_and_says_it_in_words() -> None:
    blocking = Blocking(offset=7, state="held", fetched_at=100.0, attempt=2, holder="w-1")
    doc = blocking.to_json(112.3456)
    assert doc == {
        "offset": 7,
        "state": "held",
        "waiting_for": "a handler",
        "age_s": 12.346,
        "attempt": 2,
        "holder": "w-1",
        "suspect": False,
    }
    snap = ProxySnapshot(topic="t", partition=0, state="running", ready=True, grpc_port=1,
                         blocking=blocking, taken_at=101.0)  # fmt: skip
    assert snap.to_json()["blocking"]["age_s"] == 1.0
    assert "taken_at" not in snap.to_json()
    assert ProxySnapshot(topic="t", partition=0, state="running", ready=True,
                         grpc_port=1).to_json()["blocking"] is None  # fmt: skip


def test_every_window_state_has_words() -> None:
    assert set(BLOCKING_REASONS) == {state.value for state in EntryState}
