"""The client library against the shared fake proxy (tests/fakeproxy.py), served: it sends
the Welcome and delivers what a test feeds it, honest about credits and leases. It runs on its
own thread and event loop, so `Consumer.run()` can block a test thread exactly as it blocks an
app."""

from __future__ import annotations

import asyncio
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar, cast

import grpc
import pytest

from tests.fakeproxy import TOKEN, WAIT_S, Deployment, FakeProxy, delivery
from triage_client import (
    AuthenticationError,
    Consumer,
    EndpointError,
    Message,
    PartitionError,
    Retry,
    StateError,
    follower,
    writer,
)
from triage_client.consumer import AUTO_PREFETCH_MAX
from triage_client.credits import IDLE_CREDITS, credit_share
from triage_client.message import make_message
from triage_client.pool import HandlerPool
from triage_client.pool import nack_reason as _reason
from triage_client.stream import backoff_delay
from triage_protocol.constants import MAX_REASON_CHARS


class Running:
    """Consumer.run() on a background thread, as an app's main thread would run it."""

    live: ClassVar[list[Running]] = []  # stopped by the proxy fixture, even if a test failed

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="consumer", daemon=True)
        self.thread.start()
        Running.live.append(self)

    def _run(self) -> None:
        try:
            self.consumer.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self.error = exc

    def join(self) -> None:
        self.thread.join(WAIT_S)
        if self.thread.is_alive():
            self.consumer.stop()
            pytest.fail("run() did not return")
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self.consumer.stop()
        self.join()


def stop_live_consumers() -> None:
    while Running.live:
        run = Running.live.pop()
        run.consumer.stop()
        run.thread.join(WAIT_S)


@pytest.fixture
def proxy() -> Iterator[FakeProxy]:
    fake = FakeProxy().start()
    yield fake
    stop_live_consumers()
    fake.close()


@pytest.fixture
def deployment() -> Iterator[Deployment]:
    """Three partitions; each test starts the proxies it needs and says who serves what."""
    fakes = Deployment(3)
    yield fakes
    stop_live_consumers()
    fakes.close()


def consumer(proxy: FakeProxy, handler: Any, **kwargs: Any) -> Consumer:
    kwargs.setdefault("consumer_id", "test-instance")
    return Consumer(proxy.target, TOKEN, handler, **kwargs)


def sync_and_async(body: Callable[[Message], None]) -> dict[str, Any]:
    """The same handler body, once as a plain function and once as a coroutine function."""

    def sync_handler(message: Message) -> None:
        body(message)

    async def async_handler(message: Message) -> None:
        body(message)

    return {"sync": sync_handler, "async": async_handler}


@pytest.mark.parametrize(
    ("concurrency", "prefetch", "credits"), [(3, None, 6), (3, 0, 3), (2, 5, 7)]
)
def test_hello_announces_concurrency_plus_prefetch_as_credits(
    proxy: FakeProxy, concurrency: int, prefetch: int | None, credits: int
) -> None:
    c = consumer(proxy, lambda m: None, concurrency=concurrency, prefetch=prefetch)
    run = Running(c)
    proxy.wait_for(lambda: proxy.hellos, "hello")
    run.stop()
    assert c.credits == credits
    assert [(h.consumer_id, h.credits) for h in proxy.hellos] == [("test-instance", credits)]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_return_acks_and_raise_nacks_with_reason(proxy: FakeProxy, kind: str) -> None:
    def body(message: Message) -> None:
        if message.offset == 1:
            raise ValueError("boom")

    proxy.feed(delivery(o) for o in range(3))
    run = Running(consumer(proxy, sync_and_async(body)[kind]))
    proxy.wait_for(lambda: len(proxy.acks) + len(proxy.nacks) == 3, "3 settlements")
    run.stop()
    assert sorted(proxy.acked()) == [0, 2]
    assert [(n.offset, n.reason, n.retry) for _, n in proxy.nacks] == [
        (1, "ValueError: boom", False)
    ]
    stats = run.consumer.stats
    assert (stats.delivered, stats.acked, stats.nacked) == (3, 2, 1)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_raising_retry_nacks_with_retry_flag(proxy: FakeProxy, kind: str) -> None:
    def body(message: Message) -> None:
        raise Retry("downstream busy")

    proxy.feed([delivery(7)])
    run = Running(consumer(proxy, sync_and_async(body)[kind]))
    proxy.wait_for(lambda: proxy.nacks, "the nack")
    run.stop()
    assert [(n.offset, n.reason, n.retry) for _, n in proxy.nacks] == [
        (7, "Retry: downstream busy", True)
    ]


class Abort(BaseException):
    """Not an Exception, like the cancellation errors of some frameworks."""


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_retry_on_exceptions_nack_with_retry_flag_and_others_do_not(
    proxy: FakeProxy, kind: str
) -> None:
    def body(message: Message) -> None:
        if message.offset == 0:
            raise ConnectionResetError("reset")  # an OSError: listed by its base class
        if message.offset == 1:
            raise ValueError("bad value")
        if message.offset == 2:
            raise Retry("busy")  # retried whatever retry_on says
        if message.offset == 3:
            raise Abort("gave up")

    proxy.feed(delivery(o) for o in range(5))
    run = Running(consumer(proxy, sync_and_async(body)[kind], retry_on=(OSError, Abort)))
    proxy.wait_for(lambda: len(proxy.acks) + len(proxy.nacks) == 5, "5 settlements")
    run.stop()
    assert proxy.acked() == [4]
    assert sorted((n.offset, n.reason, n.retry) for _, n in proxy.nacks) == [
        (0, "ConnectionResetError: reset", True),
        (1, "ValueError: bad value", False),
        (2, "Retry: busy", True),
        (3, "Abort: gave up", True),
    ]


