"""Dead-letter write throughput: batched DeadLetterWriter vs one item per call.

Why: when consumers nack in bulk, every dead letter must be in DynamoDB before its
offset can commit, so the writer's throughput bounds how fast a partition can drain.
Writes are idempotent (never clobber a replayed item), so the two ways compared are:
- one item per call: a conditional PutItem per dead letter (what `put_batch` does for a
  single item, and what a writer without batching would have to do);
- the writer: per batch of 25, one consistent BatchGetItem of the keys' status, then one
  BatchWriteItem for the new keys (all of them here), a few batches in flight.
The writer must beat one item per call by at least TARGET_RATIO on the same endpoint.
(TransactWriteItems would also be conditional and batched, but moto copies the whole
table per transaction item, which would make this comparison meaningless locally.)

Run as a script: ``.venv/bin/python -m tests.perf.bench_deadletter [N]``. It starts its
own moto server (stopped at the end, even on error), writes N dead letters each way into
fresh tables, checks every item arrived, prints items/s and the ratio. Exits 1 when the
target is missed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import boto3

from tests.samples import GROUP
from triage_cli.embedded import EmbeddedAWS
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.deadletters.writer import DEFAULT_MAX_IN_FLIGHT, DeadLetterWriter
from triage_proxy.store.deadletter_store import DynamoDBStore
from triage_proxy.store.provisioning import create_table
from triage_proxy.structs import DeadLetter, Record

N = 2000
TARGET_RATIO = 5.0
VALUE_BYTES = 1024
TOPIC = "orders"


def dead_letters(n: int) -> list[DeadLetter]:
    """n distinct dead letters with a 1 KiB value, a key and two headers."""
    out = []
    for offset in range(n):
        record = Record(
            topic=TOPIC,
            partition=0,
            offset=offset,
            key=f"key-{offset}".encode(),
            value=os.urandom(VALUE_BYTES),
            headers=(("trace-id", os.urandom(16)), ("retry", None)),
            timestamp_ms=1_714_564_800_000 + offset,
        )
        out.append(DeadLetter(record, "handler raised ValueError", 5, "bench-worker", 0))
    return out


def warm_up(store: DynamoDBStore) -> None:
    """Open the connection and load the models outside the timed part."""
    warm = Record("warm-up", 0, 0, None, b"x", (), 0)
    assert store.put_batch([DeadLetter(warm, "warm-up", 1, "", 0)]) == []


def count_items(settings: DeadLetterSettings) -> int:
    client = boto3.session.Session().client(
        "dynamodb",
        region_name=settings.region,
        endpoint_url=settings.endpoint_url,
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
    )
    try:
        total = 0
        for page in client.get_paginator("scan").paginate(
            TableName=settings.table, Select="COUNT", ConsistentRead=True
        ):
            total += page["Count"]
        return total
    finally:
        client.close()


def one_at_a_time(store: DynamoDBStore, dls: list[DeadLetter]) -> float:
    """Seconds to write every item with its own call (a store call of batch size 1)."""
    start = time.perf_counter()
    for dl in dls:
        if store.put_batch([dl]):
            raise AssertionError("an item was left unprocessed")
    return time.perf_counter() - start


def through_writer(
    store: DynamoDBStore, settings: DeadLetterSettings, dls: list[DeadLetter], in_flight: int
) -> float:
    """Seconds from the first submit until the writer reported every item written."""
    written: list[DeadLetter] = []

    async def run() -> float:
        async with DeadLetterWriter(
            store, settings, written.append, max_in_flight=in_flight
        ) as writer:
            start = time.perf_counter()
            for dl in dls:
                writer.submit(dl)
            if not await writer.flush(300):
                raise AssertionError(f"writer still has {writer.pending} pending")
            return time.perf_counter() - start

    elapsed = asyncio.run(run())
    if len(written) != len(dls):
        raise AssertionError(f"{len(written)} of {len(dls)} reported written")
    return elapsed


def measure(
    aws: EmbeddedAWS, name: str, n: int, write: Callable[[DynamoDBStore, Any], float]
) -> float:
    """Items/s of one case, in a fresh table, checked by a full count afterwards."""
    settings = DeadLetterSettings(table=f"bench-{name}", endpoint_url=aws.endpoint_url)
    create_table(settings)
    with DynamoDBStore(settings, group=GROUP) as store:
        warm_up(store)
        # Counted, not assumed: a new table also holds its index marker (provisioning.py).
        before = count_items(settings)
        elapsed = write(store, settings)
    stored = count_items(settings) - before
    if stored != n:
        raise AssertionError(f"{name}: {stored} of {n} items in the table")
    return n / elapsed


def main() -> int:
    """Run both ways side by side, print the table and the verdict; return the exit code."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    n = int(sys.argv[1]) if len(sys.argv) > 1 else N
    dls = dead_letters(n)
    with EmbeddedAWS() as aws:
        rates = {
            "one conditional PutItem per call (sequential)": measure(
                aws, "single", n, lambda store, _: one_at_a_time(store, dls)
            ),
            "writer, batch 25, 1 in flight": measure(
                aws, "batched-serial", n, lambda store, s: through_writer(store, s, dls, 1)
            ),
            f"writer, batch 25, {DEFAULT_MAX_IN_FLIGHT} in flight (default)": measure(
                aws,
                "batched",
                n,
                lambda store, s: through_writer(store, s, dls, DEFAULT_MAX_IN_FLIGHT),
            ),
        }
    print(f"{n:,} dead letters of {VALUE_BYTES} B each, moto server on loopback")
    width = max(len(name) for name in rates)
    print(f"{'case':<{width}}  {'items/s':>9}")
    print("-" * (width + 11))
    for name, rate in rates.items():
        print(f"{name:<{width}}  {rate:>9,.0f}")
    baseline, *_, default = rates.values()
    ratio = default / baseline
    ok = ratio >= TARGET_RATIO
    print()
    print(
        f"{'PASS' if ok else 'FAIL'}: default writer is {ratio:.1f}x one item per call "
        f"(target >= {TARGET_RATIO:.0f}x)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
