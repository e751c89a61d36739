"""The client's timers on a loop whose clock jumps (tests/unit/virtual_time.py).

The client reads no clock but its event loop's (`loop.time()`, `asyncio.sleep`,
`call_later`), so the VirtualClockLoop the proxy's timing tests use drives it too: a wait
of an hour passes at once, and what must not happen yet is checked at an exact instant.
Sync handlers run in the pool's own threads, which do not hold that clock: these tests
drive a stream's timers without handler threads.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from tests.unit import virtual_time
from tests.unit.test_client_settle import finish, stream
from triage_client.stream import LOWERED_GRACE_S


def test_a_running_handler_is_extended_every_third_of_the_deadline_and_an_idle_one_not() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        s = stream(credits=8, held=1, results=0)
        deadline = loop.create_future()
        deadline.set_result(150)  # ms: an Extend every 50 ms while a handler runs
        ticker = asyncio.create_task(s._writer.extend_loop(deadline))
        await asyncio.sleep(0.049)
        finish(s, [], running=1)
        await asyncio.sleep(0.0005)
        assert not s._writer.extend_due, "extended before a third of the deadline"
        await asyncio.sleep(0.001)
        assert s._writer.extend_due, "not extended at a third of the deadline"
        s._writer.extend_due = False
        await asyncio.sleep(0.049)
        assert not s._writer.extend_due
        await asyncio.sleep(0.002)
        assert s._writer.extend_due, "the next tick did not extend"
        s._writer.extend_due = False
        s.account.running = 0  # the handler finished
        await asyncio.sleep(20 * 0.05)  # twenty ticks (each one a loop turn: not an hour)
        assert not s._writer.extend_due, "extended with no handler running"
        ticker.cancel()

    virtual_time.run(body())


def test_without_an_ack_deadline_nothing_is_ever_extended() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        s = stream(credits=8, held=1, results=0)
        finish(s, [], running=1)
        deadline = loop.create_future()
        deadline.set_result(0)  # the Welcome sets no deadline: leases never lapse
        ticker = asyncio.create_task(s._writer.extend_loop(deadline))
        await asyncio.sleep(24 * 3600)  # a handler running for a day
        assert ticker.done(), "a ticker runs with nothing to extend"
        assert not s._writer.extend_due

    virtual_time.run(body())


def test_a_lowering_lets_the_old_credits_arrive_for_lowered_grace_s_of_loop_time() -> None:
    """Deliveries the proxy decided under credits since lowered may still arrive for
    LOWERED_GRACE_S; after that the stream allows only its credits (the over-credit warning).
    Measured on the loop's clock, so a virtual one drives it."""

    async def body() -> None:
        s = stream(credits=8, held=0, results=0)
        s.loop = asyncio.get_running_loop()
        s.grants, s.call, s._allowed = True, cast(Any, object()), 8
        s.set_credits(3)
        await asyncio.sleep(LOWERED_GRACE_S - 0.001)
        s.load()
        assert s._allowed == 8, "the grace ended early"
        await asyncio.sleep(0.001)
        s.load()
        assert s._allowed == 3, "the grace never ended"

    virtual_time.run(body())