def test_messages_are_byte_exact_including_none(proxy: FakeProxy) -> None:
    binary = bytes(range(256))
    headers: list[tuple[str, bytes | None]] = [("a", b"1"), ("a", None), ("b", b""), ("c", binary)]
    proxy.feed(
        [
            delivery(0, key=None, value=None),
            delivery(1, key=b"", value=b"", headers=headers, attempt=3, timestamp_ms=42),
            delivery(2, key=binary, value=b"\x00" * 100_000),
        ]
    )
    seen: list[Message] = []
    run = Running(consumer(proxy, seen.append))
    proxy.wait_for(lambda: len(proxy.acks) == 3, "3 acks")
    run.stop()
    assert sorted(seen, key=lambda m: m.offset) == [
        Message("orders", 3, 0, None, None, [], 1_700_000_000_000, 1),
        Message("orders", 3, 1, b"", b"", headers, 42, 3),
        Message("orders", 3, 2, binary, b"\x00" * 100_000, [], 1_700_000_000_000, 1),
    ]
    assert "value" not in repr(seen[0])  # payloads stay out of logs


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_never_more_than_credits_held_or_concurrency_running(proxy: FakeProxy, kind: str) -> None:
    lock = threading.Lock()
    running = 0
    peak = 0

    def enter() -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)

    def leave() -> None:
        nonlocal running
        with lock:
            running -= 1

    def sync_handler(message: Message) -> None:
        enter()
        time.sleep(0.002)
        leave()

    async def async_handler(message: Message) -> None:
        enter()
        await asyncio.sleep(0.002)
        leave()

    proxy.batch = 3  # small batches, so credits come back many times
    proxy.feed(delivery(o) for o in range(200))
    handler = sync_handler if kind == "sync" else async_handler
    run = Running(consumer(proxy, handler, concurrency=4, prefetch=4))
    proxy.wait_for(lambda: len(proxy.acks) == 200, "200 acks")
    run.stop()
    assert sorted(proxy.acked()) == list(range(200))
    assert peak == 4
    assert proxy.max_unsettled == 8  # the proxy filled every credit and the client coped
    assert run.consumer.stats.dropped == 0


def test_a_slow_message_does_not_block_the_others(proxy: FakeProxy) -> None:
    release = asyncio.Event()
    loop: asyncio.AbstractEventLoop | None = None

    async def handler(message: Message) -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        if message.offset == 0:
            await release.wait()

    proxy.feed(delivery(o) for o in range(50))
    run = Running(consumer(proxy, handler, concurrency=2, prefetch=2))
    proxy.wait_for(lambda: len(proxy.acks) == 49, "every message but the slow one")
    assert 0 not in proxy.acked()
    assert loop is not None
    loop.call_soon_threadsafe(release.set)
    proxy.wait_for(lambda: len(proxy.acks) == 50, "the slow message")
    run.stop()


DEADLINE_MS = 300
"""The fake proxy's ack deadline in the Extend tests. The client extends every third of
it, and the fake proxy takes a lease back once it lapses, so a tick more than two thirds
(200 ms) late fails a test: long enough for a CPU shared with busy neighbours."""


def sleeper(kind: str, seconds: dict[int, float]) -> Any:
    """A handler that takes `seconds[offset]` (default: returns at once), sync or async."""

    def sync_handler(message: Message) -> None:
        time.sleep(seconds.get(message.offset, 0))

    async def async_handler(message: Message) -> None:
        if message.offset in seconds:
            await asyncio.sleep(seconds[message.offset])

    return sync_handler if kind == "sync" else async_handler


def held(
    kind: str, offset: int, seconds: dict[int, float] | None = None
) -> tuple[Any, threading.Event, threading.Event]:
    """A handler (sync or async) that returns at once except at `offset`: there it sets
    the first event and waits for the second; returns the handler and both events. It
    takes `seconds[o]` at any other offset `o` listed there, as `sleeper`'s."""
    started = threading.Event()
    release = threading.Event()
    timed = seconds or {}

    def sync_handler(message: Message) -> None:
        if message.offset == offset:
            started.set()
            assert release.wait(WAIT_S)
        time.sleep(timed.get(message.offset, 0))

    async def async_handler(message: Message) -> None:
        if message.offset == offset:
            started.set()
            assert await asyncio.to_thread(release.wait, WAIT_S)
        if message.offset in timed:
            await asyncio.sleep(timed[message.offset])

    return (sync_handler if kind == "sync" else async_handler), started, release


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_running_handler_is_extended_until_it_finishes(proxy: FakeProxy, kind: str) -> None:
    proxy.ack_deadline_ms = DEADLINE_MS
    proxy.feed(delivery(o) for o in range(4))
    handler = sleeper(kind, {0: 3 * DEADLINE_MS / 1000, 4: 2 * DEADLINE_MS / 1000})
    run = Running(consumer(proxy, handler, concurrency=2))
    proxy.wait_for(lambda: len(proxy.acks) == 4, "4 acks")
    # Extend ticks after those settlements, shown by the Extends of a handler that runs
    # now: a settled offset would be listed in them, or sent on its own, by then.
    proxy.feed([delivery(4)])
    proxy.wait_for(lambda: any(4 in offsets for _, offsets in proxy.extends), "offset 4 extended")
    proxy.wait_for(lambda: len(proxy.acks) == 5, "5 acks")
    run.stop()
    frames = [offsets for _, offsets in proxy.extends]
    assert sum(0 in offsets for offsets in frames) >= 2, frames
    # Offsets 1-3 return at once, but a tick may still list one that is running when a
    # busy machine delays its thread: what the client promises, and the fake proxy checks
    # exactly, is that no offset is extended once its settlement has been sent.
    assert frames[-1] == [4], "a settled handler still extended beside the running one"
    assert proxy.stale_extends == [], "extended after its settlement"
    assert proxy.expired == [], "a lease lapsed although its handler was running"
    assert sorted(proxy.acked()) == [0, 1, 2, 3, 4]
    assert run.consumer.stats.extended == len(frames)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_extends_list_every_running_handler_and_only_while_it_runs(
    proxy: FakeProxy, kind: str
) -> None:
    proxy.ack_deadline_ms = DEADLINE_MS
    proxy.feed(delivery(o) for o in range(3))
    long_s, short_s = 4 * DEADLINE_MS / 1000, 2 * DEADLINE_MS / 1000
    run = Running(consumer(proxy, sleeper(kind, {0: long_s, 1: short_s}), concurrency=3))
    proxy.wait_for(lambda: len(proxy.acks) == 3, "3 acks")
    run.stop()
    frames = [offsets for _, offsets in proxy.extends]
    assert any({0, 1} <= set(offsets) for offsets in frames), "one Extend for all running"
    assert frames[-1] == [0], "offset 1 is no longer extended once its handler finished"
    # Offset 2 returns at once; a tick that comes while its thread waits for a busy CPU
    # lists it, rightly. Never after its ack: stale_extends.
    assert (proxy.stale_extends, proxy.expired) == ([], [])
    assert run.consumer.stats.extended == sum(map(len, frames))


