"""What one proxy reports about itself, as values: `ProxySnapshot` (one partition's
pipeline at one moment, built by `PartitionPipeline.snapshot()`), `ProcessSnapshot` (the
process and a `ProxySnapshot` per partition it runs, `Proxy.status()`), `Instance`, and
the `LatencyHistogram` the dispatcher fills and the snapshot carries.

Why a module of its own: the Prometheus rendering (metrics.py) and the HTTP endpoint
(observe/endpoint.py) read a proxy only through these values, so neither imports the
application (app.py imports both). The settle latency is the one per-message measure: a
`LatencyHistogram` is plain bucket counts bumped on the event-loop thread (no lock;
~0.2 us per settled delivery, within the noise of a ~1 us settle, measured by
`tests/perf/bench_metrics.py`), exported as a Prometheus histogram by metrics.py
(prometheus-client's own takes a lock per observation).
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SETTLE_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
"""Upper bounds of the settle-latency buckets: handlers take from ~1 ms to minutes."""
PUSH_BUCKETS_S = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
)
"""Upper bounds of a push target's round-trip buckets: a loopback no-op answers in well
under a millisecond, a real endpoint in tens of milliseconds."""
UNWRITABLE_SHOWN = 10
"""Most unwritable dead letters a snapshot names (the oldest; all are counted)."""


class LatencyHistogram:
    """Cumulative-on-export histogram that costs a bisect and two adds per observation.

    Not thread-safe on purpose: only the event-loop thread observes, and a scrape (on the
    same loop) reads a consistent copy.
    """

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float] = SETTLE_BUCKETS_S) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        """Per-bucket (not cumulative) counts; the last one is +Inf."""
        self.total = 0.0
        """Sum of every observation (seconds)."""

    def observe(self, seconds: float, n: int = 1) -> None:
        """`n` observations of `seconds` (a batch delivered together and settled together)."""
        self.counts[bisect_left(self.bounds, seconds)] += n
        self.total += seconds * n

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> LatencyHistogram:
        """A copy that later observations do not change (for a snapshot)."""
        twin = LatencyHistogram(self.bounds)
        twin.counts = list(self.counts)
        twin.total = self.total
        return twin

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the `q` quantile (None when empty; the
        last finite bound when it falls in +Inf): a bound, not an estimate."""
        total = self.count
        if not total:
            return None
        rank = q * total
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            if running >= rank:
                return bound
        return self.bounds[-1]

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (le, observations <= le), ending with +Inf."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass(frozen=True)
class Instance:
    """One connected consumer instance as status shows it."""

    consumer_id: str
    """The id the instance gave in its Hello."""
    credits: int
    """How many deliveries it can hold at once."""
    held: int
    """Deliveries it holds unsettled now."""


@dataclass(frozen=True)
class UnwritableDeadLetter:
    """A dead letter that can never be written as it is (deadletters/writer.py's policy): held
    unwritten, so the commit waits at its offset until the fix is made and the proxy
    restarted (the message is then redelivered)."""

    offset: int
    """Its offset: the partition's commit cannot pass it."""
    size: int
    """Bytes its DynamoDB item needs."""
    limit: int
    """DynamoDB's item limit it exceeds."""
    fix: str
    """What makes it writable, e.g. "set dead_letters.overflow_bucket ..."."""


BLOCKING_REASONS = {
    "ready": "an instance with credit",
    "held": "a handler",
    "backoff": "a retry backoff",
    "waiting": "an earlier record with the same key",
    "dead_lettering": "its dead-letter write",
    "unwritable": "a dead letter that cannot be written (see unwritable_dead_letters)",
}
"""What the record that blocks the commit waits for, by its window state (the keys are
`pipeline.dispatch.window.EntryState` values)."""
SUSPECT_REASONS = {
    "ready": "its turn as a suspect",
    "held": "its turn in the consumer process",
}
"""What a suspect (its earlier holder vanished) that blocks the commit waits for, where it
is not what `BLOCKING_REASONS` says: queued while every instance with credit holds a
suspect already, or held by an isolating instance that has not reported it started (it
waits, leased, for its process's one isolated delivery at a time; see
docs/concepts/suspects-and-blame.md)."""


