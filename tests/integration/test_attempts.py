"""Delivery attempts under a flapping fleet and across a proxy restart, against the real
broker and DynamoDB endpoint.

- A consumer fleet in a crash loop (or a network blip) fails every delivery it holds.
  Redeliveries after such failures back off (`delivery.redelivery_span_s`), so it cannot
  use up a healthy message's attempts in seconds.
- A crash-type pill's failed deliveries are kept in the checkpoint item, so a proxy
  killed with SIGKILL and restarted continues its count instead of starting at 1.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.harness import (
    TOKEN,
    RawConsumer,
    await_until,
    committed,
    dead_letters,
    produce,
    settings_for,
    target,
    wait_until,
)
from triage_cli.devstack import write_config
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port, wait_for_port
from triage_proxy.app import Proxy
from triage_proxy.pipeline.dispatch import Dispatcher
from triage_proxy.pipeline.settled import decode_attempts
from triage_proxy.store.checkpoints import DynamoDBCheckpoints

pytestmark = pytest.mark.integration

MESSAGES = 100
STREAMS = 300
"""Most streams of the storm: it also ends at STORM_S, once every message failed twice."""
MAX_ATTEMPTS = 5
FLAP_SPAN_S = 15.0
"""Gaps 0, 15/7, 30/7 and 60/7 s: no message fails five times within 15 s of its first
failure, however fast the streams come and go."""
STORM_S = FLAP_SPAN_S / 2
"""When the storm stops adding streams beyond the 2 x MESSAGES deliveries it needs: a busy
machine makes it slower (41 streams/s in a run at twice the usual CPU), never longer
than the span it must fit in."""
WAIT_S = 60.0
"""Bound of every wait on an event (generous: a loaded machine is slow, not wrong)."""


async def _poll(predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
    """Wait until `predicate()` holds, looking every millisecond (the storm is fast)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.001)


async def _vanishing_stream(proxy_target: str, dispatcher: Dispatcher) -> int:
    """One instance of a crash-looping fleet: it connects with 1 credit, takes what the
    proxy hands it (if anything) and vanishes without settling. Returns deliveries taken."""
    opened = dispatcher.counters.sessions_opened
    async with RawConsumer(proxy_target, credits=1) as c:
        await c.read()  # Welcome
        await _poll(lambda: dispatcher.counters.sessions_opened > opened)
        # open_session hands out what is ready synchronously: held now, or nothing for it.
        holds = any(s.consumer_id == c.consumer_id and s.held for s in dispatcher.sessions)
        if holds:
            await c.receive(1, timeout=WAIT_S)
        return len(c.deliveries)


