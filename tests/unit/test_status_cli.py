"""`triage status`: joining the sources and rendering (pure parts, no broker)."""

from __future__ import annotations

import dataclasses
import socket
from typing import Any

from rich.console import Console

from triage_cli.status.render import render_table
from triage_cli.status.report import (
    BrokerView,
    ProxyView,
    Report,
    mine_only,
    missing_table_hint,
    partition_row,
)
from triage_cli.status.sources import Sources, fetch_status
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.settings import Settings
from triage_proxy.exitcodes import ExitCode

RUNNING: dict[str, Any] = {
    "state": "running",
    "in_flight": 3,
    "connected_instances": 1,
    "instances": [{"consumer_id": "c1", "credits": 10, "held": 3}],
    "oldest_unsettled_age_s": 2.5,
    "dead_letters_pending": 1,
    "log_end_offset": 12,
}


def test_lag_is_log_end_minus_committed_and_the_proxy_can_raise_the_log_end() -> None:
    broker = BrokerView(committed={0: 4}, low={0: 0}, high={0: 10})
    row = partition_row(0, broker, ProxyView("u", doc=RUNNING), 2)
    # Tansu's watermark can trail what the proxy fetched: the larger one is the log end.
    assert (row["committed_offset"], row["log_end_offset"], row["lag"]) == (4, 12, 8)
    assert row["proxy"] == "running"
    assert row["instances"] == ["c1"]
    assert (row["in_flight"], row["connected_instances"]) == (3, 1)
    assert (row["dead_letters_pending"], row["dead_letters_writing"]) == (2, 1)


def test_nothing_committed_counts_lag_from_the_low_watermark() -> None:
    broker = BrokerView(committed={0: None}, low={0: 3}, high={0: 10})
    row = partition_row(0, broker, ProxyView("u", error="refused"), 0)
    assert (row["committed_offset"], row["lag"]) == (None, 7)
    assert row["proxy"] == "down"
    assert row["proxy_error"] == "refused"
    assert row["in_flight"] is None


def test_unreadable_broker_leaves_offsets_unknown() -> None:
    row = partition_row(0, BrokerView(error="down"), ProxyView(None), None)
    assert (row["committed_offset"], row["log_end_offset"], row["lag"]) == (None, None, None)
    assert row["proxy"] == "unobserved"


def report() -> Report:
    broker = BrokerView(committed={0: 4, 1: 0}, low={0: 0, 1: 0}, high={0: 10, 1: 3})
    return Report(
        topic="orders",
        group_id="g",
        partitions=[
            partition_row(0, broker, ProxyView("u0", doc=RUNNING), 2),
            partition_row(1, broker, ProxyView("http://h:1/status", error="refused"), 0),
        ],
        generated_at="2026-01-01T00:00:00+00:00",
    )


def test_totals_are_unknown_when_any_partition_is() -> None:
    doc = report().to_json()
    assert doc["totals"] == {
        "lag": 8 + 3,
        "in_flight": None,  # partition 1's proxy is down
        "dead_letters_pending": 2,
        "proxies_down": 1,
        "processes_down": 0,  # no process was asked in this report
    }
    assert report().proxies_down == [1]


def test_the_table_fits_80_columns_and_names_the_down_proxy() -> None:
    console = Console(width=80, record=True, color_system=None)
    console.print(render_table(report()))
    text = console.export_text()
    assert "running" in text
    assert "proxy 1 down (http://h:1/status): refused" in text
    assert "2 (+1)" in text  # pending in the table, +1 still being written
    assert "…" not in text  # nothing truncated at 80 columns


def make_settings(**server: Any) -> Settings:
    return settings_from_dict(
        {
            "kafka": {"bootstrap_servers": "127.0.0.1:1", "topic": "t", "group_id": "g"},
            "auth": {"token": "0123456789abcdef"},
            "dead_letters": {"table": "dlq", "endpoint_url": "http://127.0.0.1:1"},
            "server": server,
        },
        {},
    )


def test_proxy_urls_follow_http_port_and_host() -> None:
    sources = Sources(make_settings(host="0.0.0.0", http_port=9800), None)
    try:
        assert sources.proxy_url(2) == "http://127.0.0.1:9802/status"
    finally:
        sources.close()
    sources = Sources(make_settings(http_port=9800), "proxy.internal")
    try:
        assert sources.proxy_url(0) == "http://proxy.internal:9800/status"
    finally:
        sources.close()
    off = make_settings()
    off = dataclasses.replace(off, server=dataclasses.replace(off.server, http_enabled=False))
    sources = Sources(off, None)
    try:
        assert sources.proxy_url(0) is None
    finally:
        sources.close()


def test_a_fleet_on_aws_is_asked_at_each_tasks_address_and_one_port() -> None:
    """`--target aws`: one process per task, each on its own IP at server.http_port."""
    sources = Sources(make_settings(http_port=9800), None, ["10.0.0.7", "10.0.1.9"])
    try:
        assert sources.proxy_url(0) == "http://10.0.0.7:9800/status"
        assert sources.proxy_url(1) == "http://10.0.1.9:9800/status"
        assert sources.proxy_url(2) is None
    finally:
        sources.close()


def test_a_proxy_that_does_not_answer_is_down_not_a_crash() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        view = fetch_status(f"http://127.0.0.1:{port}/status", timeout=1)
    assert view.doc is None
    assert view.error


