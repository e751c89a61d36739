"""Delivery policies, free of I/O and clocks: backoff, when to give up, rate limits.

Why: the dispatcher decides what happens to a failed delivery (nacked with retry,
lease expired, instance vanished), when it goes out again, and how fast it may hand
records out. Keeping the
arithmetic here lets it be tested exhaustively (and with a fake clock: every rate-limit
call takes `now`), and keeps the dispatcher to bookkeeping. The token buckets hold
state (tokens, last refill), but never read a clock or do I/O.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

from triage_proxy.config.sections import RateLimitSettings, RetrySettings

__all__ = [
    "Judgement",
    "Outcome",
    "RateLimit",
    "TokenBucket",
    "after_failure",
    "backoff",
    "blamed_on_vanish",
    "checkpoint_due",
    "durability_due",
    "held_burst",
    "judged_on_vanish",
    "rate_limit",
    "redelivery_delay",
    "retry_delay",
    "window_room",
]


class Outcome(enum.Enum):
    """What to do with a message whose latest delivery failed."""

    REDELIVER = "redeliver"
    """Hand it out again (after the retry delay when it was nacked with retry)."""
    DEAD_LETTER = "dead_letter"
    """Write it to the dead-letter table; it will not be delivered again."""


class Judgement(enum.Enum):
    """What becomes of a delivery its holder vanished with (`judged_on_vanish`)."""

    BLAMED = "blamed"
    """The evidence points at it: it uses an attempt and goes back as a suspect."""
    SUSPECT = "suspect"
    """Nothing explains the crash, or it was a suspect already: back as a suspect, no
    attempt used."""
    ACQUITTED = "acquitted"
    """The one blamed delivery explains the crash: back as an ordinary delivery, no
    attempt used, remembering whom the crash was blamed on."""


def backoff(failures: int, *, initial: float, cap: float, multiplier: float = 2.0) -> float:
    """Seconds to wait after the ``failures``-th consecutive failure (>= 1): the one backoff
    formula of the proxy (redelivery, dead-letter writes, fetch and lease retries).

    ``initial * multiplier ** (failures - 1)``, capped at ``cap`` (up to float rounding).
    The exponent is bounded before exponentiating, so any ``failures`` is safe. Nonsense
    (NaN, inf, zero, a multiplier below 1) raises ValueError.
    """
    if failures < 1:
        raise ValueError(f"failures must be >= 1, got {failures}")
    if not (0 < initial < math.inf and 0 < cap < math.inf):
        raise ValueError(f"backoffs must be finite and > 0, got {initial} and {cap}")
    if not 1 <= multiplier < math.inf:
        raise ValueError(f"multiplier must be finite and >= 1, got {multiplier}")
    if initial >= cap:
        return cap
    if multiplier == 1:
        return initial
    # Growth steps after which the cap surely applies. Both logs are finite, so this is a
    # finite float; the +1 absorbs log rounding (the min() below handles the rest).
    capped_from = math.ceil((math.log(cap) - math.log(initial)) / math.log(multiplier)) + 1
    steps = failures - 1
    if steps >= capped_from:
        return cap
    try:
        grown = initial * multiplier**steps
    except OverflowError:
        # Only when cap / initial is itself beyond float range; the logs still work.
        grown = math.exp(math.log(initial) + steps * math.log(multiplier))
    return min(cap, grown)


def retry_delay(attempt: int, settings: RetrySettings) -> float:
    """Seconds to wait before redelivering a message whose ``attempt``-th delivery was nacked.

    `backoff` from ``initial_backoff_s`` by ``multiplier``, capped at ``max_backoff_s``.
    Settings are validated by `Settings`; nonsense (NaN, inf, zero) raises ValueError.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    return backoff(
        attempt,
        initial=settings.initial_backoff_s,
        cap=settings.max_backoff_s,
        multiplier=settings.multiplier,
    )


SPAN_DOUBLINGS = 64
"""Most non-zero gaps in a `redelivery_delay` schedule. With more attempts than that the
earlier gaps would be below span / 2**64 (under a nanosecond for any allowed span):
they are zero, and the last SPAN_DOUBLINGS gaps carry the whole span."""