def test_a_flapping_fleet_dead_letters_no_healthy_message(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(
        broker,
        aws,
        topic,
        delivery={"max_attempts": MAX_ATTEMPTS, "redelivery_span_s": FLAP_SPAN_S},
    )
    produce(broker.bootstrap, topic, [(None, b"healthy %d" % i, None) for i in range(MESSAGES)])

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy:
            pipeline = proxy.pipelines.get(proxy.partition)
            assert pipeline is not None
            dispatcher = pipeline.dispatcher
            assert dispatcher is not None
            assert await await_until(lambda: dispatcher.in_window == MESSAGES, timeout=WAIT_S)

            started = time.monotonic()
            taken: list[int] = []
            while len(taken) < STREAMS and (
                sum(taken) < 2 * MESSAGES or time.monotonic() - started < STORM_S
            ):
                taken.append(await _vanishing_stream(target(proxy), dispatcher))
            storm_s = time.monotonic() - started
            # The premise: the storm is over before any message could have failed five
            # times (gaps summing to the span), so a dead letter here is a bug.
            assert storm_s < FLAP_SPAN_S, f"the storm took {storm_s:.1f} s"
            # It did use attempts: every message failed at least twice (the first
            # redelivery is immediate), which without the backoff went on to five.
            assert sum(taken) >= 2 * MESSAGES
            assert await await_until(lambda: dispatcher.counters.sessions_closed == len(taken))
            assert dispatcher.counters.dead_lettered == 0
            assert dispatcher.failures()  # counted, and waiting out their gaps
            assert max(dispatcher.failures().values()) < MAX_ATTEMPTS

            acked: set[int] = set()
            async with RawConsumer(target(proxy), credits=MESSAGES) as healthy:
                while len(acked) < MESSAGES:
                    got = await healthy.receive(1, timeout=WAIT_S)
                    healthy.settle(acks=[d.offset for d in got])
                    acked.update(d.offset for d in got)
                assert await await_until(
                    lambda: proxy.snapshot().committed_offset == MESSAGES,
                    timeout=WAIT_S,
                )
            assert acked == set(range(MESSAGES))
            assert dispatcher.counters.dead_lettered == 0
            assert dispatcher.counters.acked == MESSAGES

    asyncio.run(scenario())
    assert dead_letters(settings) == []
    assert committed(broker.bootstrap, settings.kafka.group_id, topic) == MESSAGES


PILL_SPAN_S = 2.0
"""Gaps 0, 2/7, 4/7, 8/7 s: the pill's last attempts come quickly after the restart."""
BEFORE_KILL = 2
"""Failed deliveries of the pill before the proxy is killed."""


def _proxy_process(config: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "triage_cli.main", "proxy", "--config", str(config), "-p", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def _crash_on(proxy_target: str) -> int:
    """An instance that takes the pill and dies of it: returns the delivery's attempt."""
    async with RawConsumer(proxy_target, credits=1) as c:
        (delivery,) = await c.receive(1, timeout=WAIT_S)
        assert delivery.offset == 0
        return delivery.attempt


def test_a_crash_pill_reaches_its_limit_across_a_proxy_kill_9(
    tmp_path: Path, broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic)  # creates the table
    group = settings.kafka.group_id
    port = free_port()
    config = tmp_path / "triage.toml"
    write_config(
        config,
        {
            "kafka": {"bootstrap_servers": broker.bootstrap, "topic": topic, "group_id": group},
            "server": {"host": "127.0.0.1", "port": port, "http_port": 0},
            "auth": {"token": TOKEN},
            "dead_letters": {
                "table": settings.dead_letters.table,
                "endpoint_url": aws.endpoint_url,
            },
            "delivery": {"max_attempts": MAX_ATTEMPTS, "redelivery_span_s": PILL_SPAN_S},
            "commit": {"interval_s": 0.1},
            "ownership": {"lease_s": 2.0},  # the restart waits for the killed one's lease
        },
    )
    produce(broker.bootstrap, topic, [(None, b"crash", None)])
    proxy_target = f"127.0.0.1:{port}"
    checkpoints = DynamoDBCheckpoints(settings.dead_letters, topic, 0, group)

    def counted() -> dict[int, int]:
        found = checkpoints.get()
        return {} if found is None else decode_attempts(found.committed, found.attempts)

    async def crashes(count: int) -> list[int]:
        return [await _crash_on(proxy_target) for _ in range(count)]

    proc = _proxy_process(config)
    try:
        wait_for_port("127.0.0.1", port, 30, proc)
        before = asyncio.run(crashes(BEFORE_KILL))
        assert before == [1, 2]
        # The pill at the head holds the commit at 0, yet its count reaches the item.
        assert wait_until(lambda: counted() == {0: BEFORE_KILL}, timeout=WAIT_S)
        assert committed(broker.bootstrap, group, topic) <= 0
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

        proc = _proxy_process(config)
        wait_for_port("127.0.0.1", port, 30, proc)
        after = asyncio.run(crashes(MAX_ATTEMPTS - BEFORE_KILL))
        assert after == [3, 4, 5]  # the count went on; it did not start again at 1
        assert len(before) + len(after) == MAX_ATTEMPTS
        assert wait_until(lambda: dead_letters(settings), timeout=WAIT_S)
        (dl,) = dead_letters(settings)
        assert (dl.record.offset, dl.record.value, dl.attempts) == (0, b"crash", MAX_ATTEMPTS)
        assert dl.reason == (
            f"delivery attempts exhausted ({MAX_ATTEMPTS}): its instance disconnected while "
            "handling it"
        )
        assert dl.consumer_id.startswith("raw-")
        assert wait_until(lambda: committed(broker.bootstrap, group, topic) == 1, timeout=WAIT_S)
    finally:
        checkpoints.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