@dataclass(frozen=True)
class Blocking:
    """The smallest unsettled offset of a partition: the commit cannot pass it."""

    offset: int
    """Its offset (what the committed offset stays at)."""
    state: str
    """Its window state (`BLOCKING_REASONS` keys)."""
    fetched_at: float
    """When it entered the window (monotonic seconds)."""
    attempt: int = 0
    """Deliveries so far."""
    holder: str | None = None
    """The consumer id of the instance holding it, while a handler runs it."""
    suspect: bool = False
    """Its earlier holder vanished (or its lease lapsed): it goes out one at a time."""
    started: bool = True
    """While held: its handler may be running (False: an isolated suspect its instance has
    not reported started, waiting for its process's turn)."""

    @property
    def waiting_for(self) -> str:
        """What it waits for, in words."""
        if self.suspect and (self.state == "ready" or (self.state == "held" and not self.started)):
            return SUSPECT_REASONS[self.state]
        return BLOCKING_REASONS.get(self.state, self.state)

    def to_json(self, now: float) -> dict[str, Any]:
        """Its entry in /status, aged at `now` (monotonic seconds)."""
        return {
            "offset": self.offset,
            "state": self.state,
            "waiting_for": self.waiting_for,
            "age_s": round(max(0.0, now - self.fetched_at), 3),
            "attempt": self.attempt,
            "holder": self.holder,
            "suspect": self.suspect,
        }


@dataclass(frozen=True)
class ProxySnapshot:
    """One partition's pipeline at one moment (`Proxy.snapshot()`); metrics and /status
    render it (inside its process's `ProcessSnapshot`)."""

    topic: str
    """The proxied topic."""
    partition: int
    """The partition of this pipeline."""
    state: str
    """`ProxyState` value (starting, standby, running, stopping, ...)."""
    ready: bool
    """Running and delivering (what /readyz answers)."""
    grpc_port: int
    """The gRPC port bound (0 before it listens)."""
    advertised_endpoint: str = ""
    """host:port consumers are given for this partition (`server.advertised_*`; the lease
    item and Topology carry it); "" before it listens."""
    alive: bool = False
    """Started and not yet stopped (what /healthz answers; not part of /status)."""
    committed_offset: int | None = None
    """The offset Kafka last acknowledged as committed (None before Kafka is open)."""
    log_end_offset: int | None = None
    """The partition's log end: the broker's high watermark, at least what was fetched."""
    log_end_age_s: float | None = None
    """How old the high watermark reading is (it is polled, see logend.py)."""
    in_flight: int = 0
    """Delivered and unsettled, plus dead letters not yet durable (not unwritable ones)."""
    in_window: int = 0
    """Fetched and unsettled records (the window)."""
    window_bytes: int = 0
    """Payload bytes of the window."""
    window_max_messages: int = 0
    """`window.max_messages`."""
    window_max_bytes: int = 0
    """`window.max_bytes`."""
    queued: int = 0
    """Records waiting for an instance with credit."""
    instances: tuple[Instance, ...] = ()
    """Connected consumer instances."""
    oldest_unsettled_age_s: float | None = None
    """Time since the oldest unsettled record entered the window (None: window empty)."""
    dead_letters_pending: int = 0
    """Dead letters handed to the writer and not yet durable (unwritable ones included)."""
    fetch_paused: bool = False
    """The window is full, so fetching waits."""
    dead_letters_unwritable: int = 0
    """Dead letters held because they can never be written (the commit waits at the first)."""
    unwritable_dead_letters: tuple[UnwritableDeadLetter, ...] = ()
    """The oldest of them (at most UNWRITABLE_SHOWN), each with its offset and the fix."""
    degraded: tuple[str, ...] = ()
    """Parts that are failing and retrying: "fetch", "commit", "dead_letters", "log_end";
    and "dead_letters_unwritable" while a dead letter is held that retrying cannot write."""
    counters: dict[str, int] = field(default_factory=dict)
    """Running totals (`dispatcher.Counters` fields and `commits`)."""
    settle_latency: LatencyHistogram | None = None
    """Delivery -> settle latency so far (None before Kafka is open)."""
    blocking: Blocking | None = None
    """The record the commit waits for (None: nothing unsettled)."""
    taken_at: float = 0.0
    """When it was read (monotonic seconds; ages `blocking`)."""

    @property
    def lag(self) -> int | None:
        """Messages not yet committed: log end - committed offset."""
        if self.committed_offset is None or self.log_end_offset is None:
            return None
        return max(0, self.log_end_offset - self.committed_offset)

    def to_json(self) -> dict[str, Any]:
        """The /status document (also what `triage status` reads)."""
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        doc.pop("settle_latency")
        doc.pop("alive")
        doc.pop("taken_at")
        doc["blocking"] = None if self.blocking is None else self.blocking.to_json(self.taken_at)
        doc["instances"] = [dataclasses.asdict(i) for i in self.instances]
        doc["unwritable_dead_letters"] = [
            dataclasses.asdict(u) for u in self.unwritable_dead_letters
        ]
        doc["degraded"] = list(self.degraded)
        doc["connected_instances"] = len(self.instances)
        doc["lag"] = self.lag
        for key in ("log_end_age_s", "oldest_unsettled_age_s"):
            if doc[key] is not None:
                doc[key] = round(doc[key], 3)
        if self.settle_latency is not None and self.settle_latency.count:
            h = self.settle_latency
            doc["settle_latency_mean_s"] = round(h.total / h.count, 6)
        return doc


