"""Rate limits: the token-bucket policy on a fake clock, and the dispatcher obeying it."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.unit.test_dispatcher import BASE, Clock, connect, drain, outbox_of, records
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.sections import RateLimitSettings
from triage_proxy.errors import ConfigError
from triage_proxy.pipeline.dispatch import Dispatcher
from triage_proxy.pipeline.policies import RateLimit, TokenBucket, rate_limit
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.structs import Record


def test_bucket_starts_full_then_refills_at_its_rate() -> None:
    bucket = TokenBucket(10, now=0.0)
    taken = 0
    while bucket.allows(1, 0.0):
        bucket.take(1)
        taken += 1
    assert taken == 10  # burst: one second's worth
    assert not bucket.allows(1, 0.05)
    assert bucket.wait_s(1, 0.05) == pytest.approx(0.05)
    assert bucket.allows(1, 0.1)


def test_bucket_never_holds_more_than_its_burst() -> None:
    bucket = TokenBucket(10, now=0.0)
    assert bucket.wait_s(1, 1000.0) == 0
    taken = 0
    while bucket.allows(1, 1000.0):
        bucket.take(1)
        taken += 1
    assert taken == 10


def test_cost_over_the_burst_goes_when_full_and_leaves_a_debt() -> None:
    bucket = TokenBucket(100, now=0.0)
    bucket.take(1)
    assert not bucket.allows(250, 0.0)  # not full
    assert bucket.wait_s(250, 0.0) == pytest.approx(0.01)
    assert bucket.allows(250, 0.01)  # full: the oversize one goes
    bucket.take(250)
    # 150 tokens in debt: the next byte waits until the debt is paid.
    assert not bucket.allows(1, 1.0)
    assert bucket.wait_s(1, 1.0) == pytest.approx(0.52)
    assert not bucket.allows(1, 1.5)
    assert bucket.allows(1, 1.52)


def test_waiting_exactly_wait_s_is_enough() -> None:
    bucket = TokenBucket(3, now=0.0)
    for _ in range(3):
        bucket.take(1)
    now = 0.0
    for _ in range(1000):
        now += bucket.wait_s(1, now)
        assert bucket.allows(1, now)
        bucket.take(1)
    assert now == pytest.approx(1000 / 3)


@pytest.mark.parametrize("rate", [0, -1, float("inf"), float("nan")])
def test_bucket_rejects_nonsense_rates(rate: float) -> None:
    with pytest.raises(ValueError, match="rate"):
        TokenBucket(rate, now=0.0)


def test_rate_limit_needs_every_cap_and_pays_all_of_them() -> None:
    limit = RateLimit(messages_per_s=100, bytes_per_s=1000, now=0.0)
    assert limit.admit(600, 0.0)
    assert not limit.admit(600, 0.0)  # the byte cap says no ...
    assert limit.admit(400, 0.0)  # ... but a smaller one fits
    assert limit.wait_s(1, 0.0) == pytest.approx(0.001)
    assert limit.admit(10, 0.01)
    # The message cap stops small records even when bytes are plentiful.
    limit = RateLimit(messages_per_s=2, bytes_per_s=10**9, now=0.0)
    assert limit.admit(1, 0.0)
    assert limit.admit(1, 0.0)
    assert not limit.admit(1, 0.0)
    assert limit.wait_s(1, 0.0) == pytest.approx(0.5)


def test_no_caps_means_no_limiter() -> None:
    assert rate_limit(RateLimitSettings(), 0.0) is None
    assert rate_limit(RateLimitSettings(messages_per_s=5), 0.0) is not None


@pytest.mark.parametrize("key", ["messages_per_s", "bytes_per_s"])
def test_settings_refuse_a_cap_that_is_not_positive(key: str) -> None:
    with pytest.raises(ConfigError, match=f"rate_limit.{key}"):
        settings_from_dict({**BASE, "rate_limit": {key: 0}}, {})


def test_settings_take_integer_caps_as_floats() -> None:
    settings = settings_from_dict({**BASE, "rate_limit": {"messages_per_s": 200}}, {})
    assert settings.rate_limit.messages_per_s == 200.0
    assert settings.rate_limit.bytes_per_s is None


def _dispatcher(clock: Clock, **caps: float) -> Dispatcher:
    settings = settings_from_dict({**BASE, "rate_limit": caps}, {})
    return Dispatcher(settings, 0, CommitTracker(0), lambda dl: None, monotonic=clock)


def test_dispatcher_delivers_no_faster_than_the_message_cap() -> None:
    clock = Clock()
    d = _dispatcher(clock, messages_per_s=10)
    s = connect(d, "a", 1000)
    d.add(records(0, 100))
    assert len(drain(s)) == 10  # the burst
    d.tick()
    assert drain(s) == []
    clock.now += 0.5
    d.tick()  # the timer tick pumps (here; in the proxy a scheduled wake-up does too)
    assert [x.offset for x in drain(s)] == [10, 11, 12, 13, 14]
    clock.now += 10
    d.tick()
    assert len(drain(s)) == 10  # never more than the burst after a quiet spell


def test_dispatcher_lets_a_record_over_the_byte_burst_go_when_the_bucket_is_full() -> None:
    clock = Clock()
    d = _dispatcher(clock, bytes_per_s=100)
    s = connect(d, "a", 1000)
    d.add([Record("t", 0, 0, None, b"x" * 10, (), 0)])
    d.add([Record("t", 0, 1, None, b"y" * 500, (), 0)])
    d.add([Record("t", 0, 2, None, b"z" * 10, (), 0)])
    assert [x.offset for x in drain(s)] == [0]  # 500 bytes need a full bucket
    clock.now += 0.1
    d.tick()
    assert [x.offset for x in drain(s)] == [1]  # full again: the big one goes
    clock.now += 4.0  # its debt: 400 bytes = 4 s (plus the 10 bytes of the next one)
    d.tick()
    assert drain(s) == []
    clock.now += 0.2
    d.tick()
    assert [x.offset for x in drain(s)] == [2]


def test_dispatcher_wakes_itself_when_tokens_refill() -> None:
    asyncio.run(_wakes_itself())


async def _wakes_itself() -> None:
    d = Dispatcher(
        settings_from_dict({**BASE, "rate_limit": {"messages_per_s": 50}}, {}),
        0,
        CommitTracker(0),
        lambda dl: None,
    )
    s = connect(d, "a", 1000)
    started = time.monotonic()
    d.add(records(0, 60))
    assert len(drain(s)) == 50
    # No tick runs here: only the scheduled wake-up can deliver the rest.
    got = 0
    while got < 10:
        frame = await asyncio.wait_for(outbox_of(s).get(), 10)
        assert frame is not None
        got += len(frame.deliveries.deliveries)
    # 10 more at 50/s: ~0.2 s, never sooner. Without the wake-up none would come at all;
    # the upper bound, 25 times that, says it came soon yet lets a descheduled loop pass.
    assert 0.15 <= time.monotonic() - started < 5
