"""`[rate_limit]` against a real proxy: the observed delivery rate stays under the cap."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.integration.harness import RawConsumer, create_topic, produce, settings_for, target
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker
from triage_proxy.app import Proxy

pytestmark = pytest.mark.integration

MESSAGES = 600
CAP = 200.0


def _arrivals(settings: Any) -> tuple[float, list[float]]:
    """When the consumer started connecting (nothing is delivered before), and the
    monotonic arrival time of each of MESSAGES deliveries at it."""

    async def scenario() -> tuple[float, list[float]]:
        async with Proxy(settings, 0) as proxy:
            opened = time.monotonic()
            async with RawConsumer(target(proxy), credits=1000) as c:
                times: list[float] = []
                async with asyncio.timeout(30):
                    while len(times) < MESSAGES:
                        frame = await c.read()
                        if frame.WhichOneof("frame") == "deliveries":
                            now = time.monotonic()
                            times.extend(now for _ in frame.deliveries.deliveries)
                return opened, times

    return asyncio.run(scenario())


def test_messages_per_second_cap_holds_and_no_cap_is_much_faster(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    limited_topic, free_topic = f"{unique_name}-cap", f"{unique_name}-free"
    for topic in (limited_topic, free_topic):
        create_topic(broker.bootstrap, topic)
        produce(broker.bootstrap, topic, [(None, b"m%d" % i, None) for i in range(MESSAGES)])

    opened, limited = _arrivals(
        settings_for(broker, aws, limited_topic, rate_limit={"messages_per_s": CAP})
    )
    _, free = _arrivals(settings_for(broker, aws, free_topic))

    # Every bound is counted from `opened`, before the consumer connected, so a reading
    # loop that falls behind on a loaded machine (and reads frames sent apart at one
    # instant) only loosens it. A full bucket of CAP, then CAP a second: the last of
    # MESSAGES arrives (600 - 200) / 200 = 2 s after the first could at the earliest.
    elapsed = limited[-1] - opened
    assert elapsed >= (MESSAGES - CAP) / CAP * 0.95
    # Never more than a burst plus CAP a second in any prefix of the run.
    for i, t in enumerate(limited):
        assert i + 1 <= CAP + CAP * (t - opened) + 1
    # Uncapped, the same run takes well under half what the cap forces.
    free_elapsed = free[-1] - free[0]
    assert free_elapsed < (MESSAGES - CAP) / CAP / 2