def redelivery_delay(failures: int, max_attempts: int, span_s: float) -> float:
    """Seconds to wait before redelivering a message whose ``failures``-th delivery failed
    because its instance vanished or its lease lapsed (a retry nack waits `retry_delay`).

    Why: a fleet in a crash loop (or a network blip) fails every delivery it holds, and
    redelivering at once would exhaust a healthy message's attempts in milliseconds. So
    the gaps between such failures add up to ``span_s`` before the last attempt fails:
    the first redelivery is immediate (a killed instance's healthy messages come back at
    once), then the gaps double (`backoff`), the first non-zero one chosen so that they
    sum to ``span_s`` (max_attempts 5: 0, g, 2g, 4g with 7g = span). With max_attempts 2
    the single gap is the span. A crash-type pill therefore reaches the limit after about
    ``span_s`` plus its deliveries' time. ``span_s`` 0 turns the gaps off.

    ``failures`` is below ``max_attempts`` (after the last failure nothing is redelivered).
    """
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    if not 1 <= failures < max_attempts:
        raise ValueError(f"failures must be in 1..{max_attempts - 1}, got {failures}")
    if not 0 <= span_s < math.inf:
        raise ValueError(f"span must be finite and >= 0, got {span_s}")
    if span_s == 0:
        return 0.0
    if max_attempts == 2:
        return span_s
    # Gaps after failures 2 .. max_attempts - 1 (the first one is 0): `gaps` of them, the
    # last `doublings` non-zero and doubling from `first`.
    gaps = max_attempts - 2
    doublings = min(gaps, SPAN_DOUBLINGS)
    step = failures - 1 - (gaps - doublings)  # 1 for the first non-zero gap
    if step < 1:
        return 0.0
    # Rounded up by one ulp, so that the gaps never sum to less than the span (2**64 - 1,
    # say, is 2**64 in floats).
    first = math.nextafter(span_s / (2.0**doublings - 1), math.inf)
    return backoff(step, initial=first, cap=span_s, multiplier=2.0)


def checkpoint_due(
    since_write_s: float, *, held: bool, unsaved: int, interval_s: float, held_offsets: int
) -> bool:
    """Whether a changed checkpoint item (committer.py) is written now: once `interval_s`
    passed since the last write, or sooner while the committed offset is `held` (the
    latest commit tick did not move it) and at least `held_offsets` offsets settled above
    it are not in the item (`unsaved`).

    Why: a kill -9 redelivers what settled above the committed offset and is not in the
    item (on a broker that drops commit metadata the item is all there is). While the
    offset moves, that is about the in-flight spread however often the item is written,
    so the interval only saves writes. While it is held (a crash-type pill, or a suspect
    waiting out `redelivery_delay` at the head of the window), it grows with everything
    that settles: at full speed a one-second interval cost a kill thousands of duplicates.
    A head that jumps onto such a pill over offsets settled above it is held from the next
    tick on, so those are written then.
    """
    return since_write_s >= interval_s or (held and unsaved >= held_offsets)


def held_burst(*, held: bool, newly_settled: int, recording: bool, held_offsets: int) -> bool:
    """Whether the committer writes the checkpoint item before its tick: the committed
    offset is `held` (the head has not moved past Kafka's committed offset), at least
    `held_offsets` offsets settled since the latest record of the set above it (a commit
    or a write), and the item is `recording` (its latest write did not fail).

    Why: held, only the item records what settles above the offset (on a broker that
    drops commit metadata), and `checkpoint_due` lets it be written as soon as
    `held_offsets` are missing from it; waiting for the tick (and its Kafka commit) left
    a whole interval's worth of settles to redeliver on a kill (hundreds in a burst).
    Moving, the Kafka commit records the head and the tick holds. A failed write waits
    out its interval (a frozen table is not asked 40 times a second).
    """
    return held and recording and newly_settled >= held_offsets


def window_room(*, max_messages: int, unsettled: int, undurable: int, bounded: bool) -> int:
    """How many more records the window takes: `max_messages` less the records it counts,
    which are the `unsettled` ones, or, when `bounded`, every record whose settlement is
    not durably recorded yet (`undurable`: the unsettled ones and those settled since the
    latest commit or checkpoint that recorded them).

    Why: a kill -9 redelivers every record the killed proxy delivered whose settlement no
    commit or checkpoint recorded. Counting only the unsettled ones let a restarted
    proxy's instances settle a whole backlog between two commits (1,150 records in 100 ms
    of a reconnection burst, 825 of them redelivered by the next kill). Counting the
    undurable ones bounds what a kill costs by the window, whenever it lands; the price is
    that the window refills only as commits record what settled (`durability_due`).
    `bounded` is off without the settled-above checkpoint (commit.encode_settled off):
    then nothing records what settles above a held committed offset, and bounding it
    would stop the partition behind a poison pill.
    """
    counted = max(unsettled, undurable) if bounded else unsettled
    return max(0, max_messages - counted)