def test_no_extends_when_the_proxy_sets_no_deadline(proxy: FakeProxy) -> None:
    proxy.feed([delivery(0)])
    run = Running(consumer(proxy, sleeper("async", {0: 0.3})))
    proxy.wait_for(lambda: proxy.acks, "the ack")
    run.stop()
    assert proxy.extends == []
    assert run.consumer.stats.extended == 0


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_queued_deliveries_keep_their_lease_behind_a_slow_handler(
    proxy: FakeProxy, kind: str
) -> None:
    """A delivery waiting for a busy handler slot is extended too, so it is not redelivered."""
    proxy.ack_deadline_ms = DEADLINE_MS
    proxy.feed(delivery(o) for o in range(2))
    handler = sleeper(kind, {0: 2 * DEADLINE_MS / 1000})
    run = Running(consumer(proxy, handler, concurrency=1, prefetch=1))
    proxy.wait_for(lambda: sorted(proxy.acked()) == [0, 1], "both acked")
    run.stop()
    assert proxy.expired == []
    assert any(1 in offsets for _, offsets in proxy.extends), "the queued one was extended"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_handlers_of_a_dead_stream_are_not_extended_on_the_next(
    proxy: FakeProxy, kind: str
) -> None:
    handler, _, release = held(kind, 2, {8: 2 * DEADLINE_MS / 1000})
    proxy.ack_deadline_ms = DEADLINE_MS
    proxy.feed(delivery(o) for o in range(5))
    run = Running(consumer(proxy, handler, concurrency=4, max_backoff=0.2))
    proxy.wait_for(lambda: (1, [2]) in proxy.extends, "the slow handler extended")
    proxy.stop_server()
    proxy.restart(delivery(o) for o in range(5, 8))
    proxy.wait_for(lambda: len(proxy.acked(stream=2)) == 3, "the second stream's acks")
    # Ticks of stream 2 while offset 2 still runs, shown by the Extends of a handler that
    # runs on stream 2 now: offset 2 would be listed in them, or sent on its own, by then.
    proxy.feed([delivery(8)])
    proxy.wait_for(lambda: (2, [8]) in proxy.extends, "offset 8 extended on stream 2")
    release.set()
    run.stop()
    assert {tuple(offsets) for stream, offsets in proxy.extends if stream == 2} == {(8,)}
    assert proxy.stale_extends == []


def test_stop_from_another_thread_waits_for_running_handlers_and_their_acks(
    proxy: FakeProxy,
) -> None:
    started: list[int] = []
    release = threading.Event()

    def handler(message: Message) -> None:
        started.append(message.offset)
        assert release.wait(WAIT_S)

    proxy.feed(delivery(o) for o in range(4))
    run = Running(consumer(proxy, handler, concurrency=2, prefetch=2))
    proxy.wait_for(lambda: len(started) == 2, "two running handlers")
    run.consumer.stop()
    run.consumer.stop()  # idempotent
    # The stop is under way once the queued deliveries are given back; run() stays.
    proxy.wait_for(lambda: len(proxy.releases) == 2, "the queued ones released")
    assert run.thread.is_alive(), "run() returned while handlers were still running"
    assert proxy.acks == []
    release.set()
    run.join()
    assert sorted(started) == [0, 1], "queued deliveries must not start after stop()"
    assert sorted(proxy.acked()) == [0, 1]
    assert sorted(o for _, o in proxy.releases) == [2, 3], "unstarted ones are released"
    assert proxy.events[-1] == (1, "half-close")  # acks first, then the half-close
    assert run.consumer.stats.dropped == 2


def test_stop_with_nothing_queued_still_sends_a_release_before_the_last_settle(
    proxy: FakeProxy,
) -> None:
    """The Release ends the stream's credits: without it the proxy refills what the final
    Settle frees, and holds what it sends then at the half-close (an attempt each)."""
    started: list[int] = []
    release = threading.Event()

    def handler(message: Message) -> None:
        started.append(message.offset)
        assert release.wait(WAIT_S)

    proxy.feed(delivery(o) for o in range(4))
    run = Running(consumer(proxy, handler, concurrency=2, prefetch=0))
    proxy.wait_for(lambda: len(started) == 2, "two running handlers")
    run.consumer.stop()
    proxy.wait_for(lambda: (1, "release") in proxy.events, "a Release at stop()")
    release.set()
    run.join()
    assert proxy.releases == [], "it lists nothing: nothing was queued"
    kinds = [kind for stream, kind in proxy.events if stream == 1]
    # The Release first, then the running handlers' settlements (one frame or two), then
    # the half-close.
    assert kinds[0] == "release", kinds
    assert kinds[-1] == "half-close", kinds
    assert set(kinds[1:-1]) == {"settle"}, kinds


def test_stop_releases_queued_deliveries_of_async_handlers(proxy: FakeProxy) -> None:
    gate = threading.Event()
    started: list[int] = []

    async def handler(message: Message) -> None:
        started.append(message.offset)
        await asyncio.to_thread(gate.wait, WAIT_S)

    proxy.feed(delivery(o) for o in range(6))
    run = Running(consumer(proxy, handler, concurrency=2, prefetch=4))
    proxy.wait_for(lambda: len(started) == 2 and proxy.max_unsettled == 6, "6 delivered")
    run.consumer.stop()
    gate.set()
    run.join()
    assert sorted(proxy.acked()) == sorted(started)
    assert sorted(o for _, o in proxy.releases) == sorted(set(range(6)) - set(started))


def test_stop_from_inside_an_async_handler(proxy: FakeProxy) -> None:
    def body(message: Message) -> None:
        if message.offset == 2:
            c.stop()

    c = consumer(proxy, sync_and_async(body)["async"], concurrency=1, prefetch=0)
    proxy.feed(delivery(o) for o in range(10))
    Running(c).join()
    assert proxy.acked() == [0, 1, 2]


