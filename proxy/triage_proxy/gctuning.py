"""The proxy process's garbage-collector policy.

Why: every fetched message allocates objects the cyclic collector tracks (librdkafka's
Message, the window's Entry), and most of them outlive a young collection (a fetch batch
is thousands at once; an entry lives until it is settled), so they keep promoting into
the oldest generation. CPython 3.11 then runs a full collection whenever a quarter of
that generation is new, and each one walks every object of the process, boto3's service
models and the imported modules included (~70,000 objects, tens of ms each on a loaded
machine). py-spy --native on the proxy during bench_throughput: 49% of the GIL's time in
`gc_collect_main`.

How: once the proxy serves, what exists then (modules, settings, clients) is frozen out
of the collector's reach (`gc.freeze`: never walked again, never collected, which is what
it is: process-lifetime state), and young collections run per YOUNG_THRESHOLD allocations
instead of 700, so a fetch batch is mostly freed by reference counting before any
collection sees it. Reference counting still frees everything acyclic at once; cycles
made after startup are still collected.
"""

from __future__ import annotations

import asyncio
import gc

__all__ = ["YOUNG_THRESHOLD", "freeze_startup_heap", "freeze_when_ready", "set_collection_policy"]

YOUNG_THRESHOLD = 20_000
"""Allocations of tracked objects between young collections (CPython's default: 700)."""


def set_collection_policy() -> None:
    """Young collections per YOUNG_THRESHOLD allocations; the older generations' ratios
    stay CPython's."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)


def freeze_startup_heap() -> None:
    """Collect once, then keep every surviving object out of later collections."""
    gc.collect()
    gc.freeze()


async def freeze_when_ready(ready: asyncio.Event) -> None:
    """`freeze_startup_heap` once `ready` is set (the proxy serves: its clients exist)."""
    await ready.wait()
    freeze_startup_heap()
