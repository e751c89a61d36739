"""Fleet pieces that need nothing: the revoke policy, the default process count, how
`triage status` finds the process serving each partition, the process /status document
and metrics of a process serving several partitions."""

from __future__ import annotations

from prometheus_client.core import Metric

from triage_cli.deploy import default_proxies
from triage_cli.status.render import served_by_notes
from triage_cli.status.report import ProxyView, partition_views
from triage_proxy.kafka.assignment import serving_target
from triage_proxy.observe.metrics import metric_families
from triage_proxy.observe.snapshot import ProcessSnapshot, ProxySnapshot, as_process

ASSIGNED = frozenset({0, 2, 4})


def test_revoked_partitions_are_served_until_the_grace_passes() -> None:
    assert serving_target(ASSIGNED, None, 100.0, 15.0) == ASSIGNED
    assert serving_target(ASSIGNED, 90.0, 100.0, 15.0) == ASSIGNED  # rebalancing
    assert serving_target(ASSIGNED, 80.0, 100.0, 15.0) == frozenset()  # no answer in time
    assert serving_target(frozenset(), None, 0.0, 15.0) == frozenset()


def test_default_proxies_is_one_per_core_never_more_than_partitions() -> None:
    assert default_proxies(6, 2) == 2
    assert default_proxies(1, 8) == 1
    assert default_proxies(64, None) == 1


def part(partition: int, *, ready: bool = True, state: str = "running") -> ProxySnapshot:
    return ProxySnapshot(topic="t", partition=partition, state=state, ready=ready, grpc_port=7700)


def process(pid: int, *parts: ProxySnapshot) -> ProcessSnapshot:
    return ProcessSnapshot(
        topic="t",
        state="running",
        ready=True,
        alive=True,
        grpc_port=7700 + pid,
        advertised_endpoint=f"h:{7700 + pid}",
        owner=f"h:{pid}:x",
        pid=pid,
        mode="fleet",
        assigned=tuple(p.partition for p in parts),
        partitions=parts,
    )


def test_status_takes_each_row_from_the_process_serving_it() -> None:
    a = ProxyView(url="http://h:9700/status", doc=process(11, part(0), part(2)).to_json())
    b = ProxyView(
        url="http://h:9701/status",
        doc=process(12, part(1), part(2, ready=False, state="standby")).to_json(),
    )
    down = ProxyView(url="http://h:9702/status", error="refused")
    views = partition_views([a, b, down, down], 4)
    assert [v.doc["served_by"]["pid"] if v.doc else None for v in views] == [11, 12, 11, None]
    assert views[3].error == "refused"


def test_a_partition_no_process_lists_is_down_with_the_reason() -> None:
    a = ProxyView(url="http://h:9700/status", doc=process(11, part(0)).to_json())
    b = ProxyView(url="http://h:9701/status", doc=process(12).to_json())
    views = partition_views([a, b], 2)
    assert views[1].doc is None
    assert views[1].error == "no proxy process serves partition 1"


def test_an_older_one_partition_document_is_its_partitions() -> None:
    old = ProxyView(url="u", doc={"partition": 0, "state": "running"})
    assert partition_views([old], 1) == [old]


def test_served_by_notes_only_when_a_process_serves_several() -> None:
    rows = [
        {"partition": p, "proxy": "running", "served_by": {"pid": pid, "endpoint": "e"}}
        for p, pid in ((0, 1), (1, 2), (2, 1))
    ]
    assert served_by_notes(rows) == [
        "process pid 1 (e) serves partitions 0, 2",
        "process pid 2 (e) serves partitions 1",
    ]
    assert served_by_notes(rows[:2]) == []


def test_a_one_partition_process_document_keeps_the_partition_fields_on_top() -> None:
    doc = as_process(part(3)).to_json()
    assert (doc["partition"], doc["state"], doc["served"]) == (3, "running", [3])
    many = process(1, part(0), part(1)).to_json()
    assert "partition" not in many
    assert [d["partition"] for d in many["partitions"]] == [0, 1]
    assert many["served"] == [0, 1]


def test_metrics_have_one_sample_per_partition_in_each_family() -> None:
    families: list[Metric] = list(metric_families(part(0), part(5)))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # one family each, never a duplicate
    ready = next(f for f in families if f.name == "triage_ready")
    assert sorted(s.labels["partition"] for s in ready.samples) == ["0", "5"]
