"""How long the console's dead-letter list takes on a large table (moto server).

    python -m tests.perf.bench_console_page 100000            # the embedded endpoint
    python -m tests.perf.bench_console_page 100000 --plain    # moto.server as released
    ... --first-pages    # only the first pages (3 rounds each), not the walks and counts

Writes N dead letters over 4 partitions with BatchWriteItem (8 threads), then times
`triage_cli.console.deadletters.DeadLetters`: the first page unfiltered, pending only and
on one partition, walking to page 20, counts by reason and the pending count. A step that
fails prints why (e.g. the table does not answer within the read timeout).
"""

import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3

from triage_cli.console.deadletters import DeadLetters, Page
from triage_cli.embedded import EmbeddedAWS
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.errors import TriageError
from triage_proxy.store.items import item_from_dead_letter
from triage_proxy.store.provisioning import create_table
from triage_proxy.structs import DeadLetter, Record


class PlainMoto(EmbeddedAWS):
    """moto.server itself, without the embedded stack's sort keys (triage_cli.motoserver)."""

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(port)]


N = int(sys.argv[1])
ROUNDS = 3
"""Each first page is timed this many times (the spread is part of the figure)."""
endpoint = PlainMoto() if "--plain" in sys.argv[2:] else EmbeddedAWS()
print(f"endpoint: {' '.join(endpoint.command(0)[1:3])}", flush=True)
with endpoint as aws:
    raw = {
        "kafka": {
            "bootstrap_servers": "127.0.0.1:1",
            "topic": "bench",
            "group_id": "g-bench",
            "partitions": 4,
        },
        "auth": {"token": "bench-token-0123456789"},
        "dead_letters": {"table": "bench", "endpoint_url": aws.endpoint_url},
    }
    settings = settings_from_dict(raw, {})
    create_table(settings.dead_letters)
    client = boto3.client(
        "dynamodb",
        endpoint_url=aws.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    now = int(time.time() * 1000)

    def write(start: int) -> None:
        batch: list[Any] = []  # BatchWriteItem's requests, as the dead-letter writer builds them
        for o in range(start, min(N, start + 25)):
            dl = DeadLetter(
                Record("bench", o % 4, o, b"k%d" % o, b'{"n": %d}' % o, (("h", b"v"),), now),
                f"reason {o % 7}",
                3,
                "c",
                now,
            )
            batch.append({"PutRequest": {"Item": item_from_dead_letter(dl, "g-bench")}})
        client.batch_write_item(RequestItems={"bench": batch})

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, range(0, N, 25)))
    print(f"wrote {N} in {time.monotonic() - t0:.1f} s", flush=True)
    dls = DeadLetters(settings)

    def page_n(n: int) -> Page:
        after = None
        for _ in range(n):
            got = dls.page(dls.filters(), after=after)
            after = got.next
        return got

    first_pages: list[tuple[str, Callable[[], object]]] = [
        ("first page, no filter", lambda: dls.page(dls.filters())),
        ("first page, state=pending", lambda: dls.page(dls.filters(state="pending"))),
        ("first page, partition 2", lambda: dls.page(dls.filters(partition="2"))),
    ]
    walks: list[tuple[str, Callable[[], object]]] = [
        ("page 20 (1,000 items in), no filter", lambda: page_n(20)),
        ("counts by reason, no filter", lambda: dls.reasons(dls.filters())),
        ("pending count, no filter", lambda: dls.count(dls.filters())),
    ]
    for label, fn in first_pages * ROUNDS + ([] if "--first-pages" in sys.argv[2:] else walks):
        t = time.monotonic()
        try:
            fn()
            print(f"{label}: {time.monotonic() - t:.2f} s", flush=True)
        except TriageError as exc:
            print(
                f"{label}: FAILED after {time.monotonic() - t:.2f} s: {str(exc)[:120]}", flush=True
            )
    dls.close()
    client.close()
