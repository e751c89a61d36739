"""The ledger of deliveries in hand (triage_client.ledger): pure state, driven call by call."""

from __future__ import annotations

from typing import Any, cast

from triage_client import Message
from triage_client.ledger import RELEASE, UNCAPPED, Account, Ledger
from triage_protocol import triage_pb2


def messages(*offsets: int) -> list[Message]:
    return [Message("t", 0, o, None, b"", [], 0, 1) for o in offsets]


def opened(ledger: Ledger, name: str) -> Account:
    return ledger.open(cast(Any, name))


def run(ledger: Ledger, account: Account, nack: triage_pb2.Nack | None = None) -> int:
    """Pick the next delivery, which must be `account`'s, and finish it (async handlers)."""
    picked = ledger.pick()
    assert picked is not None
    assert picked[0] is account
    offset = picked[1].offset
    ledger.finished(account, account.epoch, account.running, offset, nack)
    return offset


def test_queued_deliveries_are_outstanding_and_leased() -> None:
    ledger = Ledger()
    a = opened(ledger, "a")
    ledger.queue(a, messages(3, 4, 5))
    assert (ledger.outstanding, ledger.queued, a.outstanding) == (3, 3, 3)
    assert a.running == {3, 4, 5}
    assert ledger.ready == [a]
    assert ledger.leases(a) == [3, 4, 5]


def test_an_empty_batch_leaves_the_stream_not_ready() -> None:
    ledger = Ledger()
    a = opened(ledger, "a")
    ledger.queue(a, [])
    assert ledger.ready == []
    assert ledger.pick() is None


def test_a_finished_delivery_leaves_its_slot_and_lease_and_waits_to_be_sent() -> None:
    ledger = Ledger()
    a = opened(ledger, "a")
    ledger.queue(a, messages(0, 1))
    picked = ledger.pick()
    assert picked is not None
    assert (a.busy, ledger.queued, a.running) == (1, 1, {0, 1})
    assert ledger.finished(a, a.epoch, a.running, 0, None) is False, "offset 1 is queued"
    assert (a.busy, a.outstanding, ledger.outstanding, a.running, a.acks) == (0, 1, 1, {1}, [0])
    nack = triage_pb2.Nack(offset=1, reason="E: x")
    assert ledger.pick() is not None
    assert ledger.finished(a, a.epoch, a.running, 1, nack) is True, "nothing queued behind it"
    assert ledger.take_settlements(a) == ([0], [nack])
    assert (a.acks, a.nacks, ledger.outstanding) == ([], [], 0)


def test_the_stream_with_the_fewest_running_goes_first_and_ties_go_round_robin() -> None:
    ledger = Ledger()
    a, b = opened(ledger, "a"), opened(ledger, "b")
    ledger.queue(a, messages(0, 1, 2, 3))
    ledger.queue(b, messages(10, 11, 12, 13))
    order: list[Account] = []  # accounts: their `stream` is a stand-in name (`opened`)
    for _ in range(4):
        picked = ledger.pick()
        assert picked is not None
        order.append(picked[0])
    assert order == [a, b, a, b]
    assert (a.busy, b.busy) == (2, 2)
    ledger.finished(b, b.epoch, b.running, 10, None)
    picked = ledger.pick()
    assert picked is not None
    assert picked[0] is b, "b runs fewer now"


def test_a_stream_at_its_cap_waits_while_a_slot_is_free() -> None:
    ledger = Ledger()
    a = opened(ledger, "a")
    assert a.slots == UNCAPPED
    assert ledger.set_slots([a], [1]) is False, "a lowered cap puts no idle slot to work"
    ledger.queue(a, messages(0, 1))
    assert ledger.pick() is not None
    assert ledger.pick() is None
    assert ledger.set_slots([a], [2]) is True
    assert ledger.pick() is not None