def durability_due(*, room: int, settled_waiting: int, refill: int, low: int) -> bool:
    """Whether the committer records what settled at once instead of at its tick: either
    the window has `room` for less than a worthwhile fetch (`refill` records) and recording
    the `settled_waiting` records (settled, not durably recorded) would make room for one,
    or the room fell below `low` (half the window) and recording would give back at least
    a refill.

    Why: with the bounded window (`window_room`) a partition faster than its commit
    interval would otherwise wait for the tick with a full window (at 100k messages/s a
    10,000-record window fills in 0.1 s). Waiting until the fetch is held back makes every
    commit round trip a stall; from half the window on, the commit is under way while the
    other half still flows. Each forced commit gives back at least a refill (or lets a
    held-back fetch go), so they are at most one per `refill` records; while the room is
    short because of unsettled records, a commit frees nothing and none is forced.
    """
    blocked = room < refill <= room + settled_waiting
    return blocked or (room < low and settled_waiting >= refill)


def early_commit_worth(*, waiting: int, previous_advance: int, least: int) -> bool:
    """Whether a caught-up partition commits its `waiting` offsets before the tick: at
    least `least` of them, or any at all when the previous commit itself moved the offset
    by `least` or more (the tail of a burst).

    Why: a burst's last commit rarely lands on a multiple of `least`; without the tail
    rule its remainder waited out a whole interval (bench_throughput: 640 offsets held
    100 ms at its 0.1 s interval, a default-1 s partition would hold them a second). A
    trickle keeps the threshold: its commits move the offset little, so after one tail
    commit it is back on the interval.
    """
    return waiting >= least or (waiting > 0 and previous_advance >= least)


def after_failure(attempt: int, max_attempts: int) -> Outcome:
    """Fate of a message delivered ``attempt`` times whose last delivery failed."""
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    return Outcome.DEAD_LETTER if attempt >= max_attempts else Outcome.REDELIVER


def blamed_on_vanish(suspects: Sequence[bool], started: Sequence[bool] | None = None) -> list[bool]:
    """Which deliveries of an instance's stream that vanished lose an attempt, given which
    of them were suspects (records whose earlier holder vanished or whose lease lapsed) and,
    for an instance that reports it (Hello.isolation), which suspects it said it started.

    An instance that crashes while holding many deliveries proves nothing about any one of
    them, so only the evidence counts.

    With `started` (an isolating instance): a suspect goes out flagged isolated, the
    client runs at most one isolated delivery at a time in its whole process (across all
    its streams, to every proxy) and reports it Started, and waits for the proxy's answer,
    before its handler runs. So at any crash the process has at most one started isolated
    delivery, and only that one is blamed: a delivery held alone, a suspect waiting for its
    turn, and every delivery on the process's other streams go back without losing an
    attempt (as suspects, or acquitted: `judged_on_vanish`). A crash-type pill is blamed
    from its second crash on (its first makes it a suspect), each time it crashes a
    process as the one isolated delivery running there: `max_attempts + 1` crashes in one
    proxy run, as below. A healthy record loses an attempt only when a pill on its first
    delivery (not isolated yet) crashes the process in the moments the healthy one is the
    process's started isolated delivery (then the pill is acquitted, at that crash and at
    most one more, and the crashes until it is a suspect may blame a healthy record
    again: `judged_on_vanish`).

    Without `started` (an older client), per stream:

    - it held one delivery: that one crashed it;
    - it held a suspect (the scheduler gives an instance at most one): the suspect is
      blamed, the rest are not;
    - it held several and no suspect: nobody is blamed; all go back as suspects.

    A crash-type pill is therefore blamed from its second crash on, each time it crashes
    an instance as that instance's one suspect: it reaches `max_attempts` after at most
    `max_attempts + 1` crashes in one proxy run (suspicion is not persisted: after a
    restart it may cost one unblamed crash again), spread over about
    `delivery.redelivery_span_s` (`redelivery_delay`). A healthy record loses an attempt
    only when an instance crashes while holding it as its suspect for another record's
    doing (a pill crashing on its first delivery), which needs `max_attempts` such
    coincidences to dead-letter it.
    """
    if started is not None:
        return [suspect and began for suspect, began in zip(suspects, started, strict=True)]
    if len(suspects) == 1:
        return [True]
    return list(suspects)


