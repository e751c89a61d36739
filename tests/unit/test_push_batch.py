"""What one batched request carries (push/target.py's `Lane.take` with an HTTP target's
encodings): at most `batch` records and `max_batch_bytes` of body, as full as both allow,
and a record larger than the bytes alone. A real dispatcher hands the lane its records."""

from __future__ import annotations

import asyncio
import random

from tests.unit.test_dispatcher import BASE
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.pipeline.dispatch import Dispatcher
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.push.cloudevents import EventShape, batch_body
from triage_proxy.push.http import HttpEndpoint, HttpTarget
from triage_proxy.push.limit import LimitSettings
from triage_proxy.push.target import Lane, TargetShape
from triage_proxy.structs import Record

MAX_BYTES = 4096
BATCH = 20


def target() -> HttpTarget:
    shape = TargetShape(
        name="t",
        limit=LimitSettings(min_limit=1, max_limit=64, initial=64),
        batch=BATCH,
        max_batch_bytes=MAX_BYTES,
        timeout_s=5.0,
    )
    endpoint = HttpEndpoint(
        url="http://127.0.0.1:9/",
        event=EventShape(source="triage://g/t"),
        nack_statuses=frozenset({400}),
        max_response_bytes=65536,
    )
    return HttpTarget(shape, endpoint)


def test_each_batch_fits_its_bytes_exactly_and_is_as_full_as_they_allow() -> None:
    rng = random.Random(25)
    sizes = [rng.choice([0, 1, 10, 100, 700, 1500, 2900]) for _ in range(300)]
    sizes[50] = 10_000  # larger than a request may be: goes alone
    values = [bytes(rng.randrange(256) for _ in range(n)) for n in sizes]

    async def batches() -> list[list[bytes]]:
        settings = settings_from_dict(BASE, {})
        dispatcher = Dispatcher(settings, 0, CommitTracker(0), lambda dl: None)
        lane = Lane(target(), dispatcher)
        dispatcher.add(
            [Record("t", 0, i, b"k", v, (), 1_700_000_000_000) for i, v in enumerate(values)]
        )
        taken: list[list[bytes]] = []
        while lane.queue:
            entries, payloads = lane.take()
            assert entries
            taken.append([p for p in payloads if isinstance(p, bytes)])
        return taken

    taken = asyncio.run(batches())
    assert sum(map(len, taken)) == len(values)
    for i, events in enumerate(taken):
        body = batch_body(events)
        assert len(events) <= BATCH
        if len(body) > MAX_BYTES:
            assert len(events) == 1  # only a record that cannot fit goes over, alone
        nxt = taken[i + 1][0] if i + 1 < len(taken) else None
        if nxt is not None and len(events) < BATCH:
            # Full: the next record would not have fit.
            assert len(batch_body([*events, nxt])) > MAX_BYTES


def record(offset: int, size: int) -> Record:
    return Record("t", 0, offset, b"k", b"x" * size, (), 1_700_000_000_000)


def test_a_batch_one_byte_over_the_limit_is_cut_before_the_record_that_overflows() -> None:
    """Two records whose events, each counted with its comma, add up to exactly
    `max_batch_bytes`: their body (`[a,b]`) is one byte more, so they go apart."""
    t = target()
    by_size = {t.prepare(record(1, n))[1]: n for n in range(4000)}
    first, second = next(
        (n, by_size[MAX_BYTES - t.prepare(record(0, n))[1]])
        for n in range(1000, 2000)
        if MAX_BYTES - t.prepare(record(0, n))[1] in by_size
    )
    events = [t.prepare(record(0, first))[0], t.prepare(record(1, second))[0]]
    assert len(batch_body([e for e in events if isinstance(e, bytes)])) == MAX_BYTES + 1

    async def batches() -> list[int]:
        dispatcher = Dispatcher(settings_from_dict(BASE, {}), 0, CommitTracker(0), lambda dl: None)
        lane = Lane(t, dispatcher)
        dispatcher.add([record(0, first), record(1, second)])
        sizes = []
        while lane.queue:
            _, payloads = lane.take()
            sizes.append(len(batch_body([p for p in payloads if isinstance(p, bytes)])))
        return sizes

    sizes = asyncio.run(batches())
    assert len(sizes) == 2
    assert max(sizes) <= MAX_BYTES
