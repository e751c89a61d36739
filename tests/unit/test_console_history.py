"""The console's last hour: lag, rates from running counters, rebalances (pure)."""

from __future__ import annotations

from typing import Any

from triage_cli.console.history import History


def report(*rows: dict[str, Any], pending: int | None = 0) -> dict[str, Any]:
    return {"partitions": list(rows), "totals": {"dead_letters_pending": pending}}


def row(
    partition: int, lag: int | None, owner: str | None = "a", **counters: int
) -> dict[str, Any]:
    served = {"owner": owner, "pid": 1} if owner else None
    return {
        "partition": partition,
        "lag": lag,
        "proxy": "running" if owner else "down",
        "served_by": served,
        "counters": counters,
    }


def test_rates_are_counter_differences_per_second() -> None:
    h = History()
    first = h.add(report(row(0, 5, acked=10, nacked=1, dead_lettered=1)), at=100.0)
    assert first.rates == {"acked": None, "nacked": None, "dead_lettered": None}
    second = h.add(report(row(0, 3, acked=30, nacked=3, dead_lettered=2)), at=102.0)
    assert second.rates == {"acked": 10.0, "nacked": 1.0, "dead_lettered": 0.5}
    assert second.partition_rates == {0: {"acked": 10.0, "nacked": 1.0, "dead_lettered": 0.5}}
    assert h.last_rates() == {"0": {"acked": 10.0, "nacked": 1.0, "dead_lettered": 0.5}}


def test_a_restarted_proxy_never_gives_a_negative_rate() -> None:
    h = History()
    h.add(report(row(0, 0, acked=1000)), at=0.0)
    restarted = h.add(report(row(0, 0, acked=4)), at=2.0)
    assert restarted.rates["acked"] == 2.0


def test_another_process_starts_its_counters_afresh() -> None:
    h = History()
    h.add(report(row(0, 0, owner="a", acked=1000)), at=0.0)
    moved = h.add(report(row(0, 0, owner="b", acked=5)), at=1.0)
    assert moved.rates["acked"] is None  # no earlier sample of process b
    assert [(r.partition, r.before, r.after) for r in h.rebalances] == [(0, "a", "b")]


def test_rebalances_include_a_partition_nobody_serves() -> None:
    h = History()
    h.add(report(row(0, 0, owner="a"), row(1, 0, owner="a")), at=0.0)
    h.add(report(row(0, 0, owner="a"), row(1, None, owner=None)), at=1.0)
    h.add(report(row(0, 0, owner="a"), row(1, 0, owner="b")), at=2.0)
    assert [(r.partition, r.before, r.after) for r in h.rebalances] == [
        (1, "a", None),
        (1, None, "b"),
    ]


def test_series_are_columns_with_gaps_and_a_total() -> None:
    h = History()
    h.add(report(row(0, 5), row(1, 2), pending=3), at=10.0)
    h.add(report(row(0, 4), row(1, None), pending=None), at=11.0)
    series = h.series()
    assert series["t"] == [10.0, 11.0]
    assert series["lag"] == {"0": [5, 4], "1": [2, None]}
    assert series["lag_total"] == [7, None]
    assert series["pending"] == [3, None]
    assert set(series) == {"t", "lag", "lag_total", "acked", "nacked", "dead_lettered", "pending"}


def test_only_the_last_window_is_kept() -> None:
    h = History(window_s=60.0)
    for second in range(0, 600, 3):
        h.add(report(row(0, second, owner=str(second // 30))), at=float(second))
    assert len(h.samples) == 21
    assert h.samples[0].at >= 597 - 60
    assert all(r.at >= 597 - 60 for r in h.rebalances)
    assert len(h.rebalances) == 2