def judged_on_vanish(
    offsets: Sequence[int],
    suspects: Sequence[bool],
    acquittals: Sequence[tuple[int, int]],
    started: Sequence[bool] | None = None,
    *,
    isolating: bool = True,
) -> list[Judgement]:
    """What becomes of each delivery of an instance's stream that vanished, given their
    offsets, which were suspects, each one's acquittals at earlier crashes (how many, and
    the offset of the record the last one blamed: (0, -1) for none), and which suspects
    it started (`isolating`: reported by the instance itself, Hello.isolation; a push
    target's records all count as started, `isolating` False).

    `blamed_on_vanish` names who uses an attempt. When it names the one started isolated
    suspect of an isolating instance, that one explains the crash, and a delivery held
    beside it that is no suspect goes back as an ordinary delivery (`ACQUITTED`), at
    full concurrency: an isolated crash-type pill costs its neighbours neither an attempt
    nor a turn in the suspects' one-at-a-time lane. Everything else held goes back as a
    suspect, as after a crash nothing explains (a pill on its first delivery) and after
    any crash of an older client or a push target: their one suspect ran beside the
    others, which proves less.

    A delivery is acquitted at most twice, and the second time only for the record its
    first acquittal blamed: a blamed pill goes out again at once (`redelivery_delay` is 0
    after the first failure) and crashes the next process too, which may hold the
    records acquitted at the first crash. Held at any other crash it becomes a suspect.

    Why the bound: the evidence is wrong only when a pill on its first delivery crashes
    a process in the moments a healthy suspect is its started isolated delivery (the
    coincidence of `blamed_on_vanish`); the pill is then acquitted, and each crash it is
    acquitted at may blame a healthy record. So one pill costs healthy records at most
    three attempts this way (one without acquittals), and is a suspect from its third
    crash at the latest. Acquittals, like suspicion, are not persisted.
    """
    blamed = blamed_on_vanish(suspects, started)
    culprits = [offset for offset, guilty in zip(offsets, blamed, strict=True) if guilty]
    culprit = culprits[0] if len(culprits) == 1 and started is not None and isolating else None
    verdicts: list[Judgement] = []
    for guilty, suspect, (times, blamed_then) in zip(blamed, suspects, acquittals, strict=True):
        if guilty:
            verdicts.append(Judgement.BLAMED)
        elif (
            suspect
            or culprit is None
            or not (times == 0 or (times == 1 and blamed_then == culprit))
        ):
            verdicts.append(Judgement.SUSPECT)
        else:
            verdicts.append(Judgement.ACQUITTED)
    return verdicts


_SLACK = 1e-9
"""Relative float slack: after waiting exactly `wait_s`, the take succeeds."""


class TokenBucket:
    """`rate` tokens a second, holding at most `burst` (default: one second's worth).

    A cost larger than the burst is still admitted, when the bucket is full; the bucket
    then goes into debt, so the average rate holds (one huge message is never stuck).
    """

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, now: float, burst: float | None = None) -> None:
        if not 0 < rate < math.inf:
            raise ValueError(f"rate must be finite and > 0, got {rate}")
        self.rate = rate
        self.burst = rate if burst is None else burst
        if not 0 < self.burst < math.inf:
            raise ValueError(f"burst must be finite and > 0, got {self.burst}")
        self.tokens = self.burst
        """Starts full: a fresh proxy may send one burst at once."""
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def _need(self, cost: float) -> float:
        return min(cost, self.burst) * (1 - _SLACK)

    def allows(self, cost: float, now: float) -> bool:
        """Whether `cost` may go at `now` (takes nothing)."""
        self._refill(now)
        return self.tokens >= self._need(cost)

    def take(self, cost: float) -> None:
        """Spend `cost` (after `allows` said yes); may leave the bucket in debt."""
        self.tokens -= cost

    def wait_s(self, cost: float, now: float) -> float:
        """Seconds from `now` until `cost` may go (0: now)."""
        self._refill(now)
        return max(0.0, (min(cost, self.burst) - self.tokens) / self.rate)


class RateLimit:
    """The `[rate_limit]` caps of one proxy: a record goes only when every bucket (messages
    per second, payload bytes per second) allows it, and then it is paid from all of them."""

    __slots__ = ("_buckets",)

    def __init__(self, messages_per_s: float | None, bytes_per_s: float | None, now: float):
        self._buckets: list[tuple[TokenBucket, bool]] = []
        """(bucket, counts bytes) pairs; a message bucket costs 1 per record."""
        if messages_per_s is not None:
            self._buckets.append((TokenBucket(messages_per_s, now), False))
        if bytes_per_s is not None:
            self._buckets.append((TokenBucket(bytes_per_s, now), True))

    def admit(self, size: int, now: float) -> bool:
        """Take one record of `size` bytes if every cap allows it now."""
        buckets = self._buckets
        if not all(b.allows(size if by_size else 1, now) for b, by_size in buckets):
            return False
        for bucket, by_size in buckets:
            bucket.take(size if by_size else 1)
        return True

    def wait_s(self, size: int, now: float) -> float:
        """Seconds from `now` until a record of `size` bytes may go."""
        return max((b.wait_s(size if s else 1, now) for b, s in self._buckets), default=0.0)


def rate_limit(settings: RateLimitSettings, now: float) -> RateLimit | None:
    """The caps `settings` asks for, or None when there are none (no cost at all)."""
    if settings.messages_per_s is None and settings.bytes_per_s is None:
        return None
    return RateLimit(settings.messages_per_s, settings.bytes_per_s, now)
