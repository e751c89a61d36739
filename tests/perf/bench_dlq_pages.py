"""First page of the dead-letter view on a table of 100,000 dead letters: index vs scan.

Why: the console (issue 27) and `triage dlq list` must open the default view ("this
deployment's pending dead letters, newest first") in <= 2 s on a table of 100,000 dead
letters against the embedded DynamoDB endpoint, and never hold more than a page. The
two ways compared, on the same table in the same run:
- the page (`store.pages.page`): one Query on the `by-state` index, Limit = page size,
  timed with a table view that has not yet checked the index (DescribeTable + GetItem
  of the marker are in the figure);
- the scan the tools used before: every pending item of the deployment read with
  `DeadLetterTable.scan(..., attributes=LIST_ATTRIBUTES)`, sorted, the first page kept.
It also times (3 runs each) counts by reason over the default view (capped at 5,000 items) and the
first page of a filter that matches nothing (bounded calls).

Run as a script: ``.venv/bin/python -m tests.perf.bench_dlq_pages [N] [--old-runs K]``.
It starts its own moto server (stopped at the end, even on error), writes N dead
letters (default 100,000; 90% pending, 10 partitions, 4 reasons, a minute apart) with
BatchWriteItem from a few threads, then times each way 5 times (the scan `--old-runs`
times, default 5) and prints min / median / max and the ratio of the medians. Exits 1
when the median first page misses TARGET_S.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3

from tests.samples import GROUP, T0
from triage_cli.embedded import EmbeddedAWS
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.store.items import STATE_ATTR, item_from_dead_letter, state_key
from triage_proxy.store.pages import page, reason_counts
from triage_proxy.store.provisioning import create_table
from triage_proxy.store.query import LIST_ATTRIBUTES, DeadLetterTable, Filters
from triage_proxy.structs import DeadLetter, Record

N = 100_000
RUNS = 5
EXTRA_RUNS = 3
PAGE = 50
TARGET_S = 2.0
PARTITIONS = 10
REASONS = (
    "ValueError: invalid literal for int()",
    "TimeoutError: downstream took 30 s",
    "KeyError: 'customer_id'",
    "ConnectionError: payment service refused",
)
WRITERS = 4
TOPIC = "orders"


def item(n: int) -> dict[str, Any]:
    """Dead letter n as the proxy writes it: ~300 bytes, every 10th one replayed."""
    record = Record(
        topic=TOPIC,
        partition=n % PARTITIONS,
        offset=n // PARTITIONS,
        key=f"order-{n}".encode(),
        value=b'{"order": %d, "items": ["a", "b", "c"], "note": "%s"}' % (n, b"x" * 120),
        headers=(("trace-id", os.urandom(8)),),
        timestamp_ms=T0 + n * 60_000,
    )
    dl = DeadLetter(record, REASONS[n % len(REASONS)], 5, "worker-1", T0 + n * 60_000)
    built = item_from_dead_letter(dl, GROUP)
    if n % 10 == 9:
        built["status"] = {"S": "replayed"}
        built[STATE_ATTR] = {"S": state_key("replayed", GROUP)}
    return built


def fill(client: Any, table: str, n: int) -> float:
    """Write n items with BatchWriteItem (25 a call) from WRITERS threads; seconds taken."""

    def write(start: int) -> None:
        requests = [{"PutRequest": {"Item": item(i)}} for i in range(start, min(start + 25, n))]
        while requests:
            left = client.batch_write_item(RequestItems={table: requests})
            requests = left.get("UnprocessedItems", {}).get(table, [])

    began = time.perf_counter()
    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(write, range(0, n, 25)))
    return time.perf_counter() - began


def timed(fn: Callable[[], Any], runs: int) -> tuple[list[float], Any]:
    times = []
    result = None
    for _ in range(runs):
        began = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - began)
    return times, result


def line(name: str, times: list[float]) -> str:
    return (
        f"{name:<34} min {min(times):7.3f} s  median {statistics.median(times):7.3f} s  "
        f"max {max(times):7.3f} s  ({len(times)} runs)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", nargs="?", type=int, default=N)
    parser.add_argument("--old-runs", type=int, default=RUNS)
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(
        f"bench_dlq_pages: {args.n} dead letters, page of {PAGE}, commit {commit or '?'}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    with EmbeddedAWS() as aws:
        settings = DeadLetterSettings(table="bench-dlq-pages", endpoint_url=aws.endpoint_url)
        create_table(settings)
        client = boto3.session.Session().client(
            "dynamodb",
            region_name="us-east-1",
            endpoint_url=aws.endpoint_url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        took = fill(client, settings.table, args.n)
        print(f"wrote {args.n} items in {took:.1f} s ({args.n / took:,.0f} items/s)")
        pending = Filters(status="pending")
        want = sum(1 for i in range(args.n) if i % 10 != 9)

        def first_page() -> Any:
            view = DeadLetterTable(settings, group=GROUP, dynamodb=client)  # index unchecked
            return page(view, pending, None, PAGE)

        new, got = timed(first_page, RUNS)
        assert got.mode == "index", got.mode
        assert len(got.items) == PAGE
        newest = [i["dead_lettered_at"]["S"] for i in got.items]
        assert newest == sorted(newest, reverse=True)

        print(line("first page, index (new)", new), flush=True)
        view = DeadLetterTable(settings, group=GROUP, dynamodb=client)
        counts, by_reason = timed(lambda: reason_counts(view, pending), EXTRA_RUNS)
        print(
            line("counts by reason, cap 5,000", counts)
            + f"  -> {by_reason.counted} counted, complete={by_reason.complete}",
            flush=True,
        )
        nothing, empty = timed(
            lambda: page(view, Filters(reason="no such reason"), None), EXTRA_RUNS
        )
        print(
            line("first page, filter matching none", nothing)
            + f"  -> {len(empty.items)} items, {empty.calls} calls, {empty.examined} examined",
            flush=True,
        )

        def old_way() -> list[dict[str, Any]]:
            found = list(view.scan(pending, attributes=LIST_ATTRIBUTES))
            assert len(found) == want, len(found)
            found.sort(key=lambda i: i["dead_lettered_at"]["S"], reverse=True)
            return found[:PAGE]

        old, first_old = timed(old_way, args.old_runs)
        assert [i["offset"] for i in first_old] == [i["offset"] for i in got.items]

    print(line("first page, full scan (before)", old))
    ratio = statistics.median(old) / statistics.median(new)
    print(f"{'ratio of medians (scan / index)':<34} {ratio:.1f}x")
    met = statistics.median(new) <= TARGET_S
    print(f"target: first page <= {TARGET_S} s: {'met' if met else 'NOT met'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
