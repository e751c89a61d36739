"""What one proxy process reports, as Prometheus metrics: the `ProxySnapshot` of every
partition it runs (its `ProcessSnapshot`), rendered at scrape time.

Why collected at scrape time: the dispatcher, committer and dead-letter writer already
keep the totals an operator asks for (`dispatcher.Counters` and friends), so a custom
Collector reads them (through `Proxy.snapshot`) when Prometheus scrapes and the hot path
pays nothing. The one per-message measure, the settle latency, is a `LatencyHistogram`
(snapshot.py), exported here as a Prometheus histogram.

Each proxy has its own `CollectorRegistry` (tests run several proxies in one process,
and the global registry would mix them). Every metric carries `topic` and `partition`;
a process serving several partitions exports one sample per partition in each family:

    counters   triage_fetched_total, triage_delivered_total, triage_redelivered_total,
               triage_acked_total, triage_nacked_total, triage_retried_total,
               triage_expired_total, triage_rejected_total, triage_dead_lettered_total,
               triage_commits_total
    histogram  triage_settle_latency_seconds (delivery -> ack or nack)
    gauges     triage_in_flight, triage_in_window_messages, triage_in_window_bytes,
               triage_window_max_messages, triage_window_max_bytes,
               triage_committed_offset, triage_log_end_offset, triage_lag,
               triage_connected_instances, triage_oldest_unsettled_age_seconds,
               triage_dead_letters_pending, triage_ready (1 while delivering),
               triage_dead_letters_unwritable (dead letters that can never be written as
               they are, held so the commit waits at the first: alert on > 0)

Push targets (`[[push]]`) have families of their own, labelled `target`:

    gauges     triage_push_limit (the adaptive concurrency limit), triage_push_in_flight,
               triage_push_paused (1 while the target waits out an outage or refusal)
    counters   triage_push_requests_total{class: 2xx, 4xx, 5xx, timeout, refused, ...},
               triage_push_records_total{verdict: ack, nack, retry, overload, ...},
               triage_push_errors_total (requests that got no answer)
    histogram  triage_push_latency_seconds (request round trips that got an answer)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from triage_proxy.observe.snapshot import (
    ProcessSnapshot,
    ProxySnapshot,
    PushTargetSnapshot,
    as_process,
)

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


def metric_families(*snaps: ProxySnapshot) -> Iterator[Metric]:
    """Render partition snapshots as Prometheus metric families, one sample per partition
    in each (pure: tests call it directly)."""
    labels = ["topic", "partition"]

    def values(snap: ProxySnapshot) -> list[str]:
        return [snap.topic, str(snap.partition)]

    def gauge(
        name: str, doc: str, value: Callable[[ProxySnapshot], float | None]
    ) -> Iterator[Metric]:
        family = GaugeMetricFamily(f"triage_{name}", doc, labels=labels)
        found = False
        for snap in snaps:
            v = value(snap)
            if v is not None:
                family.add_metric(values(snap), v)
                found = True
        if found:
            yield family

    for name in COUNTERS:
        family = CounterMetricFamily(
            f"triage_{name}", f"Records {name.replace('_', ' ')} so far.", labels=labels
        )
        for snap in snaps:
            family.add_metric(values(snap), snap.counters.get(name, 0))
        yield family
    commits = CounterMetricFamily("triage_commits", "Offset commits Kafka took.", labels=labels)
    for snap in snaps:
        commits.add_metric(values(snap), snap.counters.get("commits", 0))
    yield commits
    timed = [snap for snap in snaps if snap.settle_latency is not None]
    if timed:
        hist = HistogramMetricFamily(
            "triage_settle_latency_seconds",
            "Time from a delivery to its ack or nack.",
            labels=labels,
        )
        for snap in timed:
            h = snap.settle_latency
            assert h is not None
            hist.add_metric(values(snap), h.cumulative(), h.total)
        yield hist
    yield from gauge(
        "ready", "1 while the proxy is running and delivering.", lambda s: float(s.ready)
    )
    yield from gauge("in_flight", "Delivered and unsettled records.", lambda s: s.in_flight)
    yield from gauge("in_window_messages", "Fetched and unsettled records.", lambda s: s.in_window)
    yield from gauge("in_window_bytes", "Payload bytes of the window.", lambda s: s.window_bytes)
    yield from gauge("window_max_messages", "window.max_messages.", lambda s: s.window_max_messages)
    yield from gauge("window_max_bytes", "window.max_bytes.", lambda s: s.window_max_bytes)
    yield from gauge("committed_offset", "Last committed offset.", lambda s: s.committed_offset)
    yield from gauge(
        "log_end_offset", "The partition's log end offset.", lambda s: s.log_end_offset
    )
    yield from gauge("lag", "Log end offset minus committed offset.", lambda s: s.lag)
    yield from gauge(
        "connected_instances", "Connected consumer instances.", lambda s: len(s.instances)
    )
    yield from gauge(
        "oldest_unsettled_age_seconds",
        "Age of the oldest unsettled record in the window (0 when empty).",
        lambda s: s.oldest_unsettled_age_s or 0.0 if s.committed_offset is not None else None,
    )
    yield from gauge(
        "dead_letters_pending", "Dead letters not yet durable.", lambda s: s.dead_letters_pending
    )
    yield from gauge(
        "dead_letters_unwritable",
        "Dead letters that can never be written as they are (over DynamoDB's item limit): "
        "held, so the commit waits at the first; see /status for the offset and the fix.",
        lambda s: s.dead_letters_unwritable,
    )


def push_families(targets: Iterable[PushTargetSnapshot]) -> Iterator[Metric]:
    """Render push targets as metric families, one sample per target (pure)."""
    targets = list(targets)
    if not targets:
        return
    limit = GaugeMetricFamily("triage_push_limit", "Adaptive concurrency limit.", labels=["target"])
    flight = GaugeMetricFamily("triage_push_in_flight", "Requests in flight.", labels=["target"])
    paused = GaugeMetricFamily(
        "triage_push_paused", "1 while the target waits (outage, refusal).", labels=["target"]
    )
    requests = CounterMetricFamily(
        "triage_push_requests", "Requests by answer class.", labels=["target", "class"]
    )
    records = CounterMetricFamily(
        "triage_push_records", "Records by verdict.", labels=["target", "verdict"]
    )
    errors = CounterMetricFamily(
        "triage_push_errors", "Requests that got no answer.", labels=["target"]
    )
    latency = HistogramMetricFamily(
        "triage_push_latency_seconds", "Request round trips that got an answer.", labels=["target"]
    )
    for t in targets:
        limit.add_metric([t.name], t.limit)
        flight.add_metric([t.name], t.in_flight)
        paused.add_metric([t.name], float(t.state != "ok"))
        for kind, n in sorted(t.responses.items()):
            requests.add_metric([t.name, kind], n)
        for verdict, n in sorted(t.records.items()):
            records.add_metric([t.name, verdict], n)
        errors.add_metric([t.name], t.errors)
        latency.add_metric([t.name], t.latency.cumulative(), t.latency.total)
    yield from (limit, flight, paused, requests, records, errors, latency)


class ProxyCollector(Collector):
    """Reads one proxy process (every partition it runs) at scrape time."""

    def __init__(self, snapshot: Callable[[], ProcessSnapshot | ProxySnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        process = as_process(self._snapshot())
        return [*metric_families(*process.partitions), *push_families(process.push)]


def proxy_registry(snapshot: Callable[[], ProcessSnapshot | ProxySnapshot]) -> CollectorRegistry:
    """A registry of its own for the proxy `snapshot` reads (never the process-global one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProxyCollector(snapshot))
    return registry
