"""A push target's adaptive concurrency limit: how many requests may be in flight to it.

A pure policy fed samples, in the manner of Netflix's concurrency-limits: the caller owns
the clock and the in-flight count and reports each finished request with
`on_sample(now, rtt, inflight, dropped, records)`; the limiter returns the new limit.
Nothing here does I/O or reads a clock, so tests feed it sequences.

Two rules, one for each signal an endpoint gives:

- **Overload (AIMD).** A dropped request (429, 503, or a timeout) multiplies the limit by
  `backoff_ratio`, at most once per round trip: the requests already in flight when the
  limit was cut were sent under the old limit, and their drops say nothing new. Without
  that, one burst of 503s would cut the limit once per request and collapse it.
- **Latency (gradient).** The limit follows the ratio of the long-run round trip (a slow
  average, what the endpoint does when it is not queueing) to the recent one (the median
  of the last `SHORT_WINDOW` round trips). A median, not an average: a record that is
  slow for its own reasons (a slow downstream call) among fast ones is not queueing, and
  one 3 s round trip among 10 ms ones would hold a recent average high for dozens of
  samples, cutting the limit to its floor; the next slow record would then hold up every
  record behind it, the head-of-line blocking push exists to remove. When the endpoint
  itself slows down, most round trips do, and the median follows within a few samples.
  Below `tolerance` x the long-run round trip nothing changes; above it the
  limit shrinks toward the concurrency that keeps the recent round trip near the
  long-run one. While the endpoint keeps up, the limit grows by one per round trip
  (additive increase), only when the requests in flight actually use the limit, so an
  idle target does not inflate its limit.

**Round trips are compared by request size.** A batched target's requests carry from 1
record to `batch`, and a request of 500 records takes longer than one of 1 for reasons
that are not queueing. So each size class (record counts within a factor of 2: 1, 2-3,
4-7, 8-15, ...) keeps its own long-run and recent round trip, and a sample is judged
against its own class: requests of 1 record between bursts of full batches do not make
the batches look like queueing, and an endpoint that queues slows every class, so every
class says so. Not the round trip per record: an endpoint's cost is often mostly per
request (a connection, a transaction per batch), and then a small request's round trip
per record is many times a large one's. Within a class sizes differ at most 2x, which the
default `tolerance` absorbs. One record per request (gRPC, `batch = 1`) is one class:
exactly the two rules above.

The limit is a float internally (fractional growth of 1/limit per sample makes "one per
round trip"), and `limit` rounds it down, never below `min_limit` nor above `max_limit`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

__all__ = ["AdaptiveLimit", "LimitSettings", "size_class"]

DEFAULT_BACKOFF_RATIO = 0.9
"""The multiplicative decrease on an overload response (TCP Reno uses 0.5; endpoints that
shed load with 503 recover faster than a congested link, so a gentler cut keeps more
throughput while it converges)."""
DEFAULT_TOLERANCE = 2.0
"""How much longer than the long-run round trip a recent one may be before the limit
shrinks: an endpoint's latency varies that much without queueing."""
LONG_WINDOW = 200
"""Samples the long-run round trip averages over (an exponential average's span)."""
SHORT_WINDOW = 10
"""Samples the recent round trip is the median of."""


@dataclass(frozen=True, slots=True)
class LimitSettings:
    """The bounds and tuning of one target's limit."""

    min_limit: int
    """Never fewer requests in flight than this (at least 1)."""
    max_limit: int
    """Never more requests in flight than this."""
    initial: int
    """The limit before any sample."""
    backoff_ratio: float = DEFAULT_BACKOFF_RATIO
    """Multiplier applied on an overload response, once per round trip."""
    tolerance: float = DEFAULT_TOLERANCE
    """Recent / long-run round trip ratio up to which latency is not a signal."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.max_limit:
            raise ValueError(
                f"need 1 <= min_limit <= max_limit, got {self.min_limit} and {self.max_limit}"
            )
        if not self.min_limit <= self.initial <= self.max_limit:
            raise ValueError(f"initial {self.initial} is outside [min_limit, max_limit]")
        if not 0 < self.backoff_ratio < 1:
            raise ValueError(f"backoff_ratio must be in (0, 1), got {self.backoff_ratio}")
        if not 1 <= self.tolerance < math.inf:
            raise ValueError(f"tolerance must be finite and >= 1, got {self.tolerance}")


class _RoundTrips:
    """The long-run and recent round trips of one request size class."""

    __slots__ = ("long", "recent", "short")

    def __init__(self) -> None:
        self.long = 0.0
        """The exponential average over LONG_WINDOW samples (0 before any)."""
        self.short = 0.0
        """The median of `recent` (0 before any sample)."""
        self.recent: deque[float] = deque(maxlen=SHORT_WINDOW)

    def add(self, rtt: float) -> None:
        if self.long == 0.0:
            self.long = rtt
        else:
            self.long += (rtt - self.long) / LONG_WINDOW
        self.recent.append(rtt)
        self.short = statistics.median(self.recent)


def size_class(records: int) -> int:
    """The size class of a request of `records` records: 0 for 1, 1 for 2-3, 2 for 4-7..."""
    return max(records, 1).bit_length() - 1


class AdaptiveLimit:
    """One target's concurrency limit, moved by samples (see the module docstring)."""

    __slots__ = ("_classes", "_cut_at", "_last", "_limit", "settings")

    def __init__(self, settings: LimitSettings) -> None:
        self.settings = settings
        self._limit = float(settings.initial)
        self._classes: dict[int, _RoundTrips] = {}
        self._last: _RoundTrips | None = None
        """The class of the last sample that got an answer (what `rtt` shows)."""
        self._cut_at = -math.inf

    @property
    def limit(self) -> int:
        """Requests that may be in flight now."""
        return int(self._limit)

    @property
    def rtt(self) -> float:
        """The recent round trip in seconds, of the size class sampled last (0 before any
        sample)."""
        return 0.0 if self._last is None else self._last.short

    def on_sample(
        self, now: float, rtt: float, inflight: int, dropped: bool, records: int = 1
    ) -> int:
        """Account one finished request and return the new limit.

        `now`: when it finished (any monotonic clock, seconds); `rtt`: how long it took;
        `inflight`: requests in flight when it was sent (including itself); `dropped`:
        the endpoint refused it as overloaded (429/503) or it timed out; `records`: how
        many records it carried (its size class).
        """
        s = self.settings
        if dropped:
            # Requests sent before the last cut were judged by it already.
            if now - rtt >= self._cut_at:
                self._limit = max(float(s.min_limit), self._limit * s.backoff_ratio)
                self._cut_at = now
            return self.limit
        if rtt <= 0 or not math.isfinite(rtt):
            return self.limit
        key = size_class(records)
        trips = self._classes.get(key)
        if trips is None:
            trips = self._classes[key] = _RoundTrips()
        trips.add(rtt)
        self._last = trips
        limit = self._limit
        gradient = min(1.0, s.tolerance * trips.long / trips.short)
        if gradient < 1.0:
            # Queueing at the endpoint: shrink toward what keeps the round trip level,
            # smoothed over a round trip's samples so one slow request moves it little.
            limit -= (limit - max(float(s.min_limit), limit * gradient)) / max(limit, 1.0)
        elif inflight * 2 >= limit:
            limit += 1.0 / limit
        self._limit = min(float(s.max_limit), max(float(s.min_limit), limit))
        return self.limit
