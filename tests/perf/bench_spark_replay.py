"""Spark replay of N dead letters, local mode with 1 and with 2 cores: items/s and scaling.

Why: the job exists for replays too large for `triage dlq replay`, so what matters is
that it scales with cores (target: at least TARGET_RATIO from local[1] to local[2]).

What it can and cannot show on one machine: the table is moto server, ONE Python
process (so at most one core), sharing the machine with Spark's JVM, its Python
workers and the broker. moto is slow per item: a replay is a scan plus two conditional
updates per item (claim, then mark after the broker's ack), which cost the embedded
launcher (`triage_cli/motoserver.py`) 8-10 ms of CPU per item on the 2-core development
machine, so ~100-120 items/s at most (2026-12-07, `71b4d26`).
So the script measures, and prints side by side:
1. seeding: plain BatchWriteItem (no read-before-write as the proxy's store does) from
   SEED_THREADS threads, the fast path into moto: about 3,300 items/s from eight
   (2026-12-07), so 100,000 items take about half a minute per table;
2. moto-only: the same table work as a replay (parallel scan, claim, mark) with plain
   boto3 threads and no Spark or Kafka;
3. the replay itself (scan -> claim -> produce to Tansu -> mark) of N items in
   local[1], then of N fresh items in local[2], each checked in the table after;
4. labelled apart, an export to Parquet of another N items in local[1] and local[2]:
   the same parallel scan, read-only, so the table does ~20x less work per item and
   the job's own side (rows into the JVM, Parquet writing) weighs more. It is not the
   replay's figure and does not decide the verdict; it shows how far the job's scan
   side scales on this machine when the store is less of the limit.
For each: items/s, how busy moto and the machine were, the CPU per item of moto and
of the client side (the Spark JVM with its Python workers; for the moto-only run, the
boto3 threads), and the HTTP requests moto served per item (counted in its access
log). From these follow the most items/s moto can serve on one full core and what one
core of the job could drive if the table kept up. When moto is nearly a full core busy
already in the 1-core run, the ratio measures moto, not the job, and the verdict says
so. Against DynamoDB, which scales with the cluster, the job's tasks are the limit.

Why moto costs milliseconds per replayed item (profiled with py-spy): a replay makes ~2
requests per item (a conditional UpdateItem to claim, one to mark; the scan adds one
request per page of SCAN_PAGE), and moto's server spends milliseconds of CPU on any
request before DynamoDB work starts (werkzeug's HTTP handling, routing the request to a
backend, Flask, its generic response serializer; no signature checking: moto does no
auth by default), then parses and validates the update and condition expressions (a
mark, with five SETs, if_not_exists and a REMOVE, costs ~1.5x a claim). Batching claims
and marks would cut requests on DynamoDB but not on moto: moto's TransactWriteItems
deep-copies the whole table per call (measured ~190 ms of CPU per item at 2,000 items)
and its BatchExecuteStatement converts every item of every table to JSON per statement,
so per-item UpdateItem is moto's cheapest conditional write.

Run: ``.venv/bin/python -m tests.perf.bench_spark_replay [--items N]``. The default N
is DEFAULT_ITEMS, not 100,000: at moto's ~100 items/s two replays of 100,000 take
over half an hour (the script prints its estimate from the moto-only rate it measured);
``--items 100000`` runs them anyway. It starts its own moto server and
broker (stopped at the end, even on error; the Spark JVMs too) and exits 1 when the
replay misses the target ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from pyspark import SparkContext

from tests.integration.harness import create_topic
from tests.samples import GROUP
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.store.aws import dynamodb_client
from triage_proxy.store.items import item_from_dead_letter, item_key
from triage_proxy.store.provisioning import create_table
from triage_proxy.store.query import DeadLetterTable, Filters
from triage_proxy.structs import DeadLetter, Record
from triage_replay import ReplayOptions, Summary, run_replay
from triage_replay.job import local_session, stop_session
from triage_replay.segment import SCAN_PAGE

DEFAULT_ITEMS = 5_000
"""Two replays of this many take a few minutes against moto (see the module docstring)."""
FULL_ITEMS = 100_000
"""The issue's figure; run it with --items on a quiet machine."""
TARGET_RATIO = 1.6
BUDGET_S = 600.0
"""Longest a default run should take; above it the estimate explains the default."""
CEILING_ITEMS = 600
"""Items scanned, claimed and marked with plain boto3 (the moto-only run)."""
CEILING_THREADS = 8
"""Threads of that measurement (the job's write concurrency per task)."""
SEED_THREADS = 8
"""BatchWriteItem threads while seeding (botocore's pool holds 10 connections)."""
SOURCE_PARTITIONS = 32
"""Source partitions of the seeded items: a parallel scan needs many partition keys."""
SEGMENTS = 8
"""Scan segments (= Spark tasks) of every run, so 1 and 2 cores do the same work."""
VALUE_BYTES = 200
TOPIC = "orders"
BASE_MS = 1_714_564_800_000


