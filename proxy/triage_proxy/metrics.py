"""What one proxy reports: a snapshot of its state, as Prometheus metrics and as /status.

Why collected at scrape time: the dispatcher, committer and dead-letter writer already
keep the totals an operator asks for (`dispatcher.Counters` and friends), so a custom
Collector reads them when Prometheus scrapes and the hot path pays nothing. The one
per-message measure, the settle latency, is a `LatencyHistogram`: plain bucket counts
bumped on the event-loop thread (no lock; ~0.2 us per settled delivery, within the
noise of a ~1 us settle, measured by `tests/perf/bench_metrics.py`), exported as a
Prometheus histogram (prometheus-client's own takes a lock per observation).

Each proxy has its own `CollectorRegistry` (tests run several proxies in one process,
and the global registry would mix them). Every metric carries `topic` and `partition`:

    counters   triage_fetched_total, triage_delivered_total, triage_redelivered_total,
               triage_acked_total, triage_nacked_total, triage_retried_total,
               triage_expired_total, triage_rejected_total, triage_dead_lettered_total,
               triage_commits_total
    histogram  triage_settle_latency_seconds (delivery -> ack or nack)
    gauges     triage_in_flight, triage_in_window_messages, triage_in_window_bytes,
               triage_window_max_messages, triage_window_max_bytes,
               triage_committed_offset, triage_log_end_offset, triage_lag,
               triage_connected_instances, triage_oldest_unsettled_age_seconds,
               triage_dead_letters_pending, triage_ready (1 while delivering)
"""

from __future__ import annotations

import dataclasses
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

if TYPE_CHECKING:
    from triage_proxy.app import Proxy

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

COUNTERS = (
    "fetched",
    "delivered",
    "redelivered",
    "acked",
    "nacked",
    "retried",
    "expired",
    "rejected",
    "dead_lettered",
)
"""`dispatcher.Counters` fields exported as `triage_<name>_total`."""


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

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

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
class Snapshot:
    """One proxy's state at one moment; metrics and /status both render it."""

    topic: str
    """The proxied topic."""
    partition: int
    """The partition this proxy owns."""
    state: str
    """`ProxyState` value (starting, standby, running, stopping, ...)."""
    ready: bool
    """Running and delivering (what /readyz answers)."""
    grpc_port: int
    """The gRPC port bound (0 before it listens)."""
    committed_offset: int | None = None
    """The offset Kafka last acknowledged as committed (None before Kafka is open)."""
    log_end_offset: int | None = None
    """The partition's log end: the broker's high watermark, at least what was fetched."""
    log_end_age_s: float | None = None
    """How old the high watermark reading is (it is polled, see watermark.py)."""
    in_flight: int = 0
    """Delivered and unsettled, plus dead letters not yet durable."""
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
    """Dead letters handed to the writer and not yet durable."""
    fetch_paused: bool = False
    """The window is full, so fetching waits."""
    degraded: tuple[str, ...] = ()
    """Parts that are failing and retrying: "fetch", "commit", "dead_letters", "log_end"."""
    counters: dict[str, int] = field(default_factory=dict)
    """Running totals (`dispatcher.Counters` fields and `commits`)."""
    settle_latency: LatencyHistogram | None = None
    """Delivery -> settle latency so far (None before Kafka is open)."""

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
        doc["instances"] = [dataclasses.asdict(i) for i in self.instances]
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