def test_run_async_runs_in_the_callers_loop(proxy: FakeProxy) -> None:
    handled: list[int] = []

    async def handler(message: Message) -> None:
        handled.append(message.offset)

    async def main() -> None:
        c = consumer(proxy, handler)
        task = asyncio.create_task(c.run_async())
        await asyncio.to_thread(proxy.wait_for, lambda: len(proxy.acks) == 5, "5 acks")
        c.stop()
        await asyncio.wait_for(task, WAIT_S)
        with pytest.raises(StateError):
            await c.run_async()

    proxy.feed(delivery(o) for o in range(5))
    asyncio.run(main())
    assert sorted(handled) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_reconnects_after_proxy_restart_and_drops_results_of_the_dead_stream(
    proxy: FakeProxy, kind: str
) -> None:
    handler, in_slow, release = held(kind, 2)
    proxy.feed(delivery(o) for o in range(5))
    run = Running(consumer(proxy, handler, concurrency=4, max_backoff=0.2))
    proxy.wait_for(lambda: len(proxy.acks) == 4 and in_slow.is_set(), "all but the slow one")
    proxy.stop_server()
    proxy.restart(delivery(o) for o in range(5, 8))
    proxy.wait_for(lambda: len(proxy.hellos) == 2, "the second stream")
    release.set()
    proxy.wait_for(lambda: {5, 6, 7} <= set(proxy.acked(stream=2)), "the second stream's acks")
    run.stop()
    assert sorted(proxy.acked(stream=1)) == [0, 1, 3, 4]
    assert sorted(proxy.acked(stream=2)) == [5, 6, 7], "offset 2 belonged to the dead stream"
    stats = run.consumer.stats
    assert stats.reconnects >= 1
    assert stats.dropped == 1


def test_wrong_token_raises_promptly(proxy: FakeProxy) -> None:
    run = Running(Consumer(proxy.target, "wrong", lambda m: None, max_backoff=0.1))
    run.thread.join(2.0)
    assert not run.thread.is_alive(), "run() kept retrying a wrong token"
    with pytest.raises(AuthenticationError) as info:
        run.join()
    assert info.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert proxy.hellos == []


def test_settlements_are_batched(proxy: FakeProxy) -> None:
    async def handler(message: Message) -> None:
        pass

    proxy.batch = 100
    proxy.feed(delivery(o) for o in range(100))
    run = Running(consumer(proxy, handler, concurrency=50, prefetch=50))
    proxy.wait_for(lambda: len(proxy.acks) == 100, "100 acks")
    run.stop()
    settles = [e for e in proxy.events if e[1] == "settle"]
    assert len(settles) <= 3, f"{len(settles)} Settle frames for 100 acks"


@pytest.mark.parametrize("ranges", [True, False])
def test_acks_go_as_ranges_only_to_a_proxy_that_understands_them(
    proxy: FakeProxy, ranges: bool
) -> None:
    async def handler(message: Message) -> None:
        pass

    proxy.batch = 100
    proxy.ack_ranges = ranges
    proxy.feed(delivery(o) for o in range(100))
    run = Running(consumer(proxy, handler, concurrency=50, prefetch=50))
    proxy.wait_for(lambda: len(proxy.acks) == 100, "100 acks")
    run.stop()
    assert sorted(offset for _, offset in proxy.acks) == list(range(100))
    assert bool(proxy.ranges) is ranges  # an older proxy gets plain acks only


def test_rejected_settlements_are_logged_and_counted(
    proxy: FakeProxy, caplog: pytest.LogCaptureFixture
) -> None:
    proxy.reject = {1}
    proxy.feed(delivery(o) for o in range(3))
    caplog.set_level(logging.WARNING, logger="triage_client")
    run = Running(consumer(proxy, lambda m: None))
    deadline = time.monotonic() + WAIT_S
    while run.consumer.stats.rejected == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    run.stop()
    assert run.consumer.stats.rejected == 1
    assert any("rejected 1 settlements" in r.getMessage() for r in caplog.records)


def test_stop_before_run_returns_at_once(proxy: FakeProxy) -> None:
    c = consumer(proxy, lambda m: None)
    c.stop()
    c.run()
    with pytest.raises(StateError):
        c.run()


def test_reason_is_bounded_and_valid_utf8() -> None:
    reason = _reason(ValueError("x" * 5000 + "\udc80"))
    assert len(reason) == MAX_REASON_CHARS
    assert reason.endswith("x...")
    assert len(_reason(ValueError("y" * (MAX_REASON_CHARS - 12)))) == MAX_REASON_CHARS, "kept whole"
    assert reason.startswith("ValueError: xxx")
    reason.encode("utf-8")
    assert _reason(ValueError("\udc80")) == "ValueError: ?"


@pytest.mark.parametrize("failures", [0, 1, 5, 100])
def test_backoff_is_capped_and_jittered(failures: int) -> None:
    low = backoff_delay(failures, initial=0.1, cap=2.0, rand=lambda: 0.0)
    high = backoff_delay(failures, initial=0.1, cap=2.0, rand=lambda: 1.0)
    ceiling = min(2.0, 0.1 * 2**failures)
    assert (low, high) == pytest.approx((ceiling / 2, ceiling))


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        Consumer("x:1", TOKEN, lambda m: None, concurrency=0)
    with pytest.raises(ValueError, match="prefetch"):
        Consumer("x:1", TOKEN, lambda m: None, prefetch=-1)
    with pytest.raises(TypeError, match="retry_on"):
        Consumer("x:1", TOKEN, lambda m: None, retry_on=cast(Any, (OSError, "timeout")))
    with pytest.raises(TypeError, match="retry_on"):
        Consumer("x:1", TOKEN, lambda m: None, retry_on=cast(Any, (ValueError("x"),)))


# -- a deployment: Topology, one stream per partition, one shared pool ----------------------


def hellos(fakes: Deployment) -> list[tuple[int | None, int]]:
    """(partition, credits) of every Hello any proxy accepted, in partition order."""
    return sorted(
        (
            (h.partition if h.HasField("partition") else None, h.credits)
            for fake in fakes.proxies
            for h in fake.hellos
        ),
        key=lambda pc: (-1 if pc[0] is None else pc[0], pc[1]),
    )