def test_a_result_from_an_ended_connection_is_dropped() -> None:
    ledger = Ledger()
    a = opened(ledger, "a")
    ledger.queue(a, messages(0, 1, 2))
    picked = ledger.pick()
    assert picked is not None
    epoch, running = a.epoch, a.running
    assert [m.offset for m in ledger.take_back(a, next_epoch=True)] == [1, 2]
    assert (a.epoch, a.outstanding, ledger.outstanding, ledger.queued) == (epoch + 1, 0, 1, 0)
    assert a.running == set(), "the next connection starts with a fresh lease set"
    assert ledger.ready == []
    ledger.queue(a, messages(0))  # the proxy redelivers offset 0 on the next connection
    ledger.finished(a, epoch, running, 0, None)
    assert a.running == {0}, "the late handler left the next connection's lease alone"
    assert (a.acks, a.dropped, a.outstanding, ledger.outstanding) == ([], 1, 1, 1)


def test_taking_back_at_stop_keeps_the_running_ones() -> None:
    ledger = Ledger()
    a = opened(ledger, "a")
    ledger.queue(a, messages(0, 1, 2))
    assert ledger.pick() is not None
    assert [m.offset for m in ledger.take_back(a)] == [1, 2]
    assert (a.outstanding, ledger.outstanding, a.running, a.epoch) == (1, 1, {0}, 0)
    ledger.release(a, [1, 2])
    assert ledger.take_releases(a) == [1, 2]
    assert a.releases == []


def test_handler_threads_results_are_collected_on_the_loop() -> None:
    ledger = Ledger()
    a, b = opened(ledger, "a"), opened(ledger, "b")
    ledger.queue(a, messages(0, 1, 2))
    ledger.queue(b, messages(7))
    results = []
    for _ in range(4):
        picked = ledger.pick()
        assert picked is not None
        account, message = picked
        ledger.vacate(account, account.running, message.offset)
        results.append((account, account.epoch, message.offset, message))
    assert (a.busy, b.busy, ledger.outstanding) == (0, 0, 4), "slots free, results not in yet"
    nack = triage_pb2.Nack(offset=1, reason="E: x")
    verdicts = {0: None, 1: nack, 2: RELEASE, 7: None}
    touched: dict[Account, None] = {}
    ledger.collect([(acc, ep, off, verdicts[off]) for acc, ep, off, _ in results], touched)
    assert list(touched) == [a, b]
    assert (a.acks, a.nacks, a.releases, a.dropped) == ([0], [nack], [2], 1)
    assert (b.acks, ledger.outstanding, a.outstanding, b.outstanding) == ([7], 0, 0, 0)


def test_a_stale_thread_result_is_dropped_when_collected() -> None:
    ledger = Ledger()
    a = opened(ledger, "a")
    ledger.queue(a, messages(0))
    picked = ledger.pick()
    assert picked is not None
    epoch = a.epoch
    ledger.vacate(a, a.running, 0)
    ledger.take_back(a, next_epoch=True)
    ledger.collect([(a, epoch, 0, None)], {})
    assert (a.acks, a.dropped, ledger.outstanding) == ([], 1, 0)


def test_a_handler_that_raised_past_the_pool_leaves_its_slot_but_stays_outstanding() -> None:
    ledger = Ledger()
    a = opened(ledger, "a")
    ledger.queue(a, messages(0))
    assert ledger.pick() is not None
    ledger.vacate(a, a.running, 0)
    assert (a.busy, a.running, a.acks, ledger.outstanding) == (0, set(), [], 1)


def test_unsent_results_are_forgotten_when_the_connection_ends() -> None:
    ledger = Ledger()
    a = opened(ledger, "a")
    ledger.queue(a, messages(0, 1))
    run(ledger, a)
    run(ledger, a, triage_pb2.Nack(offset=1))
    ledger.release(a, [5])
    assert ledger.forget(a) == 2
    assert (a.acks, a.nacks, a.releases) == ([], [], [])


def test_idle_slots_are_counted_until_taken() -> None:
    ledger = Ledger()
    ledger.idle()
    ledger.idle()
    assert ledger.idled == 2
    assert ledger.take_idled() == 2
    assert ledger.take_idled() == 0