@dataclass(frozen=True)
class PushTargetSnapshot:
    """One push target of a process at one moment."""

    name: str
    """The target's name (config)."""
    limit: int
    """Its concurrency limit now (requests in flight at most)."""
    in_flight: int
    """Requests in flight now."""
    partitions: tuple[int, ...]
    """The partitions it delivers from in this process."""
    state: str
    """"ok", or why it waits (an outage, a refusal, an overload's Retry-After)."""
    latency: LatencyHistogram
    """Round trips of requests that got an answer."""
    responses: dict[str, int]
    """Requests by answer class (2xx, 4xx, 5xx, timeout, refused, reset, ...)."""
    records: dict[str, int]
    """Records by verdict (ack, nack, retry, overload, refused, outage, suspect)."""
    errors: int
    """Requests that failed without an answer."""

    def to_json(self) -> dict[str, Any]:
        """The target's entry in /status."""
        quantiles = {
            f"latency_p{round(q * 100)}_s": self.latency.quantile(q) for q in (0.5, 0.9, 0.99)
        }
        return {
            "name": self.name,
            "limit": self.limit,
            "in_flight": self.in_flight,
            "partitions": list(self.partitions),
            "state": self.state,
            **quantiles,
            "responses": dict(self.responses),
            "records": dict(self.records),
            "errors": self.errors,
        }


@dataclass(frozen=True)
class ProcessSnapshot:
    """One proxy process at one moment (`Proxy.status()`): the process, and one
    `ProxySnapshot` per partition it runs a pipeline for. /status and metrics render it."""

    topic: str
    """The proxied topic."""
    state: str
    """`ProxyState` value of the process."""
    ready: bool
    """Every partition it should serve is delivering (what /readyz answers)."""
    alive: bool
    """Started and not yet stopped (what /healthz answers)."""
    group_id: str = ""
    """The deployment it belongs to (`kafka.group_id`); "" when not known."""
    dead_letter_table: str = ""
    """The dead-letter table it writes (`dead_letters.table`); "" when not known.
    `triage status` shows a process only when topic, group and table are its config's."""
    grpc_port: int = 0
    """The gRPC port bound (0 before it listens)."""
    advertised_endpoint: str = ""
    """host:port consumers are given for every partition this process serves."""
    owner: str = ""
    """The process's id: its lease owner id, and the owner Topology names."""
    pid: int = 0
    """Its operating-system process id."""
    mode: str = "pinned"
    """"pinned" (`--partition`) or "fleet" (assigned by the consumer group)."""
    member: bool = True
    """Fleet: it holds the group's current assignment (False from a lost group session
    until the coordinator assigns again); pinned: always True."""
    assigned: tuple[int, ...] = ()
    """Pinned: the pins; fleet: what the group coordinator assigned it last."""
    partitions: tuple[ProxySnapshot, ...] = ()
    """One per pipeline it runs now (standby, starting, running or stopping)."""
    push: tuple[PushTargetSnapshot, ...] = ()
    """One per push target this process delivers to."""

    @property
    def served(self) -> list[int]:
        """Partitions it delivers now."""
        return [p.partition for p in self.partitions if p.ready]

    def to_json(self) -> dict[str, Any]:
        """The /status document: the process, `partitions` (one document each), and, when
        it runs exactly one pipeline, that pipeline's fields at the top level too (what a
        one-partition proxy answered before a process served several)."""
        doc: dict[str, Any] = {}
        if len(self.partitions) == 1:
            doc.update(self.partitions[0].to_json())
        doc.update(
            topic=self.topic,
            group_id=self.group_id,
            dead_letter_table=self.dead_letter_table,
            state=self.state,
            ready=self.ready,
            grpc_port=self.grpc_port,
            advertised_endpoint=self.advertised_endpoint,
            owner=self.owner,
            pid=self.pid,
            mode=self.mode,
            member=self.member,
            assigned=list(self.assigned),
            served=self.served,
            partitions=[p.to_json() for p in self.partitions],
            push=[target.to_json() for target in self.push],
        )
        return doc


def as_process(snap: ProcessSnapshot | ProxySnapshot) -> ProcessSnapshot:
    """A one-partition view as the process that serves it (what the HTTP endpoint and
    metrics take: a process, however many partitions it serves)."""
    if isinstance(snap, ProcessSnapshot):
        return snap
    return ProcessSnapshot(
        topic=snap.topic,
        state=snap.state,
        ready=snap.ready,
        alive=snap.alive,
        grpc_port=snap.grpc_port,
        advertised_endpoint=snap.advertised_endpoint,
        assigned=(snap.partition,),
        partitions=(snap,),
    )
