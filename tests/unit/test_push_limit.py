"""The adaptive limit fed sample sequences: no clock, no I/O (push/limit.py)."""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from triage_proxy.push.limit import (
    LONG_WINDOW,
    SHORT_WINDOW,
    AdaptiveLimit,
    LimitSettings,
    size_class,
)


def settings(**kw: float) -> LimitSettings:
    base: dict[str, float] = {"min_limit": 1, "max_limit": 256, "initial": 8}
    base.update(kw)
    return LimitSettings(**base)  # type: ignore[arg-type]


def simulate(
    limiter: AdaptiveLimit,
    seconds: float,
    *,
    capacity: int,
    service_s: float,
    start: float = 0.0,
    slow_from: float = float("inf"),
    slow_until: float = float("inf"),
) -> tuple[int, list[tuple[float, int]]]:
    """A receiver that serves at most `capacity` requests at once, each `service_s` long
    (10x that inside [slow_from, slow_until)), answering 503 at once beyond capacity; a
    sender that keeps `limiter.limit` requests in flight. Returns (served, limit trace)."""
    now = start
    events: list[tuple[float, int, float, bool, int]] = []  # (done, seq, sent, dropped, inflight)
    inflight = serving = served = seq = 0
    trace: list[tuple[float, int]] = []
    while now < start + seconds:
        while inflight < limiter.limit:
            inflight += 1
            seq += 1
            if serving < capacity:
                serving += 1
                took = service_s * (10 if slow_from <= now < slow_until else 1)
                heapq.heappush(events, (now + took, seq, now, False, inflight))
            else:
                heapq.heappush(events, (now + 0.0005, seq, now, True, inflight))
        done, _, sent, dropped, was_inflight = heapq.heappop(events)
        now = done
        inflight -= 1
        if not dropped:
            serving -= 1
            served += 1
        limiter.on_sample(now, now - sent, was_inflight, dropped)
        trace.append((now, limiter.limit))
    return served, trace


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="min_limit <= max_limit"):
        LimitSettings(min_limit=8, max_limit=4, initial=4)
    with pytest.raises(ValueError, match="outside"):
        LimitSettings(min_limit=1, max_limit=4, initial=5)
    with pytest.raises(ValueError, match="backoff_ratio"):
        settings(backoff_ratio=1.0)
    with pytest.raises(ValueError, match="tolerance"):
        settings(tolerance=0.5)


def test_a_drop_cuts_once_per_round_trip() -> None:
    limiter = AdaptiveLimit(settings(initial=100))
    # A burst of drops of requests all sent before the first cut: one cut only.
    assert limiter.on_sample(10.0, 0.05, 100, dropped=True) == 90
    for i in range(50):
        assert limiter.on_sample(10.0 + i * 0.001, 0.06, 100, dropped=True) == 90
    # A request sent after the cut and dropped: a second cut.
    assert limiter.on_sample(10.2, 0.05, 90, dropped=True) == 81


def test_growth_is_one_per_round_trip_and_only_when_used() -> None:
    limiter = AdaptiveLimit(settings(initial=10))
    for _ in range(10):  # ten samples ~ one round trip at limit 10
        limiter.on_sample(1.0, 0.02, 10, dropped=False)
    assert limiter.limit == 10 or limiter.limit == 11
    for _ in range(100):
        limiter.on_sample(2.0, 0.02, 10, dropped=False)
    assert 13 <= limiter.limit <= 20
    idle = AdaptiveLimit(settings(initial=10))
    for _ in range(1000):
        idle.on_sample(1.0, 0.02, 2, dropped=False)  # the target is not using its limit
    assert idle.limit == 10


def test_limits_are_never_left() -> None:
    limiter = AdaptiveLimit(settings(min_limit=4, max_limit=12, initial=8))
    for i in range(100):
        limiter.on_sample(float(i), 0.01, 1, dropped=True)
    assert limiter.limit == 4
    for _ in range(10_000):
        limiter.on_sample(200.0, 0.01, 12, dropped=False)
    assert limiter.limit == 12