def snapshot(proxy: Proxy, *, now: float | None = None) -> Snapshot:
    """Read `proxy`'s components as they are now (they appear once Kafka is open)."""
    now = time.monotonic() if now is None else now
    settings = proxy.settings
    base: dict[str, Any] = {
        "topic": settings.kafka.topic,
        "partition": proxy.partition,
        "state": proxy.state.value,
        "ready": proxy.is_ready,
        "grpc_port": proxy.port,
        "window_max_messages": settings.window.max_messages,
        "window_max_bytes": settings.window.max_bytes,
    }
    dispatcher, committer = proxy.dispatcher, proxy.committer
    if dispatcher is None or committer is None:
        return Snapshot(**base)
    degraded: list[str] = []
    if proxy.fetcher is not None and proxy.fetcher.degraded:
        degraded.append("fetch")
    if committer.degraded:
        degraded.append("commit")
    writer, watermarks = proxy.writer, proxy.watermarks
    if writer is not None and writer.degraded:
        degraded.append("dead_letters")
    log_end: int | None = None
    log_end_age: float | None = None
    if watermarks is not None:
        if watermarks.degraded:
            degraded.append("log_end")
        log_end = watermarks.log_end
        if watermarks.checked_at is not None:
            log_end_age = now - watermarks.checked_at
    oldest = dispatcher.oldest_fetched_at
    counters = dataclasses.asdict(dispatcher.counters)
    counters["commits"] = committer.commits
    return Snapshot(
        **base,
        committed_offset=committer.committed,
        log_end_offset=log_end,
        log_end_age_s=log_end_age,
        in_flight=dispatcher.in_flight,
        in_window=dispatcher.in_window,
        window_bytes=dispatcher.window_bytes,
        queued=dispatcher.queued,
        instances=tuple(
            Instance(s.consumer_id, s.credits, len(s.held)) for s in dispatcher.sessions
        ),
        oldest_unsettled_age_s=None if oldest is None else max(0.0, now - oldest),
        dead_letters_pending=writer.pending if writer is not None else 0,
        fetch_paused=proxy.fetcher.paused if proxy.fetcher is not None else False,
        degraded=tuple(degraded),
        counters=counters,
        settle_latency=dispatcher.settle_latency,
    )


def metric_families(snap: Snapshot) -> Iterator[Metric]:
    """Render a snapshot as Prometheus metric families (pure: tests call it directly)."""
    labels = ["topic", "partition"]
    values = [snap.topic, str(snap.partition)]

    def gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
        if value is not None:
            family = GaugeMetricFamily(f"triage_{name}", doc, labels=labels)
            family.add_metric(values, value)
            yield family

    for name in COUNTERS:
        family = CounterMetricFamily(
            f"triage_{name}", f"Records {name.replace('_', ' ')} so far.", labels=labels
        )
        family.add_metric(values, snap.counters.get(name, 0))
        yield family
    commits = CounterMetricFamily("triage_commits", "Offset commits Kafka took.", labels=labels)
    commits.add_metric(values, snap.counters.get("commits", 0))
    yield commits
    if snap.settle_latency is not None:
        h = snap.settle_latency
        hist = HistogramMetricFamily(
            "triage_settle_latency_seconds",
            "Time from a delivery to its ack or nack.",
            labels=labels,
        )
        hist.add_metric(values, h.cumulative(), h.total)
        yield hist
    yield from gauge("ready", "1 while the proxy is running and delivering.", float(snap.ready))
    yield from gauge("in_flight", "Delivered and unsettled records.", snap.in_flight)
    yield from gauge("in_window_messages", "Fetched and unsettled records.", snap.in_window)
    yield from gauge("in_window_bytes", "Payload bytes of the window.", snap.window_bytes)
    yield from gauge("window_max_messages", "window.max_messages.", snap.window_max_messages)
    yield from gauge("window_max_bytes", "window.max_bytes.", snap.window_max_bytes)
    yield from gauge("committed_offset", "Last committed offset.", snap.committed_offset)
    yield from gauge("log_end_offset", "The partition's log end offset.", snap.log_end_offset)
    yield from gauge("lag", "Log end offset minus committed offset.", snap.lag)
    yield from gauge("connected_instances", "Connected consumer instances.", len(snap.instances))
    yield from gauge(
        "oldest_unsettled_age_seconds",
        "Age of the oldest unsettled record in the window (0 when empty).",
        snap.oldest_unsettled_age_s or 0.0 if snap.committed_offset is not None else None,
    )
    yield from gauge(
        "dead_letters_pending", "Dead letters not yet durable.", snap.dead_letters_pending
    )


class ProxyCollector(Collector):
    """Reads one proxy at scrape time."""

    def __init__(self, proxy: Proxy) -> None:
        self._proxy = proxy

    def collect(self) -> Iterable[Metric]:
        return list(metric_families(snapshot(self._proxy)))


def proxy_registry(proxy: Proxy) -> CollectorRegistry:
    """A registry of its own for `proxy` (never the process-global one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProxyCollector(proxy))
    return registry