def test_an_unwritable_dead_letter_is_named_with_its_offset_and_the_fix() -> None:
    from triage_proxy.deadletters.writer import NO_BUCKET_FIX
    from triage_proxy.observe.snapshot import ProxySnapshot, UnwritableDeadLetter

    held = UnwritableDeadLetter(7, 450_160, 400_000, NO_BUCKET_FIX)
    snap = ProxySnapshot(
        topic="orders",
        partition=0,
        state="running",
        ready=True,
        grpc_port=1,
        dead_letters_pending=2,
        dead_letters_unwritable=2,
        unwritable_dead_letters=(held, dataclasses.replace(held, offset=9)),
        degraded=("commit", "dead_letters_unwritable"),
    )
    broker = BrokerView(committed={0: 7}, low={0: 0}, high={0: 20})
    row = partition_row(0, broker, ProxyView("u", doc=snap.to_json()), 0)
    assert row["degraded"] == ["commit", "dead_letters_unwritable"]
    assert row["dead_letters_unwritable"] == 2
    assert [u["offset"] for u in row["unwritable_dead_letters"]] == [7, 9]
    console = Console(width=80, record=True, color_system=None)
    console.print(render_table(Report("orders", "g", [row])))
    text = " ".join(console.export_text().split())
    assert "partition 0 degraded: commit (retrying)" in text
    assert "the dead letter at offset 7 (and 1 more) cannot be written" in text
    assert "450,160 bytes, over the 400,000 item limit" in text
    assert "Fix: set dead_letters.overflow_bucket" in text


def test_an_older_proxy_without_the_new_fields_renders_as_before() -> None:
    row = partition_row(0, BrokerView(), ProxyView("u", doc=RUNNING), 0)
    assert (row["degraded"], row["dead_letters_unwritable"]) == ([], None)
    assert row["unwritable_dead_letters"] == []
    console = Console(width=80, record=True, color_system=None)
    console.print(render_table(Report("orders", "g", [row])))
    assert "degraded" not in console.export_text()


def test_each_partition_shows_the_endpoint_its_proxy_advertises() -> None:
    nlb = "triage-orders-0123456789abcdef.elb.us-east-1.amazonaws.com"
    broker = BrokerView(committed={0: 4, 1: 0}, low={0: 0, 1: 0}, high={0: 10, 1: 3})
    rows = [
        partition_row(
            0, broker, ProxyView("u0", doc={**RUNNING, "advertised_endpoint": f"{nlb}:7700"}), 0
        ),
        partition_row(1, broker, ProxyView("u1", doc=RUNNING), 0),  # an older proxy
        partition_row(2, broker, ProxyView("u2", error="refused"), 0),
    ]
    assert [row["endpoint"] for row in rows] == [f"{nlb}:7700", None, None]
    console = Console(width=80, record=True, color_system=None)
    console.print(render_table(Report("orders", "g", rows)))
    text = " ".join(console.export_text().split())
    assert f"endpoints (partition host:port): 0 {nlb}:7700" in text
    assert "…" not in console.export_text()


def test_a_process_of_another_deployment_is_not_shown_as_ours() -> None:
    """A process at this config's port that serves another group or table counts as down,
    and the report says plainly that nothing of this deployment is deployed."""
    settings = make_settings()
    other = {**RUNNING, "topic": "t", "group_id": "g", "dead_letter_table": "other-dlq", "pid": 7}
    view = mine_only(ProxyView("http://h:1/status", doc=other), settings)
    assert view.doc is None
    assert view.foreign is not None
    assert "'other-dlq'" in str(view.error)
    assert "another deployment" in str(view.error)
    ours = {**RUNNING, "topic": "t", "group_id": "g", "dead_letter_table": "dlq"}
    assert mine_only(ProxyView("u", doc=ours), settings).doc == ours
    older = {**RUNNING, "topic": "t"}  # a proxy that does not name its group or table
    assert mine_only(ProxyView("u", doc=older), settings).doc == older
    row = partition_row(0, BrokerView(), view, None)
    assert row["proxy"] == "down"
    lonely = Report(
        topic="t", group_id="g", partitions=[row], foreign=[str(view.foreign)], table="dlq"
    )
    assert not lonely.deployed
    assert lonely.to_json()["deployed"] is False
    console = Console(width=200, record=True, color_system=None)
    console.print(render_table(lonely))
    text = console.export_text()
    assert "nothing is deployed for group 'g'" in text
    assert "triage deploy --config" in text
    assert "pid 7" in text


def test_a_missing_dead_letter_table_says_what_to_do() -> None:
    hint = missing_table_hint("table 'dlq' does not exist", "triage.toml")
    assert "triage deploy --config triage.toml" in hint
    assert "dead_letters.table" in hint


def test_the_exit_code_puts_an_unread_source_before_a_missing_table_before_a_down_proxy() -> None:
    """A dead-letter table that could not be read is an outage (3) like the broker's, not
    a clean report: with every proxy up, status exited 0 while DynamoDB was down."""
    up = Report("orders", "g", [partition_row(0, BrokerView(), ProxyView("u0", doc=RUNNING), 0)])
    down = report()  # partition 1's proxy is down
    assert up.exit_code is ExitCode.OK
    assert down.exit_code is ExitCode.FAILURE
    unread = "Could not connect to the endpoint URL"
    assert dataclasses.replace(up, dead_letters_error=unread).exit_code is ExitCode.UNAVAILABLE
    assert dataclasses.replace(down, dead_letters_error=unread).exit_code is ExitCode.UNAVAILABLE
    missing = dataclasses.replace(down, dead_letters_error="no table", dead_letters_missing=True)
    assert missing.exit_code is ExitCode.NOT_FOUND
    assert dataclasses.replace(missing, broker_error="down").exit_code is ExitCode.UNAVAILABLE