def serve_all(fakes: Deployment, *owners: FakeProxy) -> None:
    """Partition p is served by owners[p]."""
    for p, owner in enumerate(owners):
        fakes.serve(p, owner)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_one_consumer_consumes_every_partition_with_one_pool(
    deployment: Deployment, kind: str
) -> None:
    a, b = deployment.proxy(), deployment.proxy()
    serve_all(deployment, a, a, b)
    for p in range(3):
        deployment.feed(p, (delivery(o) for o in range(60)))
    lock = threading.Lock()
    running = peak = 0
    seen: list[tuple[int, int]] = []

    def enter(message: Message) -> None:
        nonlocal running, peak
        with lock:
            seen.append((message.partition, message.offset))
            running += 1
            peak = max(peak, running)

    def leave() -> None:
        nonlocal running
        with lock:
            running -= 1

    def sync_handler(message: Message) -> None:
        enter(message)
        time.sleep(0.002)
        leave()

    async def async_handler(message: Message) -> None:
        enter(message)
        await asyncio.sleep(0.002)
        leave()

    handler = sync_handler if kind == "sync" else async_handler
    run = Running(
        Consumer(a.target, TOKEN, handler, concurrency=4, prefetch=4, consumer_id="one-pool")
    )
    deployment.wait_for(
        lambda: all(len(deployment.acked(p)) == 60 for p in range(3)), "every partition acked"
    )
    run.stop()
    assert peak == 4, "one pool of 4 slots for all three partitions"
    assert sorted(seen) == [(p, o) for p in range(3) for o in range(60)]
    assert all(sorted(deployment.acked(p)) == list(range(60)) for p in range(3))
    assert hellos(deployment) == [(0, 3), (1, 3), (2, 2)], "credits 4 + 4 split over 3 streams"
    assert deployment.max_unsettled == 8, "never more than concurrency + prefetch held in all"
    stats = run.consumer.stats
    assert (stats.delivered, stats.acked, stats.dropped, stats.reconnects) == (180, 180, 0, 0)
    assert {p: (s.delivered, s.acked) for p, s in stats.partitions.items()} == {
        0: (60, 60),
        1: (60, 60),
        2: (60, 60),
    }
    assert sorted(run.consumer._channels.endpoints()) == sorted([a.target, b.target]), (
        "one per endpoint"
    )


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_backlog_of_slow_messages_does_not_starve_another_partition(
    deployment: Deployment, kind: str
) -> None:
    slow_s = 0.5
    a = deployment.proxy()
    serve_all(deployment, a, a, a)
    started: list[int] = []

    def sync_handler(message: Message) -> None:
        started.append(message.partition)
        if message.partition == 0:
            time.sleep(slow_s)

    async def async_handler(message: Message) -> None:
        started.append(message.partition)
        if message.partition == 0:
            await asyncio.sleep(slow_s)

    deployment.feed(0, (delivery(o) for o in range(40)))
    handler = sync_handler if kind == "sync" else async_handler
    # credits 30: 10 per partition, so 8 slow ones wait behind the 2 running
    run = Running(consumer(a, handler, concurrency=2, prefetch=28))
    deployment.wait_for(lambda: started.count(0) == 2 and a.max_unsettled == 10, "a backlog")
    deployment.feed(1, (delivery(o) for o in range(20)))
    deployment.wait_for(lambda: len(deployment.acked(1)) == 20, "the other partition's work")
    slow_done = len(deployment.acked(0))
    run.stop()
    # A free slot goes to the partition with fewer running handlers: partition 1 gets it
    # each time, instead of waiting behind the 8 queued slow ones (4 more slow rounds).
    assert slow_done <= 4, f"{slow_done} slow messages finished before 20 fast ones"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_slow_backlog_cannot_hold_the_slots_another_backlog_needs(
    deployment: Deployment, kind: str
) -> None:
    """Against a proxy that grants: the slow backlog has every slot and the idle partition
    is down to its small prefetch when fast work arrives there; the fast partition gets
    credits and slots back and finishes within a wave or two of slow messages, and the sum
    of credits stays within concurrency + prefetch throughout. (The moment a FIFO choice
    loses, a slot freeing while the fast queue waits for its next deliveries, is timing the
    fake proxy does not reproduce: the pool's rule is checked directly below, and
    tests/integration/test_topic_consumer.py measures it against the real proxy.)"""
    slow_s, fast_s = 0.4, 0.005
    a = deployment.proxy()
    a.grants = True
    serve_all(deployment, a, a, a)
    started: list[int] = []

    def sync_handler(message: Message) -> None:
        started.append(message.partition)
        time.sleep(slow_s if message.partition == 0 else fast_s)

    async def async_handler(message: Message) -> None:
        started.append(message.partition)
        await asyncio.sleep(slow_s if message.partition == 0 else fast_s)

    deployment.feed(0, (delivery(o) for o in range(60)))
    handler = sync_handler if kind == "sync" else async_handler
    run = Running(consumer(a, handler, concurrency=4, prefetch=12))
    deployment.wait_for(
        lambda: started.count(0) == 4 and (1, IDLE_CREDITS) in a.granted,
        "the slow backlog on every slot, the idle partition down to its prefetch",
    )
    deployment.feed(1, (delivery(o) for o in range(60)))
    deployment.wait_for(lambda: len(deployment.acked(1)) == 60, "the other partition's work")
    slow_done = len(deployment.acked(0))
    run.stop()
    assert slow_done <= 8, f"{slow_done} slow messages finished before 60 fast ones"
    assert deployment.max_unsettled <= 16, "never more than concurrency + prefetch in all"


def test_the_pool_skips_a_stream_at_its_slot_cap_even_with_a_free_slot() -> None:
    ledger = HandlerPool(lambda m: None, 4, (), 16).ledger
    slow, fast = ledger.open(cast(Any, "slow")), ledger.open(cast(Any, "fast"))
    ledger.set_slots([slow, fast], [2, 2])
    ledger.queue(slow, [make_message("t", 0, o, None, None, [], 0, 1) for o in range(5)])
    assert ledger.pick() is not None
    assert ledger.pick() is not None
    assert ledger.pick() is None, "the fast partition's half stays free for its next delivery"
    ledger.queue(fast, [make_message("t", 1, 0, None, None, [], 0, 1)])
    picked = ledger.pick()
    assert picked is not None
    assert picked[0] is fast
    ledger.set_slots([slow, fast], [4, 2])  # the next rebalance lifted the cap (fast went idle)
    picked = ledger.pick()
    assert picked is not None
    assert picked[0] is slow
    assert slow.busy == 3