def test_it_settles_near_the_capacity_of_a_shedding_endpoint() -> None:
    """The issue's receiver: 16 at once (503 beyond), 20 ms each: capacity 800/s."""
    limiter = AdaptiveLimit(settings(min_limit=1, max_limit=256, initial=4))
    served, trace = simulate(limiter, 10.0, capacity=16, service_s=0.02)
    assert served >= 0.85 * 800 * 10
    late = [limit for t, limit in trace if t >= 5.0]
    assert min(late) >= 12
    assert max(late) <= 24


def test_it_falls_when_the_endpoint_slows_and_recovers_after() -> None:
    limiter = AdaptiveLimit(settings(min_limit=1, max_limit=256, initial=4))
    _, warm = simulate(limiter, 10.0, capacity=16, service_s=0.02)
    before = warm[-1][1]
    _, slow = simulate(
        limiter, 10.0, capacity=16, service_s=0.02, start=10.0, slow_from=10.0, slow_until=20.0
    )
    assert min(limit for _, limit in slow) < before
    _, after = simulate(limiter, 15.0, capacity=16, service_s=0.02, start=20.0)
    assert [limit for t, limit in after if t >= 34.0 and not 12 <= limit <= 24] == []


def test_a_slow_record_among_fast_ones_is_not_queueing() -> None:
    """One record that takes 3 s (its own work, a slow downstream call) while the others
    take 10 ms says nothing about the endpoint queueing: the limit must not fall, or every
    record behind the next slow one would wait for it (head-of-line blocking)."""
    limiter = AdaptiveLimit(settings(initial=8))
    for _ in range(200):
        limiter.on_sample(1.0, 0.01, limiter.limit, dropped=False)
    before = limiter.limit
    trace = [limiter.on_sample(2.0, 3.0, before, dropped=False)]
    for _ in range(100):
        trace.append(limiter.on_sample(3.0, 0.01, limiter.limit, dropped=False))
    assert min(trace) >= before


def test_a_steady_share_of_slow_records_keeps_the_limit_up() -> None:
    """The head-of-line workload's shape: 1 record in 20 takes 500 ms, the rest 2 ms."""
    limiter = AdaptiveLimit(settings(initial=8))
    trace = []
    for i in range(2000):
        rtt = 0.5 if i % 20 == 19 else 0.002
        trace.append(limiter.on_sample(float(i), rtt, limiter.limit, dropped=False))
    assert min(trace[100:]) >= 8


def test_alternating_batch_sizes_are_not_queueing() -> None:
    """A batched target whose requests alternate between 1 record and 10 (a trickle
    between bursts): the endpoint spends 2 ms a record, so a 10-record request takes
    10x as long as a 1-record one. That is the requests' size, not the endpoint
    queueing: the limit must not fall."""
    limiter = AdaptiveLimit(settings(initial=16))
    trace = []
    for i in range(2000):
        records = 1 if i % 2 == 0 else 10
        rtt = 0.002 * records
        trace.append(
            limiter.on_sample(i * 0.001, rtt, limiter.limit, dropped=False, records=records)
        )
    assert min(trace) >= 16


def test_bursts_of_full_batches_after_a_trickle_are_not_queueing() -> None:
    """Load that comes and goes: a quiet spell of 1-record requests, then a burst whose
    requests are full batches of 10 (10x the round trip), and again. The limit is needed
    most in the burst; it must not fall there."""
    limiter = AdaptiveLimit(settings(initial=16))
    trace = []
    now = 0.0
    for _ in range(5):
        for records, count in ((1, 500), (10, 500)):
            for _ in range(count):
                now += 0.001
                trace.append(
                    limiter.on_sample(
                        now, 0.002 * records, limiter.limit, dropped=False, records=records
                    )
                )
    assert min(trace) >= 16


