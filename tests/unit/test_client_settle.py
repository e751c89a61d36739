"""When a stream sends the settlements its sync handlers' results gave it (after_settle), and
that the pool's tick keeps coming for results that wait for company."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from tests.unit import virtual_time
from triage_client import Message
from triage_client.pool import SETTLE_DELAY_S, HandlerPool
from triage_client.stream import PartitionStream, StreamContext
from triage_client.writer import SETTLE_TICKS


def stream(
    credits: int,
    held: int,
    results: int,
    *,
    stopping: bool = False,
    pool: HandlerPool | None = None,
) -> PartitionStream:
    """A stream with `credits`, `held` unsettled deliveries of which `results` are done."""
    ctx = StreamContext(
        consumer_id="test",
        metadata=(),
        pool=HandlerPool(lambda m: None, 8, (), 16) if pool is None else pool,
        stopping=asyncio.Event(),
        max_backoff=1.0,
        allowed=None,
        consume=cast(Any, None),
        credits=lambda s: credits,
        refresh=lambda: None,
    )
    if stopping:
        ctx.stopping.set()
    s = PartitionStream(ctx, 0, "localhost:1")
    s.credits, s.received, s._writer.batch_limit = credits, held, credits
    finish(s, list(range(results)))
    return s


def finish(s: PartitionStream, offsets: list[int], *, running: int = 0) -> None:
    """Handlers of `s` acked `offsets` (on the loop) while `running` more run on."""
    ledger = s._ctx.pool.ledger
    count = len(offsets) + running
    ledger.queue(s.account, [Message("t", 0, 1000 + i, None, b"", [], 0, 1) for i in range(count)])
    for offset in offsets:
        picked = ledger.pick()
        assert picked is not None
        ledger.finished(s.account, s.account.epoch, s.account.running, offset, None)
    for _ in range(running):
        assert ledger.pick() is not None


def ticks_until_sent(s: PartitionStream, *, queue_drained: bool = False) -> int:
    for tick in range(1, 100):
        waits = s.after_settle(queue_drained, due=True)
        if s._writer.wanted.is_set():
            assert not waits
            return tick
        assert waits, "a result neither sent nor waiting for a tick would be stranded"
    pytest.fail("results never sent")


def test_a_few_results_wait_for_company_over_several_ticks() -> None:
    assert ticks_until_sent(stream(credits=40, held=30, results=2)) == SETTLE_TICKS


def test_results_tying_up_a_quarter_of_the_credits_go_on_the_next_tick() -> None:
    assert ticks_until_sent(stream(credits=40, held=30, results=10)) == 1


def test_results_the_proxy_needs_credits_from_go_at_once() -> None:
    s = stream(credits=16, held=9, results=1)  # the proxy may send 7 more: under half
    assert s.after_settle(True) is False
    assert s._writer.wanted.is_set()


def test_a_full_batch_goes_at_once() -> None:
    s = stream(credits=16, held=16, results=16)
    assert s.after_settle(False) is False
    assert s._writer.wanted.is_set()


def test_nothing_waits_once_stop_began() -> None:
    assert ticks_until_sent(stream(credits=40, held=30, results=1, stopping=True)) == 1


def test_the_count_of_ticks_waited_starts_again_after_a_flush() -> None:
    s = stream(credits=40, held=30, results=2)
    assert ticks_until_sent(s) == SETTLE_TICKS
    s._writer.wanted.clear()
    s._writer.ticks_waited = 0  # what _flush does when it sends
    assert ticks_until_sent(s) == SETTLE_TICKS


def test_the_pool_keeps_ticking_while_a_stream_waits_for_company() -> None:
    """A result arrives while another handler runs on, and no other result follows: the tick
    must come back until the stream sends it, or it would wait for that handler. On a loop
    whose clock jumps (the client reads only the loop's clock), so the instants are exact:
    not sent half a tick before the SETTLE_TICKS-th tick, sent half a tick after it."""

    async def body() -> None:
        loop = asyncio.get_running_loop()
        s = stream(credits=40, held=1, results=0)
        pool = s._ctx.pool
        pool._loop = loop
        s.loop = loop
        finish(s, [], running=2)
        pool.ledger.vacate(s.account, s.account.running, 1000)  # offset 7 finished
        pool._results.append((s.account, s.account.epoch, 7, None))  # another runs on
        pool._collect()
        await asyncio.sleep((SETTLE_TICKS - 0.5) * SETTLE_DELAY_S)
        assert not s._writer.wanted.is_set(), "sent before it waited SETTLE_TICKS ticks"
        assert pool._tick is not None, "the pool stopped ticking for the waiting result"
        await asyncio.sleep(SETTLE_DELAY_S)
        assert s._writer.wanted.is_set(), "the waiting result was never sent"
        assert s.account.acks == [7]
        assert pool.outstanding == 1
        await pool.close(clean=True)

    virtual_time.run(body())


@pytest.mark.parametrize("batches", [1, 2, 3])
def test_a_slot_that_runs_dry_after_whole_batches_counts_as_idle(batches: int) -> None:
    """Async handlers that never suspend yield to the loop every `batch_limit` deliveries. A
    queue of exactly a multiple of that must still count as a slot running dry, or the
    default prefetch never grows (bench_throughput: 512 credits over a batch of 256, so the
    window stayed at 512 and every Settle waited a round trip for its refill)."""

    async def body() -> None:
        loop = asyncio.get_running_loop()
        handled: list[int] = []

        async def handler(message: Message) -> None:
            handled.append(message.offset)

        pool = HandlerPool(handler, 1, (), 4)
        s = stream(credits=64, held=0, results=0, pool=pool)
        s.loop = loop
        pool.start(loop)
        count = 4 * batches
        pool.submit(s.account, [Message("t", 0, i, None, b"", [], 0, 1) for i in range(count)])
        deadline = loop.time() + 10
        while len(handled) < count or not pool._idle_workers:
            assert loop.time() < deadline, f"handled {len(handled)} of {count}"
            await asyncio.sleep(0.001)
        assert pool.ledger.take_idled() == 1
        await pool.close(clean=True)

    asyncio.run(body())