@pytest.mark.parametrize("grants", [True, False])
def test_credits_follow_demand_when_the_proxy_grants(deployment: Deployment, grants: bool) -> None:
    """One partition busy, two idle: with Grant the busy one ends up with what the idle ones
    leave (16 - 2 - 2) and runs on every slot; an older proxy keeps the even split (6, 5, 5),
    so the busy partition runs on at most 6 of the 8 slots."""
    a = deployment.proxy()
    a.grants = grants
    serve_all(deployment, a, a, a)
    lock = threading.Lock()
    running = peak = 0

    async def handler(message: Message) -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        await asyncio.sleep(0.01)
        with lock:
            running -= 1

    deployment.feed(0, (delivery(o) for o in range(400)))
    run = Running(consumer(a, handler, concurrency=8, prefetch=8))
    deployment.wait_for(lambda: len(deployment.acked(0)) == 400, "the busy partition's work")
    run.stop()
    assert hellos(deployment) == [(0, 6), (1, 5), (2, 5)], "Hellos: the even split"
    assert deployment.max_unsettled <= 16
    if grants:
        assert (0, 12) in a.granted
        assert {c for p, c in a.granted if p != 0} == {2}, "idle partitions keep a prefetch"
        assert peak == 8
    else:
        assert peak <= 6
        assert a.max_unsettled == 6


