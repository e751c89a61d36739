"""`triage status` with push targets: rows from each process's /status `push` list, the
second table, and `--json` (pure, from sample documents; no broker)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from triage_cli.status.render import render_push_table, render_report
from triage_cli.status.report import BrokerView, ProxyView, Report, partition_row, push_rows
from triage_proxy.observe.snapshot import PUSH_BUCKETS_S, LatencyHistogram, PushTargetSnapshot

OUTAGE = "outage: cannot connect to 127.0.0.1:9 (Connection refused) (waiting 3.2 s)"


def target(name: str, partition: int, **changes: Any) -> dict[str, Any]:
    """A target's /status entry as the proxy renders it."""
    latency = LatencyHistogram(PUSH_BUCKETS_S)
    for seconds in (0.004, 0.004, 0.004, 0.2):
        latency.observe(seconds)
    fields: dict[str, Any] = {
        "name": name,
        "limit": 12,
        "in_flight": 3,
        "partitions": (partition,),
        "state": "ok",
        "latency": latency,
        "responses": {"2xx": 120, "4xx": 1, "timeout": 2},
        "records": {"ack": 120, "nack": 1, "retry": 2},
        "errors": 2,
    }
    fields.update(changes)
    return PushTargetSnapshot(**fields).to_json()


def process(pid: int, partition: int, push: list[dict[str, Any]]) -> ProxyView:
    doc = {
        "state": "running",
        "pid": pid,
        "partitions": [{"partition": partition, "state": "running", "ready": True}],
        "push": push,
    }
    return ProxyView(f"http://127.0.0.1:{9800 + partition}/status", doc=doc)


def report(views: list[ProxyView]) -> Report:
    broker = BrokerView(committed={0: 4, 1: 0}, low={0: 0, 1: 0}, high={0: 10, 1: 3})
    return Report(
        topic="orders",
        group_id="g",
        partitions=[partition_row(p, broker, views[p], 0) for p in range(len(views))],
        generated_at="2026-01-01T00:00:00+00:00",
        push=push_rows(views),
    )


def views_with_push() -> list[ProxyView]:
    return [
        process(101, 0, [target("orders-http", 0)]),
        process(102, 1, [target("orders-http", 1, state=OUTAGE, in_flight=0)]),
    ]


def test_each_process_lists_its_targets_with_the_process() -> None:
    rows = push_rows([*views_with_push(), ProxyView("http://h:1/status", error="refused")])
    assert [(r["name"], r["partitions"], r["pid"]) for r in rows] == [
        ("orders-http", [0], 101),
        ("orders-http", [1], 102),
    ]
    assert rows[0]["proxy_url"] == "http://127.0.0.1:9800/status"


def test_json_carries_every_field_of_the_status_document() -> None:
    doc = report(views_with_push()).to_json()
    first = doc["push"][0]
    assert first["limit"] == 12
    assert first["in_flight"] == 3
    assert first["latency_p50_s"] == 0.005  # a bucket bound
    assert first["latency_p99_s"] == 0.2
    assert first["responses"] == {"2xx": 120, "4xx": 1, "timeout": 2}
    assert first["records"] == {"ack": 120, "nack": 1, "retry": 2}
    assert first["errors"] == 2
    assert doc["push"][1]["state"] == OUTAGE


def test_the_push_table_fits_80_columns_and_says_why_a_target_waits() -> None:
    console = Console(width=80, record=True, color_system=None)
    console.print(render_report(report(views_with_push())))
    text = console.export_text()
    assert "push targets" in text
    assert "orders-http" in text
    assert "5ms" in text  # p50
    assert "200ms" in text  # p99
    assert "2xx 120" in text
    assert "timeout 2" in text
    rows = [line.split() for line in text.splitlines() if line.startswith(" orders-http ")]
    assert [row[:3] for row in rows] == [["orders-http", "0", "ok"], ["orders-http", "1", "outage"]]
    words = " ".join(text.split())
    assert f"orders-http (partitions 1): {OUTAGE}" in words  # the reason, in full
    assert "…" not in text


def test_no_push_targets_no_second_table() -> None:
    views = [process(101, 0, []), ProxyView("http://h:1/status", error="refused")]
    assert render_push_table(report(views)) is None
    console = Console(width=80, record=True, color_system=None)
    console.print(render_report(report(views)))
    assert "push targets" not in console.export_text()
    assert report(views).to_json()["push"] == []


def test_a_proxy_without_push_in_its_document_shows_none() -> None:
    """A proxy from before push answers /status without a `push` list."""
    view = ProxyView("u", doc={"state": "running", "partitions": []})
    assert push_rows([view]) == []
