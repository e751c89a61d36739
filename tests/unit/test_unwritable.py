"""A dead letter that can never be written (over DynamoDB's item limit, no overflow bucket):
held, so the commit cannot pass it, but reported (ERROR once, degraded in the snapshot,
/status and the metric, with the offset and the fix) and never waited for by a drain,
a flush or SIGTERM; a restart redelivers it. In-memory twins only."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.samples import GROUP
from tests.unit import virtual_time
from tests.unit.test_dispatcher import connect
from tests.unit.wire import consume_call, hello, take
from tests.waiting import eventually
from triage_protocol import triage_pb2 as pb
from triage_proxy.app import Proxy, ProxyState
from triage_proxy.clienttext import for_log
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.config.settings import Settings
from triage_proxy.deadletters.writer import NO_BUCKET_FIX, DeadLetterWriter, overflow_warning
from triage_proxy.kafka.client import MemoryPartition
from triage_proxy.observe.metrics import metric_families
from triage_proxy.observe.snapshot import UnwritableDeadLetter
from triage_proxy.pipeline.dispatch import Dispatcher
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.store.checkpoints import MemoryCheckpoints
from triage_proxy.store.deadletter_store import MemoryStore
from triage_proxy.store.items import MAX_ITEM_BYTES, item_size
from triage_proxy.structs import DeadLetter, Record

TOKEN = "unwritable-token-0123456"
BIG = b"x" * (MAX_ITEM_BYTES + 50_000)
FORGED = "boom\n2030-01-01 00:00:00 CRITICAL triage_proxy: forged line \x1b[31mred\x1b[0m\x00"
DRAIN_TIMEOUT_S = 30.0


def big_dl(offset: int) -> DeadLetter:
    record = Record("orders", 0, offset, b"k", BIG, (), 0)
    return DeadLetter(record, "ValueError: too big to handle", 1, "worker-1", 0)


def run(coro: Coroutine[Any, Any, None], timeout: float = 30.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout))


# --- the writer -------------------------------------------------------------------------


def test_the_writer_reports_an_unwritable_dead_letter_once_with_its_offset_and_fix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="triage_proxy.deadletters.writer")
    reported: list[DeadLetter] = []
    written: list[DeadLetter] = []
    settings = DeadLetterSettings(table="d", flush_interval_ms=1)

    async def main() -> None:
        store = MemoryStore()
        async with DeadLetterWriter(
            store, settings, written.append, on_unwritable=reported.append
        ) as writer:
            writer.submit(big_dl(7))
            assert [dl.record.offset for dl in reported] == [7]  # at once, inside submit
            small = DeadLetter(Record("orders", 0, 8, None, b"v", (), 0), "r", 1, "w", 0)
            writer.submit(small)
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert not await writer.flush(DRAIN_TIMEOUT_S)  # never waits for offset 7
            assert loop.time() - started < 1  # virtual seconds: exact, whatever the load
            assert [dl.record.offset for dl in written] == [8]
            assert writer.unwritable() == (
                UnwritableDeadLetter(7, item_size(big_dl(7), GROUP), MAX_ITEM_BYTES, NO_BUCKET_FIX),
            )
            assert writer.too_large == 1
            assert writer.pending == 1
            assert not writer.degraded  # retrying is not what is wrong
            await asyncio.sleep(1.0)  # a thousand flush intervals, at once on this loop
        assert len(store.calls) == 1  # the big one was never sent

    virtual_time.run(main())  # the loop's clock jumps: the wait above is exact and instant
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "orders[0]@7" in errors[0]
    assert "cannot pass offset 7" in errors[0]
    assert "set dead_letters.overflow_bucket" in errors[0]


def test_the_unwritable_dead_letter_log_shows_the_reason_escaped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="triage_proxy.deadletters.writer")
    dl = DeadLetter(
        Record("orders", 0, 3, None, BIG, (), 0), FORGED, 1, "worker\x1b]0;title\x07", 0
    )

    async def main() -> None:
        settings = DeadLetterSettings(table="d", flush_interval_ms=1)
        async with DeadLetterWriter(MemoryStore(), settings, lambda dl: None) as writer:
            writer.submit(dl)

    asyncio.run(asyncio.wait_for(main(), 10))
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert error.isprintable()
    assert for_log(FORGED) in error
    assert "worker\\x1b]0;title\\x07" in error


def test_unwritable_lists_the_oldest_first_and_can_be_limited() -> None:
    settings = DeadLetterSettings(table="d", flush_interval_ms=1)

    async def main() -> None:
        async with DeadLetterWriter(MemoryStore(), settings, lambda dl: None) as writer:
            for offset in (3, 1, 9):
                writer.submit(big_dl(offset))
            assert [u.offset for u in writer.unwritable()] == [3, 1, 9]
            assert [u.offset for u in writer.unwritable(2)] == [3, 1]

    run(main())


def test_overflow_warning_only_without_a_bucket() -> None:
    warning = overflow_warning(DeadLetterSettings(table="d"))
    assert warning is not None
    assert "dead_letters.overflow_bucket" in warning
    assert "400,000" in warning
    assert overflow_warning(DeadLetterSettings(table="d", overflow_bucket="b")) is None


def test_config_check_warns_without_an_overflow_bucket(tmp_path: Path) -> None:
    from triage_cli.main import app

    path = tmp_path / "triage.toml"
    text = (
        '[kafka]\nbootstrap_servers = "b"\ntopic = "t"\ngroup_id = "g"\n'
        '[auth]\ntoken = "unit-test-token-0123"\n[dead_letters]\ntable = "dlq"\n'
    )
    path.write_text(text)
    path.chmod(0o600)  # it holds a token: readable by others is a warning of its own
    result = CliRunner().invoke(app, ["config", "check", "--config", str(path)])
    assert result.exit_code == 0
    assert "warning: dead_letters.overflow_bucket is not set" in result.stderr
    path.write_text(text + 'overflow_bucket = "payloads"\n')
    result = CliRunner().invoke(app, ["config", "check", "--config", str(path)])
    assert result.exit_code == 0
    assert "warning" not in result.stderr


# --- the dispatcher ---------------------------------------------------------------------


def make_settings(**sections: dict[str, object]) -> Settings:
    raw: dict[str, dict[str, object]] = {
        "kafka": {"bootstrap_servers": "127.0.0.1:1", "topic": "orders", "group_id": "g"},
        "auth": {"token": TOKEN},
        "dead_letters": {"table": "dlq", "flush_interval_ms": 1},
        "server": {"host": "127.0.0.1", "port": 0, "http_port": 0},
        "commit": {"interval_s": 0.05},
        "shutdown": {"drain_timeout_s": DRAIN_TIMEOUT_S},
        "ownership": {"enabled": False},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return settings_from_dict(raw, {})


def test_the_dispatcher_stops_counting_an_unwritable_dead_letter_as_in_flight() -> None:
    tracker = CommitTracker(0)
    submitted: list[DeadLetter] = []
    dispatcher = Dispatcher(make_settings(), 0, tracker, submitted.append)
    dispatcher.add([Record("orders", 0, 0, None, BIG, (), 0)])
    session = connect(dispatcher, "w", 1)
    dispatcher.settle(session, [], [pb.Nack(offset=0, reason="bad")])
    assert dispatcher.in_flight == 1
    assert not dispatcher.quiet.is_set()
    dispatcher.dead_letter_unwritable(submitted[0])
    assert dispatcher.in_flight == 0
    assert dispatcher.quiet.is_set()  # a drain does not wait for it
    assert dispatcher.in_window == 1  # but it is not settled
    assert tracker.committable == 0
    dispatcher.dead_letter_unwritable(submitted[0])  # twice changes nothing
    assert dispatcher.in_flight == 0


# --- the proxy --------------------------------------------------------------------------


async def consume(proxy: Proxy, count: int, nack: set[int]) -> list[int]:
    """Open a stream, take `count` deliveries, ack them but nack `nack`; the offsets seen."""
    async with consume_call(proxy, TOKEN) as call:
        await hello(call)
        got = await take(call, count)
        acks = [o for o in got if o not in nack]
        nacks = [pb.Nack(offset=o, reason="ValueError: bad") for o in got if o in nack]
        await call.write(pb.ConsumerFrame(settle=pb.Settle(acks=acks, nacks=nacks)))
        pipeline = proxy.pipelines.get(proxy.partition)
        assert pipeline is not None
        dispatcher = pipeline.dispatcher
        assert dispatcher is not None
        await eventually(lambda: dispatcher.counters.acked + dispatcher.counters.nacked >= count)
        await call.done_writing()
        return got


def gauge(proxy: Proxy, name: str) -> float:
    for family in metric_families(proxy.snapshot()):
        if family.name == name:
            (sample,) = family.samples
            assert sample.labels == {"topic": "orders", "partition": "0"}
            return float(sample.value)
    raise AssertionError(f"no metric {name}")


def test_sigterm_with_only_an_unwritable_dead_letter_exits_at_once_and_restart_redelivers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="triage_proxy")
    log = MemoryPartition("orders", 0)
    log.append(b"a")
    log.append(BIG)
    log.append(b"c")
    store = MemoryStore(table="d")
    checkpoints = MemoryCheckpoints()
    settings = make_settings()
    elapsed: list[float] = []

    async def first_run() -> None:
        proxy = Proxy(settings, 0, log=log, store=store, checkpoints=checkpoints)
        await proxy.start()
        try:
            assert await consume(proxy, 3, nack={1}) == [0, 1, 2]
            snap = proxy.snapshot()
            assert "dead_letters_unwritable" in snap.degraded
            assert snap.dead_letters_unwritable == 1
            (held,) = snap.unwritable_dead_letters
            assert held.offset == 1
            assert held.fix == NO_BUCKET_FIX
            doc = snap.to_json()
            assert doc["dead_letters_unwritable"] == 1
            assert doc["unwritable_dead_letters"][0]["offset"] == 1
            assert "dead_letters.overflow_bucket" in doc["unwritable_dead_letters"][0]["fix"]
            assert doc["in_flight"] == 0
            assert doc["dead_letters_pending"] == 1
            assert gauge(proxy, "triage_dead_letters_unwritable") == 1
            await eventually(lambda: log.committed == 1)  # the commit waits at offset 1
        finally:
            started = time.monotonic()
            proxy.stop()  # what SIGTERM does
            await proxy.wait_stopped()
            elapsed.append(time.monotonic() - started)
        assert proxy.state is ProxyState.STOPPED

    run(first_run())
    assert elapsed[0] < 5, f"stop took {elapsed[0]:.1f}s of a {DRAIN_TIMEOUT_S}s drain timeout"
    assert log.committed == 1
    assert store.items == {}
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert any(
        level == logging.WARNING and "overflow_bucket is not set" in m for level, m in messages
    )
    assert len([m for level, m in messages if level == logging.ERROR]) == 1

    # With a bucket the redelivered message's dead letter is written, and the commit moves.
    fixed = make_settings(dead_letters={"overflow_bucket": "payloads"})
    store = MemoryStore(table="d", overflow_bucket="payloads")

    async def second_run() -> None:
        async with Proxy(fixed, 0, log=log, store=store, checkpoints=checkpoints) as proxy:
            assert await consume(proxy, 1, nack={1}) == [1]  # 0 and 2 were settled before
            assert proxy.snapshot().degraded == ()
            assert gauge(proxy, "triage_dead_letters_unwritable") == 0
            await eventually(lambda: log.committed == 3)

    run(second_run())
    assert [dl.record.offset for dl in store.dead_letters()] == [1]
    assert store.dead_letters()[0].record.value == BIG
