"""The lease holder's fencing against the in-memory lease store (real time, short leases)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.waiting import eventually
from triage_proxy.config.sections import OwnershipSettings
from triage_proxy.errors import OwnershipLost, StateError
from triage_proxy.pipeline.ownership import Ownership, OwnershipState, wall_ms
from triage_proxy.store.leases import Lease, MemoryLeases

LEASE = OwnershipSettings(lease_s=0.5, renew_interval_s=0.1)


def test_the_lease_lapses_locally_before_the_standby_may_take_it() -> None:
    """The store goes away: the holder stops at sent + lease - margin, before the wall-clock
    expiry a standby compares with."""

    async def scenario() -> None:
        store = MemoryLeases()
        # A 2 s lease, so a 0.4 s margin: the bound below leaves half of it to a loop
        # that fires the lapse late on a loaded machine (0.5 s left 50 ms), and a holder
        # that ignored the margin (stopping at the expiry itself) still fails it.
        holder = Ownership(store, OwnershipSettings(lease_s=2.0, renew_interval_s=0.1))
        assert await holder.acquire(asyncio.Event())
        assert holder.holding
        assert store.lease is not None
        until_ms = store.lease.until_ms
        store.down = True
        lost_at: list[int] = []
        await asyncio.wait_for(
            holder.keep(asyncio.Event(), lambda: lost_at.append(wall_ms())), timeout=10
        )
        assert holder.state is OwnershipState.LOST
        assert holder.lost.is_set()
        assert not holder.holding
        assert len(lost_at) == 1
        assert lost_at[0] <= until_ms - 1000 * holder.margin_s / 2
        assert store.calls > 2  # it kept trying while the store was down

    asyncio.run(scenario())


def test_renewal_keeps_it_and_a_takeover_ends_it() -> None:
    async def scenario() -> None:
        store = MemoryLeases()
        holder = Ownership(store, LEASE)
        assert await holder.acquire(asyncio.Event())
        lost: list[bool] = []
        first_until_ms = store.lease.until_ms if store.lease else 0
        keeping = asyncio.ensure_future(holder.keep(asyncio.Event(), lambda: lost.append(True)))
        # Past the first lease's end (and its margin): only renewals keep it now.
        await eventually(lambda: wall_ms() > first_until_ms + 100, within=5)
        assert holder.holding
        assert not lost
        store.lease = Lease("someone-else", wall_ms() + 10_000)  # a forged takeover
        await asyncio.wait_for(keeping, timeout=10)
        assert lost == [True]
        with pytest.raises(OwnershipLost):
            await holder.renew()

    asyncio.run(scenario())


def test_standby_waits_for_expiry_then_takes_over_and_honours_closing() -> None:
    async def scenario() -> None:
        store = MemoryLeases()
        store.lease = Lease("dead-holder", wall_ms() + 300)
        # A 20 s lease of its own: a standby that waited a lease (or its 1 s poll, twice)
        # past the expiry would fail the bound, which leaves a loaded machine seconds.
        standby = Ownership(store, OwnershipSettings(lease_s=20.0, renew_interval_s=0.1))
        started = time.monotonic()
        assert await standby.acquire(asyncio.Event())
        waited = time.monotonic() - started
        assert 0.25 < waited < 2.3
        assert store.lease is not None
        assert store.lease.owner == standby.owner

        other = Ownership(store, LEASE)
        closing = asyncio.Event()
        reads = store.calls
        waiting = asyncio.ensure_future(other.acquire(closing))
        await eventually(lambda: store.calls > reads)  # it read the lease standby holds
        assert other.state is OwnershipState.STANDBY
        assert not waiting.done()
        closing.set()
        assert await asyncio.wait_for(waiting, timeout=10) is False
        await standby.release()
        assert store.lease is None
        with pytest.raises(StateError):
            await standby.acquire(asyncio.Event())

    asyncio.run(scenario())


def test_the_group_fence_keeps_a_standby_waiting_and_stops_a_holder() -> None:
    """A pinned process's group fence (kafka/groups.py): while it names a reason the
    standby takes no lease; once clear it does; a holder whose fence names a reason after
    a renewal stops at once, and OwnershipLost says why. (The real fence against Tansu:
    tests/integration/test_group_fence.py.)"""

    async def scenario() -> None:
        store = MemoryLeases()
        reason: list[str | None] = ["group 'g' has live members"]
        asked = asyncio.Event()

        def fence() -> str | None:
            asked.set()
            return reason[0]

        holder = Ownership(store, LEASE, fence=fence)
        acquiring = asyncio.ensure_future(holder.acquire(asyncio.Event()))
        await asyncio.wait_for(asked.wait(), timeout=10)
        assert store.lease is None  # fenced: the lease was never taken
        assert not acquiring.done()
        reason[0] = None
        assert await asyncio.wait_for(acquiring, timeout=10)
        assert holder.holding
        lost: list[bool] = []
        keeping = asyncio.ensure_future(holder.keep(asyncio.Event(), lambda: lost.append(True)))
        reason[0] = "group 'g' has live members (stable)"
        await asyncio.wait_for(keeping, timeout=10)
        assert lost == [True]
        assert not holder.holding
        assert "group 'g' has live members" in str(holder.lost_error())

    asyncio.run(scenario())


def test_a_fence_that_does_not_answer_never_costs_the_lease() -> None:
    """A broker that does not answer the group question (the fence call hangs): the
    holder keeps renewing and holding, for several lease lengths."""

    async def scenario() -> None:
        import threading

        release = threading.Event()

        def hanging_fence() -> str | None:
            release.wait(10)
            return None  # no reason, if it ever answers

        store = MemoryLeases()
        holder = Ownership(store, LEASE, fence=hanging_fence)
        try:
            assert await asyncio.wait_for(holder.acquire(asyncio.Event()), timeout=2)
            lost: list[bool] = []
            closing = asyncio.Event()
            keeping = asyncio.ensure_future(holder.keep(closing, lambda: lost.append(True)))
            # Three lease lengths of renewals (a lost lease renews no more: this fails then).
            renewals = round(3 * LEASE.lease_s / LEASE.renew_every_s)
            calls = store.calls
            await eventually(lambda: store.calls >= calls + renewals, within=15)
            assert holder.holding
            assert not lost
            closing.set()
            await asyncio.wait_for(keeping, timeout=10)
        finally:
            release.set()

    asyncio.run(scenario())