def test_deliveries_decided_before_a_lowering_arrive_without_a_warning(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    """A Grant is not acknowledged: Deliveries a proxy decided under the credits before a
    lowering arrive a round trip later, which a busy machine stretches past a rebalance
    period or two (here b writes each frame 0.35 s after deciding it). They are within what
    the stream was allowed, so no "more than the credits" warning names the proxy. (The
    Consumer's budget counts the old credits for one period only: the total may exceed it
    by what the lowering took away, credits.py.)"""
    a, b = deployment.proxy(), deployment.proxy()
    a.grants = b.grants = True
    b.delay_s = 0.35
    serve_all(deployment, a, b)

    async def handler(message: Message) -> None:
        if message.partition == 0:
            await asyncio.sleep(0.02)  # a backlog that draws the credits to partition 0

    deployment.feed(0, (delivery(o) for o in range(400)))
    deployment.feed(1, (delivery(o) for o in range(8)))
    # b decides its first frame at the Welcome, under the Hello's credits, and writes it
    # 0.35 s later: by then the Consumer, which has seen nothing of partition 1, has
    # lowered it to its prefetch and started two or three rebalance periods since.
    run = Running(consumer(a, handler, concurrency=4, prefetch=12))
    deployment.wait_for(lambda: len(deployment.acked(1)) == 8, "partition 1's eight")
    run.stop()
    (hello,) = [h for h in b.hellos if h.partition == 1]
    assert b.max_unsettled == hello.credits > IDLE_CREDITS, "the first frame filled the Hello's"
    assert (1, IDLE_CREDITS) in b.granted, "partition 1 was lowered to its prefetch"
    warned = [r.getMessage() for r in caplog.records if "more than the" in r.getMessage()]
    assert warned == []
    lowered_by = hello.credits - IDLE_CREDITS
    assert deployment.max_unsettled <= 16 + lowered_by, "over the budget by no more (credits.py)"


def test_a_moved_partition_is_followed_to_the_owner_its_old_proxy_names(
    deployment: Deployment,
) -> None:
    a, b = deployment.proxy(), deployment.proxy()
    serve_all(deployment, a, a, a)
    deployment.feed(1, (delivery(o) for o in range(10)))
    run = Running(consumer(a, sleeper("async", {})))
    deployment.wait_for(lambda: len(deployment.acked(1)) == 10, "partition 1 on a")
    # Topology still names a; only a's refusal says where partition 1 went.
    deployment.serve(1, b, announce=False)
    deployment.feed(1, (delivery(o) for o in range(10, 20)))
    deployment.wait_for(lambda: len(deployment.acked(1)) == 20, "partition 1 on b")
    run.stop()
    assert 1 in a.refused
    assert [h.partition for h in b.hellos] == [1]
    assert sorted(o for p, o in b.acked_in() if p == 1) == list(range(10, 20))
    assert run.consumer.stats.partitions[1].reconnects >= 1


def test_a_partition_whose_proxy_dies_is_followed_to_the_standby_that_takes_it(
    deployment: Deployment,
) -> None:
    a, b = deployment.proxy(), deployment.proxy()
    serve_all(deployment, a, b, a)
    deployment.feed(1, (delivery(o) for o in range(10)))
    run = Running(consumer(a, sleeper("async", {})))
    deployment.wait_for(lambda: len(deployment.acked(1)) == 10, "partition 1 on b")
    b.stop_server()  # killed: only a standby waits for partition 1 now
    deployment.serve(1, None)
    deployment.feed(1, (delivery(o) for o in range(10, 20)))
    reads = deployment.topology_calls
    deployment.wait_for(lambda: deployment.topology_calls >= reads + 2, "reads naming nobody")
    deployment.serve(1, a)  # the standby took the lease
    deployment.wait_for(lambda: set(deployment.acked(1)) == set(range(20)), "partition 1 on a")
    run.stop()
    assert [h.partition for h in a.hellos].count(1) == 1
    assert sorted(o for p, o in a.acked_in() if p == 1) == list(range(10, 20))


def test_a_partition_nobody_serves_at_start_is_consumed_once_a_proxy_takes_it(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="triage_client")
    a = deployment.proxy()
    deployment.serve(0, a)
    deployment.serve(1, a)  # partition 2: only a standby waits for it
    deployment.feed(2, (delivery(o) for o in range(5)))
    run = Running(consumer(a, sleeper("async", {})))
    deployment.wait_for(lambda: len(a.hellos) == 2, "streams for 0 and 1")
    reads = deployment.topology_calls  # a few more, all saying nobody serves partition 2:
    deployment.wait_for(lambda: deployment.topology_calls >= reads + 3, "3 more topology reads")
    deployment.serve(2, a)
    deployment.wait_for(lambda: len(deployment.acked(2)) == 5, "partition 2 consumed")
    run.stop()
    assert hellos(deployment) == [(0, 11), (1, 11), (2, 10)], "credits split over all three"
    unserved = [r for r in caplog.records if "nobody serves partitions [2]" in r.getMessage()]
    assert len(unserved) == 1, "said once, not at every read"


def test_a_partition_added_to_the_topic_is_consumed_without_a_restart(
    deployment: Deployment,
) -> None:
    a = deployment.proxy()
    serve_all(deployment, a, a, a)
    run = Running(
        consumer(a, sleeper("async", {}), concurrency=4, prefetch=4, topology_interval=0.2)
    )
    deployment.wait_for(lambda: len(a.hellos) == 3, "three streams")
    deployment.serve(3, a)  # partition 3 added to the topic and the deployment
    deployment.feed(3, (delivery(o) for o in range(5)))
    deployment.wait_for(lambda: len(deployment.acked(3)) == 5, "the new partition consumed")
    run.stop()
    assert [p for p, _ in hellos(deployment)] == [0, 1, 2, 3]
    assert dict(hellos(deployment))[3] == 2, "the new stream takes its share of the new split"
    assert run.consumer.stats.partitions[3].acked == 5


def test_partitions_restricts_what_is_consumed(deployment: Deployment) -> None:
    a = deployment.proxy()
    serve_all(deployment, a, a, a)
    for p in range(3):
        deployment.feed(p, (delivery(o) for o in range(5)))
    run = Running(consumer(a, sleeper("async", {}), partitions=[2, 0], concurrency=3))
    deployment.wait_for(
        lambda: len(deployment.acked(0)) == 5 and len(deployment.acked(2)) == 5, "0 and 2"
    )
    run.stop()
    assert hellos(deployment) == [(0, 3), (2, 3)], "credits split over the two streams only"
    assert deployment.acked(1) == []
    assert sorted(run.consumer.stats.partitions) == [0, 2]


def test_a_partition_the_topic_lacks_is_an_error_at_start(deployment: Deployment) -> None:
    a = deployment.proxy()
    serve_all(deployment, a, a, a)
    deployment.feed(0, [delivery(0)])
    run = Running(consumer(a, sleeper("async", {}), partitions=[0, 5, 7]))
    with pytest.raises(PartitionError, match=r"\[5, 7\].*'orders'.*3 partitions") as info:
        run.join()
    assert isinstance(info.value, ValueError)
    assert info.value.missing == [5, 7]
    assert a.hellos == [], "nothing consumed"
    with pytest.raises(ValueError, match="partitions"):
        Consumer(a.target, TOKEN, lambda m: None, partitions=[-1])


def test_a_wrong_token_is_refused_at_topology(deployment: Deployment) -> None:
    a = deployment.proxy()
    serve_all(deployment, a, a, a)
    run = Running(Consumer(a.target, "wrong", lambda m: None))
    with pytest.raises(AuthenticationError):
        run.join()
    assert (deployment.topology_calls, a.hellos) == (0, [])


def test_an_older_proxy_without_topology_is_consumed_as_its_only_partition(
    proxy: FakeProxy,
) -> None:
    proxy.feed(delivery(o) for o in range(3))
    seen: list[Message] = []
    run = Running(consumer(proxy, seen.append))
    proxy.wait_for(lambda: len(proxy.acks) == 3, "3 acks")
    run.stop()
    assert [h.HasField("partition") for h in proxy.hellos] == [False], "an old-style Hello"
    assert {m.partition for m in seen} == {3}
    assert list(run.consumer.stats.partitions) == [3]
    assert run.consumer.stats.partitions[3].acked == 3


def test_an_older_proxy_serving_another_partition_than_asked_is_an_error(
    proxy: FakeProxy,
) -> None:
    run = Running(consumer(proxy, lambda m: None, partitions=[0]))
    with pytest.raises(PartitionError, match="serves only partition 3"):
        run.join()


def test_a_grpc_server_without_triage_is_not_a_triage_proxy() -> None:
    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        run = Running(Consumer(f"127.0.0.1:{port}", TOKEN, lambda m: None))
        with pytest.raises(EndpointError, match=f"127.0.0.1:{port} is not a Triage proxy"):
            run.join()
    finally:
        server.stop(None)


def test_an_endpoint_that_does_not_speak_grpc_is_not_a_triage_proxy() -> None:
    http = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        target = f"127.0.0.1:{http.server_address[1]}"
        run = Running(Consumer(target, TOKEN, lambda m: None))
        with pytest.raises(EndpointError, match="not a Triage proxy: it does not speak gRPC"):
            run.join()
    finally:
        http.shutdown()
        http.server_close()


def test_stop_drains_every_stream(deployment: Deployment) -> None:
    a, b = deployment.proxy(), deployment.proxy()
    serve_all(deployment, a, a, b)
    for p in range(3):
        deployment.feed(p, (delivery(o) for o in range(2)))
    started: list[tuple[int, int]] = []
    release = threading.Event()

    def handler(message: Message) -> None:
        started.append((message.partition, message.offset))
        assert release.wait(WAIT_S)

    run = Running(consumer(a, handler, concurrency=3, prefetch=3))  # 2 credits per stream
    deployment.wait_for(
        lambda: (
            len(started) == 3 and deployment.unsettled == 6 and run.consumer.stats.delivered == 6
        ),  # sent is not yet received: wait for both
        "all held",
    )
    run.consumer.stop()
    # The stop is under way once the queued deliveries are given back; run() stays.
    deployment.wait_for(
        lambda: sum(len(fake.releases) for fake in deployment.proxies) == 3,
        "the queued ones released",
    )
    assert run.thread.is_alive(), "run() returned while handlers were still running"
    release.set()
    run.join()
    acked = sorted((p, o) for fake in deployment.proxies for p, o in fake.acked_in())
    assert acked == sorted(started)
    released = [(fake.partition_of(s), o) for fake in deployment.proxies for s, o in fake.releases]
    held = {(p, o) for p in range(3) for o in range(2)}
    assert sorted(released) == sorted(held - set(started)), "the queued ones are given back"
    for fake in deployment.proxies:
        for stream in fake.streams:
            events = [e for s, e in fake.events if s == stream.number]
            assert events[-1] == "half-close", (fake.partition_of(stream.number), events)
    assert deployment.unsettled == 0
    assert run.consumer.stats.dropped == 3


@pytest.mark.parametrize(("budget", "streams"), [(8, 3), (64, 4), (5, 5), (3, 4), (1, 1)])
def test_credits_are_split_evenly_and_within_the_budget(budget: int, streams: int) -> None:
    shares = [credit_share(budget, streams, i) for i in range(streams)]
    assert min(shares) >= 1
    assert max(shares) - min(shares) <= 1
    assert sum(shares) == max(budget, streams), "the budget, unless a stream needs its 1"


def test_stop_while_the_target_does_not_answer_returns_promptly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The waits a stop could be stuck in, a minute each: a stop that sat one out would
    # take that long, far past the bound, which leaves a loaded machine seconds of room.
    monkeypatch.setattr(follower, "TOPOLOGY_TIMEOUT_S", 60.0)
    monkeypatch.setattr(writer, "CLOSE_TIMEOUT_S", 60.0)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # connections complete in the kernel; nothing ever answers
    try:
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        run = Running(Consumer(target, TOKEN, lambda m: None))
        readable, _, _ = select.select([silent], [], [], WAIT_S)  # the client's connection
        assert readable, "the client never connected"
        started = time.monotonic()
        run.stop()
        assert time.monotonic() - started < 10
    finally:
        silent.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_default_prefetch_grows_when_the_refill_outlasts_the_local_queue(
    deployment: Deployment, kind: str
) -> None:
    """Work shorter than the proxy's round trip: slots run dry while the proxy has more,
    so the default prefetch goes to AUTO_PREFETCH_MAX x concurrency (a Grant)."""
    a = deployment.proxy()
    a.grants = True
    a.delay_s = 0.02
    deployment.serve(0, a)

    def sync_handler(message: Message) -> None:
        time.sleep(0.002)

    async def async_handler(message: Message) -> None:
        await asyncio.sleep(0.002)

    deployment.feed(0, (delivery(o) for o in range(600)))
    handler = sync_handler if kind == "sync" else async_handler
    run = Running(consumer(a, handler, concurrency=2, partitions=[0]))
    deployment.wait_for(lambda: a.granted, "a Grant")
    # 600 round trips of 20 ms and more before the Grant: on 2 loaded cores, more than 5 s.
    deployment.wait_for(lambda: len(deployment.acked(0)) == 600, "every delivery acked", 60)
    run.stop()
    assert [h.credits for h in a.hellos] == [4], "the Hello: concurrency + concurrency"
    assert a.granted == [(0, 2 * (1 + AUTO_PREFETCH_MAX))]
    assert run.consumer.credits == 2 * (1 + AUTO_PREFETCH_MAX)


def test_the_default_prefetch_grows_before_the_first_rebalance_period_ends(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first slot that runs dry grows the prefetch at once, even before any rebalance
    has seen that the proxy takes Grants (a run's first period is when the queue runs dry
    first): with a period longer than the test, only that can send the Grant."""
    monkeypatch.setattr("triage_client.rebalancer.REBALANCE_INTERVAL_S", 3600.0)
    a = deployment.proxy()
    a.grants = True
    a.delay_s = 0.02
    deployment.serve(0, a)
    deployment.feed(0, (delivery(o) for o in range(200)))
    run = Running(consumer(a, lambda m: time.sleep(0.002), concurrency=2, partitions=[0]))
    deployment.wait_for(lambda: a.granted, "a Grant")
    deployment.wait_for(lambda: len(deployment.acked(0)) == 200, "every delivery acked")
    run.stop()
    assert a.granted == [(0, 2 * (1 + AUTO_PREFETCH_MAX))]


def test_the_default_prefetch_grows_a_stream_cap_per_backlogged_partition(
    deployment: Deployment,
) -> None:
    """Two partitions with a backlog and work shorter than the round trip: the prefetch
    grows to one stream's cap for each (credits.grown_cap), and no stream is granted more
    than one stream's cap, so per partition nothing more is in flight than with one."""
    a = deployment.proxy()
    a.grants = True
    a.delay_s = 0.02
    serve_all(deployment, a, a)
    # A backlog that outlasts the growth on a loaded machine: with 200 each, a run under
    # load once drained partition 0 before the budget had grown to its cap.
    for p in (0, 1):
        deployment.feed(p, (delivery(o) for o in range(2000)))

    async def handler(message: Message) -> None:
        await asyncio.sleep(0.002)

    run = Running(consumer(a, handler, concurrency=2, partitions=[0, 1]))
    one_cap = 2 * (1 + AUTO_PREFETCH_MAX)
    deployment.wait_for(
        lambda: {p for p, c in a.granted if c == one_cap} == {0, 1},
        "each backlogged partition granted one stream's cap",
        within=30,
    )
    run.stop()
    assert run.consumer.credits == 2 * one_cap
    assert max(c for _, c in a.granted) == one_cap
    assert {p for p, c in a.granted if c == one_cap} == {0, 1}, "each backlog got a cap"
    assert deployment.max_unsettled <= 2 * one_cap


def test_an_explicit_prefetch_does_not_grow(deployment: Deployment) -> None:
    a = deployment.proxy()
    a.grants = True
    a.delay_s = 0.02
    deployment.serve(0, a)
    deployment.feed(0, (delivery(o) for o in range(200)))
    run = Running(
        consumer(a, lambda m: time.sleep(0.002), concurrency=2, prefetch=2, partitions=[0])
    )
    deployment.wait_for(lambda: len(deployment.acked(0)) == 200, "every delivery acked")
    run.stop()
    assert a.granted == []
    assert deployment.max_unsettled <= 4


def test_consumers_with_sync_handlers_share_one_loop_thread_until_the_last_returns(
    proxy: FakeProxy,
) -> None:
    """loop.py: one loop for every run() with a sync handler in the process (a loop each
    contended for the GIL); an async handler's Consumer keeps its own."""
    proxy.feed(delivery(o) for o in range(40))
    seen: list[int] = []

    async def async_handler(message: Message) -> None:
        seen.append(message.offset)

    runs = [
        Running(consumer(proxy, lambda m: seen.append(m.offset), consumer_id=f"sync-{i}"))
        for i in range(2)
    ]
    other = Running(consumer(proxy, async_handler, consumer_id="async"))
    proxy.wait_for(lambda: len(proxy.acks) == 40, "every delivery acked")
    loops = [run.consumer._loop for run in (*runs, other)]
    assert loops[0] is not None
    assert loops[0] is loops[1], "the sync Consumers share one loop"
    assert loops[2] is not loops[0], "the async one runs its own"
    assert [t.name for t in threading.enumerate()].count("triage-loop") == 1
    runs[0].stop()
    assert [t.name for t in threading.enumerate()].count("triage-loop") == 1, "one still runs"
    runs[1].stop()
    other.stop()
    assert "triage-loop" not in [t.name for t in threading.enumerate()], "the last one ended it"
    assert sorted(seen) == list(range(40))