def dead_letter(i: int) -> DeadLetter:
    partition, offset = i % SOURCE_PARTITIONS, i // SOURCE_PARTITIONS
    record = Record(
        TOPIC,
        partition,
        offset,
        f"key-{i}".encode(),
        (i.to_bytes(4, "big") * (VALUE_BYTES // 4 + 1))[:VALUE_BYTES],
        (("trace-id", i.to_bytes(8, "big")), ("retry", None)),
        BASE_MS + i,
    )
    return DeadLetter(record, "handler raised ValueError", 5, "bench-worker", BASE_MS + i)


def seed(settings: DeadLetterSettings, n: int) -> float:
    """Create the table and write n dead letters with BatchWriteItem from SEED_THREADS
    threads; returns the seeding rate in items/s."""
    create_table(settings)
    dynamodb = dynamodb_client(settings, read_timeout_s=60, max_attempts=5)
    lock = threading.Lock()
    starts = iter(range(0, n, 25))

    def writer() -> None:
        while True:
            with lock:
                start = next(starts, None)
            if start is None:
                return
            requests = [
                {"PutRequest": {"Item": item_from_dead_letter(dead_letter(i), GROUP)}}
                for i in range(start, min(n, start + 25))
            ]
            pending: dict[str, Any] = {settings.table: requests}
            while pending:
                response = dynamodb.batch_write_item(RequestItems=pending)
                pending = response.get("UnprocessedItems") or {}

    began = time.perf_counter()
    with ThreadPoolExecutor(SEED_THREADS) as pool:
        for future in [pool.submit(writer) for _ in range(SEED_THREADS)]:
            future.result()
    elapsed = time.perf_counter() - began
    dynamodb.close()
    return n / elapsed


@contextmanager
def slow_endpoint_table(settings: DeadLetterSettings) -> Iterator[DeadLetterTable]:
    """table.query's DeadLetterTable on a client that waits as long as moto takes for a page."""
    client = dynamodb_client(settings, read_timeout_s=120, max_attempts=5)
    try:
        with DeadLetterTable(settings, dynamodb=client, group=GROUP) as table:
            yield table
    finally:
        client.close()


def moto_ceiling(settings: DeadLetterSettings) -> tuple[int, float]:
    """(items, seconds) of what a replay asks of the table, with nothing else running:
    read every item (SEGMENTS parallel-scan segments), then claim + mark each with
    table.query's own calls from CEILING_THREADS threads. No Spark, no Kafka."""
    with slow_endpoint_table(settings) as table:
        began = time.perf_counter()

        def segment(i: int) -> list[dict[str, Any]]:
            return list(
                table.scan(Filters(), segment=i, total_segments=SEGMENTS, page_size=SCAN_PAGE)
            )

        def claim_and_mark(item: dict[str, Any]) -> None:
            key = item_key(item)
            assert table.claim(key, "ceiling", lease_s=60)
            assert table.mark_replayed(key, "ceiling", "elsewhere/0/0", item)

        with ThreadPoolExecutor(CEILING_THREADS) as pool:
            items = [item for part in pool.map(segment, range(SEGMENTS)) for item in part]
            list(pool.map(claim_and_mark, items))
        return len(items), time.perf_counter() - began


def count_replayed(settings: DeadLetterSettings) -> int:
    with slow_endpoint_table(settings) as table:
        return sum(1 for _ in table.scan(Filters(status="replayed"), attributes=("status",)))


@dataclass
class Phase:
    name: str
    items: int
    seconds: float
    moto_cores: float
    """moto's CPU time over the phase's wall time (1.0 = one core flat out)."""
    machine_cores: float
    """The whole machine's busy CPU time over the phase's wall time."""

    moto_cpu_s: float
    """moto's CPU seconds over the phase."""
    requests: int
    """HTTP requests moto served during the phase (lines of its access log)."""
    client_cpu_s: float
    """CPU seconds of the side that drives moto: the Spark JVM and its Python workers
    (or, for the moto-only run, this process's boto3 threads)."""

    @property
    def rate(self) -> float:
        return self.items / self.seconds

    @property
    def moto_max_rate(self) -> float:
        """Items/s moto could serve this way with one core flat out (its CPU per item)."""
        return self.items / self.moto_cpu_s if self.moto_cpu_s else float("inf")

    @property
    def client_max_rate(self) -> float:
        """Items/s one core of the client side could drive (its CPU per item)."""
        return self.items / self.client_cpu_s if self.client_cpu_s else float("inf")


def request_count(log: Path) -> int:
    """Requests moto has logged so far: werkzeug writes one access line per request."""
    with log.open("rb") as f:
        return sum(1 for line in f if b' HTTP/1.1" ' in line)


def tree_cpu(pid: int, exclude: Collection[int] = ()) -> float:
    """CPU seconds of a process and its descendants, reaped children included, leaving
    out the processes in `exclude` (moto and the broker, children of this script)."""
    root = psutil.Process(pid)
    skip = set(exclude)
    for other in exclude:
        with contextlib.suppress(psutil.NoSuchProcess):
            skip.update(p.pid for p in psutil.Process(other).children(recursive=True))
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        if proc.pid in skip:
            continue
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


@contextmanager
def cpu_load(aws: EmbeddedAWS) -> Iterator[Callable[[], tuple[float, float]]]:
    """Yields f() -> (moto's, the machine's) CPU seconds used during the block."""
    proc = psutil.Process(aws.pid)
    before = (proc.cpu_times(), psutil.cpu_times())
    after: list[Any] = []

    def used() -> tuple[float, float]:
        (moto0, box0), (moto1, box1) = before, after[0]
        moto = (moto1.user + moto1.system) - (moto0.user + moto0.system)
        box = (box1.user + box1.system) - (box0.user + box0.system)
        return moto, box

    try:
        yield used
    finally:
        after.append((proc.cpu_times(), psutil.cpu_times()))


def timed(
    aws: EmbeddedAWS,
    log: Path,
    name: str,
    client: tuple[int, Collection[int]],
    run: Callable[[], tuple[int, float]],
) -> Phase:
    """Run one case and print it; its seconds are the job's own (Spark start-up excluded).
    `client` is (root, excluded) of the processes that drive moto (see tree_cpu); `log`
    is moto's access log."""
    began = time.perf_counter()
    client_before = tree_cpu(*client)
    requests_before = request_count(log)
    with cpu_load(aws) as used:
        items, seconds = run()
    client_cpu = tree_cpu(*client) - client_before
    requests = request_count(log) - requests_before
    wall = time.perf_counter() - began
    moto, box = used()
    phase = Phase(name, items, seconds, moto / wall, box / wall, moto, requests, client_cpu)
    print(
        f"  {name:<20} {items:>6,} items in {seconds:6.1f}s = {phase.rate:>5,.0f} items/s;"
        f" busy: moto {phase.moto_cores:.2f}, machine {phase.machine_cores:.2f} of "
        f"{psutil.cpu_count()} cores; CPU per item: moto {1000 / phase.moto_max_rate:.1f} ms, "
        f"client {1000 / phase.client_max_rate:.1f} ms; moto requests per item "
        f"{requests / max(items, 1):.2f}",
        flush=True,
    )
    return phase


def run_job(spark: Any, options: ReplayOptions) -> tuple[int, float]:
    summary: Summary = run_replay(options, spark=spark)
    if not summary.ok:
        raise AssertionError(f"the job did not finish cleanly:\n{summary}")
    done = summary.exported if summary.mode == "export" else summary.replayed
    return done, summary.elapsed_s


def warm_up(spark: Any) -> None:
    """Start the Python workers and import the job there, outside the timed part."""
    sc = spark.sparkContext
    cores = sc.defaultParallelism
    sc.parallelize(range(cores), cores).mapPartitions(
        lambda _: [__import__("triage_replay.segment").__name__]
    ).collect()


def spark_conf() -> dict[str, str]:
    return {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.driver.memory": "2g",
    }


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="bench-spark-replay-") as workdir:
        return bench(Path(workdir))


def bench(workdir: Path) -> int:
    """The whole run; moto's access log and the exports go under `workdir`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--items", type=int, help=f"dead letters per replay (default {DEFAULT_ITEMS:,})"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    n = args.items or DEFAULT_ITEMS
    phases: dict[str, Phase] = {}
    log = workdir / "moto.log"
    with EmbeddedAWS(log_path=log) as aws, EmbeddedBroker() as broker:

        def table(name: str) -> DeadLetterSettings:
            return DeadLetterSettings(table=name, endpoint_url=aws.endpoint_url)

        print(f"moto-only: scan, claim + mark with {CEILING_THREADS} boto3 threads, no Spark")
        seed(table("ceiling"), CEILING_ITEMS)
        ceiling = timed(
            aws,
            log,
            "scan, claim, mark",
            (os.getpid(), (aws.pid, broker.pid)),
            lambda: moto_ceiling(table("ceiling")),
        )
        if args.items is None:
            estimate = 2 * FULL_ITEMS / ceiling.rate
            print(
                f"  default --items {DEFAULT_ITEMS:,}, not {FULL_ITEMS:,}: two replays of "
                f"{FULL_ITEMS:,} would take about {estimate / 60:.0f} min at this rate "
                f"(budget {BUDGET_S / 60:.0f} min); --items {FULL_ITEMS} runs them anyway"
            )

        print(
            f"seeding 2 x {n:,} dead letters ({VALUE_BYTES} B values, {SOURCE_PARTITIONS} "
            f"source partitions), BatchWriteItem x{SEED_THREADS} threads ...",
            flush=True,
        )
        for name in ("replay-1", "replay-2", "export"):
            rate = seed(table(name), n)
            print(f"  {name}: {rate:,.0f} items/s", flush=True)
        create_topic(broker.bootstrap, "replayed", partitions=4)

        for cores in (1, 2):
            print(f"Spark local[{cores}], {SEGMENTS} segments:", flush=True)
            spark = local_session(f"local[{cores}]", spark_conf())
            spark.sparkContext.setLogLevel("ERROR")
            try:
                warm_up(spark)
                replay = ReplayOptions(
                    table(f"replay-{cores}"),
                    bootstrap=broker.bootstrap,
                    to_topic="replayed",
                    segments=SEGMENTS,
                    group=GROUP,
                )
                export = ReplayOptions(
                    table("export"),
                    export_path=str(workdir / f"export-{cores}.parquet"),
                    segments=SEGMENTS,
                    group=GROUP,
                )
                jvm = SparkContext._gateway.proc.pid  # the Python workers are its children
                phases[f"replay-{cores}"] = timed(
                    aws,
                    log,
                    f"replay {n:,} to Kafka",
                    (jvm, ()),
                    functools.partial(run_job, spark, replay),
                )
                phases[f"export-{cores}"] = timed(
                    aws,
                    log,
                    f"export {n:,} (read)",
                    (jvm, ()),
                    functools.partial(run_job, spark, export),
                )
            finally:
                stop_session(spark)
            marked = count_replayed(table(f"replay-{cores}"))
            if marked != n:
                raise AssertionError(f"{marked} of {n} items marked replayed")

    one, two = phases["replay-1"], phases["replay-2"]
    ratio = two.rate / one.rate
    moto_max = one.moto_max_rate  # moto CPU per item of the 1-core run
    print()
    print(f"scaling from local[1] to local[2] ({n:,} items each, same machine, same moto):")
    print(
        f"  replay {one.rate:,.1f} -> {two.rate:,.1f} items/s = {ratio:.2f}x"
        f"   (moto busy {one.moto_cores:.2f} -> {two.moto_cores:.2f} cores)"
    )
    print(
        f"  moto-only: {ceiling.rate:,.1f} items/s with plain boto3 and no Spark; moto's CPU "
        f"per replayed item allows at most {moto_max:,.1f} items/s on one full core (1-core run)"
    )
    print(
        f"  the job's own CPU per item (JVM + Python workers, 1-core run) would let one core "
        f"drive {one.client_max_rate:,.0f} items/s if the table kept up"
    )
    cores = psutil.cpu_count() or 1
    print(
        f"  the 1-core run already kept {one.machine_cores:.2f} of {cores} cores busy (moto, the "
        f"broker, the JVM's own threads), so on this machine local[2] can be at most "
        f"{cores / one.machine_cores:.2f}x faster whatever the job does"
    )
    e1, e2 = phases["export-1"], phases["export-2"]
    export_ratio = e2.rate / e1.rate
    print(
        f"  not the replay, for comparison: export to Parquet of {n:,} items (the same "
        f"parallel scan, read-only) {e1.rate:,.1f} -> {e2.rate:,.1f} items/s = "
        f"{export_ratio:.2f}x   (moto busy {e1.moto_cores:.2f} -> {e2.moto_cores:.2f} cores; "
        f"moto CPU per item {1000 / e1.moto_max_rate:.1f} ms vs the replay's "
        f"{1000 / moto_max:.1f} ms)"
    )
    ok = ratio >= TARGET_RATIO
    verdict = f"replay scales {ratio:.2f}x from 1 to 2 cores (target >= {TARGET_RATIO}x)"
    if not ok and one.moto_cores >= 0.7:
        verdict += (
            f"; moto (one Python process) was {one.moto_cores:.2f} cores busy already in the "
            f"1-core run ({one.rate / moto_max:.0%} of what it can serve), so this ratio "
            "measures moto, not the job; against DynamoDB, which scales with the cluster, "
            "the job's tasks are the limit"
        )
    print()
    print(f"{'PASS' if ok else 'FAIL'}: {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
