"""How one Consumer's `concurrency + prefetch` credits and its handler slots are split over
its partition streams: the two pure policies, no I/O.

`credit_share` is the static split, for streams whose proxy cannot change credits after the
Hello (an older proxy, without `Welcome.grants`) and for every Hello.

`split` is the dynamic one, run every REBALANCE_INTERVAL_S from what each stream showed over
the last period (`StreamLoad`):

- A stream is *hungry* when it held as many unsettled deliveries as its credits allow: its
  proxy had more for it. A hungry stream wants all it can get; any other wants what it
  used at its peak plus one (never less than an idle stream's small prefetch,
  `idle_credits`), so an idle partition shrinks back to that prefetch.
- The budget is water-filled (max-min fair): every stream first gets up to the idle prefetch,
  then the rest rises evenly until each has what it wants or the budget is spent, so a
  partition with a backlog gets an even share beside another backlog and everything the
  others leave. What nobody wants stays unallocated, ready for a stream that wakes up.
- Lowering a stream's credits revokes nothing: it may hold what it held, and, for one more
  period, as much as its old credits allowed (deliveries may have been on their way when the
  proxy applied the Grant). Raises come only out of what no stream may hold (its
  `committed`), so the credits in force plus what lowered streams still hold stay within the
  budget: total unsettled deliveries stay <= concurrency + prefetch, as long as a round
  trip to the proxy is shorter than a period. A longer one (a busy machine) can bring
  deliveries decided under the old credits after the period: the total then exceeds the
  budget by at most what the lowerings took away, until they are settled (a proxy 0.35 s
  late took a Consumer of 16 credits to 19, test_client). Counting the old credits longer
  would hold freed credits back from a busy partition for as long; a Grant the proxy
  acknowledged would make it exact (not in the protocol).
- Handler slots: hungry streams split `concurrency` evenly and may run at most their share,
  so a backlog of slow messages cannot take the slots another backlogged partition needs
  (even in the moments its queue is empty while its next deliveries are on the way). A
  stream that is not hungry is not limited: it has few deliveries, and the pool's
  fewest-running-first choice serves it at the next free slot.

`grown` is the default prefetch's own rule: when a period saw handler slots run out of
queued work (`idled`) while a stream held more than half its credits at once (its proxy had
a backlog for it: a trickle never holds that many), the round trip of settlement -> refill
outlasted the local queue: the prefetch goes to its cap at once (doubling took a period
per step, a fifth of a one-second run at each). (Not `hungry`: with a round
trip longer than the work, part of the credits is always on its way back, so a starving
stream never holds all of them.) It never shrinks while the Consumer runs (a larger local
queue costs memory, not speed).

The cap (`grown_cap`) is one stream's cap (`stream_cap`: what a lone stream grows to) for
each stream that shows a backlog in that period, up to STREAM_CAPS_MAX of them, and no
stream is given more than `stream_cap` (`split`): per partition, the credits in force and so
the deliveries that may be redelivered when an instance dies stay what one stream may hold;
only their sum grows. Why: a stream is refilled one Deliveries frame per Settle, each frame
a gRPC write and read with fixed costs on both sides, and a budget split 4 ways settles and
refills each partition a quarter as much at a time (bench_fleet_throughput, 4 partitions
under one Consumer: ~2.3x the frames of one partition and ~1.5x the instances' CPU per
message at a single stream's cap; 16 partitions under a cap of 4 streams: 5-6x the
frames). Kafka's own client keeps its prefetch per partition too (librdkafka's
queued.min.messages).

Every stream keeps at least 1 credit (the protocol's minimum), so more streams than the
budget exceed it by design, as in the static split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "IDLE_CREDITS",
    "REBALANCE_INTERVAL_S",
    "STREAM_CAPS_MAX",
    "Split",
    "StreamLoad",
    "credit_share",
    "grown",
    "grown_cap",
    "hungry",
    "split",
]

REBALANCE_INTERVAL_S = 0.1
"""How often a Consumer with several streams re-splits its credits and slots."""
IDLE_CREDITS = 2
"""Credits an idle stream keeps: a small prefetch, so its first deliveries need no Grant."""
STREAM_CAPS_MAX = 16
"""Most single-stream caps the default prefetch grows to, when that many streams show a
backlog at once (`grown_cap`): a bound on the instance's memory however many partitions it
consumes. 16, not 4: a budget of 4 caps split over 16 backlogged partitions gave each a
quarter of a lone stream's credits, so each Deliveries frame (half a stream's credits) and
the Settle answering it carried a quarter as many records: bench_fleet_throughput with 16
partitions sent ~1,100-1,300 frames each way for 200,000 messages against ~200 for one
partition, and its fleet process delivered less than one partition. At 16 caps: ~450-800
frames (see docs/benchmarks.md)."""


def credit_share(budget: int, streams: int, index: int) -> int:
    """Hello credits of stream number `index` (0-based) out of `streams`: `budget` split as
    evenly as it goes, the remainder to the first ones, so the shares sum to `budget`; at
    least 1 each (the protocol's minimum), so more streams than budget exceed it by design."""
    base, extra = divmod(budget, max(1, streams))
    return max(1, base + (1 if index < extra else 0))


@dataclass(frozen=True, slots=True)
class StreamLoad:
    """What one stream showed over the last rebalance period."""

    credits: int
    """Credits in force now (the Hello's, or the last Grant's); 0 for a stream not connected."""
    peak: int
    """Most unsettled deliveries it held at once during the period."""
    committed: int
    """Most it may hold now: its credits, what it holds, and, for one period after a
    lowering, the credits it had before."""
    adjustable: bool
    """Its proxy honours Grant frames; False: its credits stay what the Hello said."""


@dataclass(frozen=True, slots=True)
class Split:
    """The decision of one rebalance, one entry per stream in the order given."""

    credits: tuple[int, ...]
    """Credits each stream may hold from now on (unchanged for one not adjustable)."""
    slots: tuple[int, ...]
    """Most handlers each stream may run at once."""


def hungry(load: StreamLoad) -> bool:
    """The stream filled its credits during the period: its proxy had more for it."""
    return load.credits > 0 and load.peak >= load.credits


def backlogged(load: StreamLoad) -> bool:
    """The stream held more than half its credits at once: its proxy had a backlog for it
    (a trickle never holds that many)."""
    return 2 * load.peak > load.credits


def grown_cap(stream_cap: int, limit: int, loads: Sequence[StreamLoad]) -> int:
    """Most the default prefetch may grow to after a period: `stream_cap` per stream that
    showed a backlog (at least one, at most STREAM_CAPS_MAX), never past `limit` (the
    protocol's largest Grant)."""
    streams = min(STREAM_CAPS_MAX, max(1, sum(1 for load in loads if backlogged(load))))
    return max(stream_cap, min(limit, stream_cap * streams))


def grown(budget: int, cap: int, loads: Sequence[StreamLoad], idled: int) -> int:
    """The Consumer's credit budget after a period (see the module doc): `cap` when slots
    idled while a stream held more than half its credits; else unchanged."""
    if idled <= 0 or budget >= cap or not any(backlogged(load) for load in loads):
        return budget
    return cap


def split(
    concurrency: int, budget: int, loads: Sequence[StreamLoad], stream_cap: int | None = None
) -> Split:
    """Credits and slot caps for every stream (see the module doc); none is given more than
    `stream_cap` (None: the budget)."""
    count = len(loads)
    starving = [hungry(load) for load in loads]
    slots = _slots(concurrency, starving)
    most = budget if stream_cap is None else min(budget, stream_cap)
    if count <= 1:
        # Nobody to share with: a lone adjustable stream has the whole budget (to its cap).
        return Split(tuple(most if s.adjustable else s.credits for s in loads), slots)
    adjustable = [i for i, load in enumerate(loads) if load.adjustable]
    fixed = sum(load.credits for load in loads if not load.adjustable)
    available = max(0, budget - fixed)
    floor = max(1, min(IDLE_CREDITS, available // max(1, len(adjustable))))
    wants = {
        i: most if starving[i] else min(most, max(floor, loads[i].peak + 1)) for i in adjustable
    }
    targets = _water_fill(available, floor, wants)
    # Raises come out of what no stream may hold now; lowerings take effect at once.
    free = budget - sum(load.committed for load in loads)
    raises = {
        i: targets[i] - loads[i].committed for i in adjustable if targets[i] > loads[i].committed
    }
    granted = _water_fill(max(0, free), 0, raises) if raises else {}
    credits = []
    for i, load in enumerate(loads):
        if not load.adjustable:
            credits.append(load.credits)
        elif i in raises:
            credits.append(max(1, load.committed + granted[i]))
        else:
            credits.append(max(1, targets[i]))
    return Split(tuple(credits), slots)


def _slots(concurrency: int, starving: Sequence[bool]) -> tuple[int, ...]:
    """Hungry streams split `concurrency` evenly; the others are not limited."""
    rank = 0
    total = sum(starving)
    caps = []
    for is_hungry in starving:
        if is_hungry and total > 1:
            caps.append(credit_share(concurrency, total, rank))
            rank += 1
        else:
            caps.append(concurrency)
    return tuple(caps)


def _water_fill(amount: int, floor: int, wants: dict[int, int]) -> dict[int, int]:
    """Split `amount` over `wants` max-min fairly: first up to `floor` each (at least that
    much even beyond `amount`: the protocol's minimum), then evenly upwards, nobody past what
    it wants; ties of the remainder go to the lower index."""
    given = {i: min(floor, want) for i, want in wants.items()}
    left = amount - sum(given.values())
    open_ = sorted(i for i in wants if given[i] < wants[i])
    while left > 0 and open_:
        each, extra = divmod(left, len(open_))
        still_open = []
        for rank, i in enumerate(open_):
            add = min(wants[i] - given[i], each + (1 if rank < extra else 0))
            given[i] += add
            left -= add
            if given[i] < wants[i]:
                still_open.append(i)
        if each == 0 and len(still_open) == len(open_):
            break  # the remainder was handed out one by one: nothing left to level
        open_ = still_open
    return given