def test_a_fixed_cost_per_request_does_not_make_small_requests_look_slow() -> None:
    """An endpoint whose cost is mostly per request (5 ms, then 0.1 ms a record): a
    request of 1 record takes 5.1 ms, one of 500 takes 55 ms. Per record the small one
    is 47x slower; that says nothing about queueing either way."""
    limiter = AdaptiveLimit(settings(initial=16))
    trace = []
    for i in range(2000):
        records = 500 if (i // 300) % 2 == 0 else 1
        rtt = 0.005 + 0.0001 * records
        trace.append(
            limiter.on_sample(i * 0.001, rtt, limiter.limit, dropped=False, records=records)
        )
    assert min(trace) >= 16


def test_queueing_shows_in_batched_requests_too() -> None:
    """Requests of mixed sizes that all get 4x slower (the endpoint queueing): the limit
    falls, as it does for requests of one record (by as much as the same slowdown of
    one-record requests moved it before size classes)."""
    limiter = AdaptiveLimit(settings(initial=32))
    for i in range(1000):
        records = 1 if i % 2 == 0 else 10
        limiter.on_sample(i * 0.001, 0.002 * records, 32, dropped=False, records=records)
    before = limiter.limit
    for i in range(100):
        records = 1 if i % 2 == 0 else 10
        limiter.on_sample(2 + i * 0.001, 0.008 * records, 32, dropped=False, records=records)
    assert limiter.limit <= before * 0.75


def test_size_classes_span_a_factor_of_two() -> None:
    assert [size_class(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 500, 10_000)] == [
        0,
        1,
        1,
        2,
        2,
        3,
        3,
        4,
        8,
        13,
    ]


class OneClass:
    """The limiter as it was with one long-run and one recent round trip for every
    request: what requests of one record each must still get."""

    def __init__(self, s: LimitSettings) -> None:
        self.s = s
        self.limit = float(s.initial)
        self.long = 0.0
        self.recent: deque[float] = deque(maxlen=SHORT_WINDOW)
        self.cut_at = -math.inf

    def on_sample(self, now: float, rtt: float, inflight: int, dropped: bool) -> int:
        s = self.s
        if dropped:
            if now - rtt >= self.cut_at:
                self.limit = max(float(s.min_limit), self.limit * s.backoff_ratio)
                self.cut_at = now
            return int(self.limit)
        if rtt <= 0 or not math.isfinite(rtt):
            return int(self.limit)
        self.long = rtt if self.long == 0.0 else self.long + (rtt - self.long) / LONG_WINDOW
        self.recent.append(rtt)
        short = statistics.median(self.recent)
        limit = self.limit
        gradient = min(1.0, s.tolerance * self.long / short)
        if gradient < 1.0:
            limit -= (limit - max(float(s.min_limit), limit * gradient)) / max(limit, 1.0)
        elif inflight * 2 >= limit:
            limit += 1.0 / limit
        self.limit = min(float(s.max_limit), max(float(s.min_limit), limit))
        return int(self.limit)


@given(
    st.lists(
        st.tuples(
            st.floats(0.0, 1.0),  # time since the last sample
            st.floats(0.0001, 5.0),  # round trip
            st.integers(1, 64),  # in flight
            st.booleans(),  # dropped
        ),
        max_size=300,
    )
)
def test_requests_of_one_record_are_judged_as_with_one_class(
    samples: list[tuple[float, float, int, bool]],
) -> None:
    """`batch = 1` and gRPC targets: every request is one class, so the size classes
    change nothing for them."""
    s = settings(min_limit=1, max_limit=64, initial=8)
    limiter, reference = AdaptiveLimit(s), OneClass(s)
    now = 0.0
    for dt, rtt, inflight, dropped in samples:
        now += dt
        assert limiter.on_sample(now, rtt, inflight, dropped) == reference.on_sample(
            now, rtt, inflight, dropped
        )
