"""`triage proxy` with timestamps of where each record is, for bench_latency only.

Why a wrapper and not a proxy feature: the latency benchmark needs to split Triage's
added latency into the broker's part (produce -> the proxy's Kafka read returned it) and
the proxy's own (that read -> the consumer's handler start), and nothing on the wire or
in the proxy should change for it. This runs the real `triage proxy` command in this
process after wrapping four methods, each stamping time.monotonic_ns() (CLOCK_MONOTONIC,
one clock for every process on the host) per batch, not per record:

    fetched  ConfluentPartition.fetch returned the records (on the Kafka fetch thread)
    added    Dispatcher.add began taking them (on the event loop: the thread hand-off)
    queued   Scheduler._deliver handed them to a session's outbox (credits were free)
    sent     the gRPC stream handler took their frame from the outbox to write it

Each stamp is (ns, first offset, last offset); the bench's topic has no gaps, so every
offset in between had that stamp. Also `lag`: how late the event loop ran a callback
scheduled every LAG_PERIOD_S (a stall of the loop shows as a large lag), and `lag_sched`:
for each of those intervals, how long the loop's thread ran on a CPU and how long it was
runnable but waiting for one (/proc/thread-self/schedstat), so a stall can be told apart:
the proxy's own work, the machine's CPUs, or neither (blocked: the GIL, I/O); and `paused`
[ns, 1 or 0, ...]: when the fetcher stopped and resumed taking records because the window
was full (records then wait in librdkafka's queue: Triage's backpressure, which the
benchmark would otherwise count as the broker's part); `gc` [ns, pause ns, generation, ...]:
each collection of the cyclic garbage collector (gc.callbacks), which stops every thread
of the proxy while it runs. On exit the
trace is written as JSON to $TRIAGE_BENCH_TRACE.

    TRIAGE_BENCH_TRACE=trace.json python -m tests.perf.traced_proxy proxy --config ...
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
from array import array
from typing import Any

from triage_proxy.kafka import client as kafka
from triage_proxy.pipeline import fetcher
from triage_proxy.pipeline.dispatch import dispatcher, scheduler
from triage_proxy.server import outbox

LAG_PERIOD_S = 0.01
"""How often the loop-lag probe runs (100 wake-ups a second: a small cost)."""

STAGES = ("fetched", "added", "queued", "sent")
_trace: dict[str, array[int]] = {
    name: array("q") for name in (*STAGES, "lag", "lag_sched", "paused", "gc")
}
_now = time.monotonic_ns


def _stamp(stage: array[int], first: int, last: int) -> None:
    stage.extend((_now(), first, last))


def _install() -> None:
    fetched, added, queued, sent = (_trace[name] for name in STAGES)
    fetch = kafka.ConfluentPartition.fetch

    def traced_fetch(self: Any, max_records: int) -> list[Any]:
        records = fetch(self, max_records)
        if records:
            _stamp(fetched, records[0][2], records[-1][2])
        return records

    add = dispatcher.Dispatcher.add

    def traced_add(self: Any, records: Any) -> None:
        if isinstance(records, list) and records:
            _stamp(added, records[0][2], records[-1][2])
            if not _lag_started:
                _start_lag()
        add(self, records)

    deliver = scheduler.Scheduler._deliver

    def traced_deliver(
        self: Any, session: Any, batch: list[Any], *, isolated: bool = False
    ) -> None:
        if batch:
            _stamp(queued, batch[0].record[2], batch[-1].record[2])
        deliver(self, session, batch, isolated=isolated)

    get = outbox.Outbox.get

    async def traced_get(self: Any) -> Any:
        frame = await get(self)
        if frame is not None and frame.HasField("deliveries"):
            offsets = [d.offset for d in frame.deliveries.deliveries]
            packed = frame.deliveries.packed.offsets
            if packed:
                column = array("q", packed)
                if sys.byteorder == "big":
                    column.byteswap()
                offsets.extend(column)
            if offsets:
                _stamp(sent, min(offsets), max(offsets))
        return frame

    set_paused = fetcher.Fetcher._set_paused
    paused_at = _trace["paused"]

    def traced_set_paused(self: Any, paused: bool) -> None:
        if paused != self.paused:
            paused_at.extend((_now(), int(paused)))
        set_paused(self, paused)

    collections = _trace["gc"]
    began = [0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = _now()
        else:
            collections.extend((began[0], _now() - began[0], info["generation"]))

    gc.callbacks.append(on_gc)
    fetcher.Fetcher._set_paused = traced_set_paused  # type: ignore[method-assign]
    kafka.ConfluentPartition.fetch = traced_fetch  # type: ignore[method-assign]
    dispatcher.Dispatcher.add = traced_add  # type: ignore[method-assign]
    scheduler.Scheduler._deliver = traced_deliver  # type: ignore[method-assign]
    outbox.Outbox.get = traced_get  # type: ignore[method-assign]


_lag_started = False


def _start_lag() -> None:
    """From the first record on (on the proxy's loop): stamp how late each probe ran."""
    global _lag_started
    _lag_started = True
    loop = asyncio.get_running_loop()
    lag = _trace["lag"]
    period_ns = int(LAG_PERIOD_S * 1e9)

    sched = _trace["lag_sched"]
    last = _schedstat()

    def probe(due: int) -> None:
        nonlocal last
        now = _now()
        lag.extend((now, now - due))
        ran, waited = _schedstat()
        sched.extend((ran - last[0], waited - last[1]))
        last = (ran, waited)
        loop.call_later(LAG_PERIOD_S, probe, now + period_ns)

    loop.call_later(LAG_PERIOD_S, probe, _now() + period_ns)


def _schedstat() -> tuple[int, int]:
    """The loop thread's (ns on a CPU, ns runnable but waiting for one) so far."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            ran, waited, _ = f.read().split()
        return int(ran), int(waited)
    except (OSError, ValueError):
        return 0, 0


def _dump() -> None:
    path = os.environ.get("TRIAGE_BENCH_TRACE")
    if path:
        with open(path, "w") as out:
            json.dump({name: list(values) for name, values in _trace.items()}, out)


def main() -> None:
    from triage_cli.main import run

    _install()
    sys.argv = ["triage", *sys.argv[1:]]
    try:
        run()
    finally:
        _dump()


if __name__ == "__main__":
    main()
