"""Exclusive ownership against real parts: the lease item in moto's DynamoDB, and two
`triage proxy` processes on one partition, the holder killed with kill -9."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.integration.harness import (
    TOKEN,
    RawConsumer,
    await_until,
    committed,
    kill_processes,
    produce,
    settings_for,
    target,
    wait_until,
)
from triage_cli.devstack import write_config
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port, wait_for_port
from triage_proxy.app import Proxy, ProxyState
from triage_proxy.errors import NotFoundError, OwnershipLost
from triage_proxy.store.items import lease_source
from triage_proxy.store.leases import DynamoDBLeases, Lease
from triage_proxy.store.query import DeadLetterTable, Filters

pytestmark = pytest.mark.integration

LEASE_S = 2.0
TAKEOVER_SLACK_S = 2.5
"""Beyond the lease: the standby's poll, opening Kafka, the consumer's reconnect."""


def test_lease_item_conditional_writes(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    settings = settings_for(broker, aws, unique_name)  # creates the table
    a = DynamoDBLeases(settings.dead_letters, unique_name, 0, settings.kafka.group_id)
    b = DynamoDBLeases(settings.dead_letters, unique_name, 0, settings.kafka.group_id)
    other_partition = DynamoDBLeases(settings.dead_letters, unique_name, 1, settings.kafka.group_id)
    try:
        now = 1_000_000
        assert a.acquire("a", now, now + 2000) == Lease("a", now + 2000)
        assert b.acquire("b", now + 1000, now + 3000) == Lease("a", now + 2000)  # refused
        assert other_partition.acquire("b", now, now + 2000) == Lease("b", now + 2000)
        assert not b.renew("b", now + 1000, now + 3000)  # a forged owner cannot renew
        assert not b.release("b")  # nor release
        assert a.renew("a", now + 1000, now + 3000)
        assert b.get() == Lease("a", now + 3000)
        assert b.acquire("b", now + 2999, now + 5000).owner == "a"  # not lapsed yet
        assert b.acquire("b", now + 3001, now + 5001) == Lease("b", now + 5001)  # takeover
        assert not a.renew("a", now + 3002, now + 5002)  # the old holder learns it lost
        assert not a.release("a")
        assert a.get() == Lease("b", now + 5001)
        assert b.release("b")
        assert a.get() is None
        assert a.acquire("a", now + 3003, now + 5003).owner == "a"  # released: free at once
        # The lease item lives in the dead-letter table but is never a dead letter.
        with DeadLetterTable(settings.dead_letters, group=settings.kafka.group_id) as table:
            assert list(table.scan(Filters(), consistent=True)) == []
            assert list(table.scan(Filters(topic=unique_name, partition=0))) == []
    finally:
        for store in (a, b, other_partition):
            store.close()
    group = settings.kafka.group_id
    assert lease_source(unique_name, 0, group) == f"{unique_name}#0#lease#{group}"


def _config(path: Path, base: dict[str, dict[str, Any]], port: int, http_port: int) -> Path:
    values = {**base, "server": {"host": "127.0.0.1", "port": port, "http_port": http_port}}
    write_config(path, values)
    return path


def _proxy(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "triage_cli.main", "proxy", "-c", str(config), "-p", "0"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )


def _readyz(http_port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=1) as r:
            return r.status, r.read().decode().strip()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode().strip()
    except OSError:
        return 0, ""


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class Recorder:
    """Consumers of one proxy: reconnect until stopped, ack at once, and record each
    delivery with the proxy's name and the monotonic time it arrived."""

    def __init__(self, name: str, target: str) -> None:
        self.name = name
        self.target = target
        self.deliveries: list[tuple[str, int, float]] = []
        self.acked: set[int] = set()

    async def run(self) -> None:
        """Until cancelled (a cancellation grpc turns into an error still ends it)."""
        while True:
            try:
                async with RawConsumer(self.target, credits=50) as c:
                    seen = 0
                    while True:
                        await c.read()
                        fresh, seen = c.deliveries[seen:], len(c.deliveries)
                        now = time.monotonic()
                        self.deliveries.extend((self.name, d.offset, now) for d in fresh)
                        if fresh:
                            c.settle(acks=[d.offset for d in fresh])
                            self.acked.update(d.offset for d in fresh)
            except (grpc.aio.AioRpcError, EOFError):
                # grpc may report the task's own cancellation as a CANCELLED call: that
                # is the stop, not a dead proxy to reconnect to (else gather() waits forever).
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError from None
                await asyncio.sleep(0.05)


def test_a_lease_call_on_a_missing_table_says_what_it_read_and_which_table(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    settings = settings_for(broker, aws, unique_name)
    gone = dataclasses.replace(settings.dead_letters, table=f"{unique_name}-missing")
    leases = DynamoDBLeases(gone, unique_name, 0, settings.kafka.group_id)
    try:
        with pytest.raises(NotFoundError) as read:
            leases.get()
        with pytest.raises(NotFoundError) as acquired:  # reads an old proxy's lease first
            leases.acquire("a", 1_000, 3_000)
    finally:
        leases.close()
    table = f"the dead-letter table '{unique_name}-missing' does not exist"
    assert str(read.value).startswith(f"reading the partition lease: {table}")
    assert str(acquired.value).startswith(f"reading the partition's legacy lease: {table}")


def test_standby_takes_over_after_kill_9_and_never_delivers_at_once(
    tmp_path: Path, broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    settings = settings_for(broker, aws, topic)  # creates the table
    base: dict[str, dict[str, Any]] = {
        "kafka": {
            "bootstrap_servers": broker.bootstrap,
            "topic": topic,
            "group_id": settings.kafka.group_id,
        },
        "auth": {"token": TOKEN},
        "dead_letters": {"table": settings.dead_letters.table, "endpoint_url": aws.endpoint_url},
        "commit": {"interval_s": 0.1},
        "ownership": {"lease_s": LEASE_S},
    }
    ports = {name: (free_port(), free_port()) for name in ("a", "b")}
    configs = {name: _config(tmp_path / f"{name}.toml", base, *ports[name]) for name in ("a", "b")}
    total = 300
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["a"] = _proxy(configs["a"], tmp_path / "a.log")
        wait_for_port("127.0.0.1", ports["a"][0], 30, procs["a"])
        procs["b"] = _proxy(configs["b"], tmp_path / "b.log")
        # The standby is observable (HTTP up), not ready, and does not listen for consumers.
        assert wait_until(lambda: _readyz(ports["b"][1]) == (503, "standby"), timeout=15)
        assert _readyz(ports["a"][1])[0] == 200
        assert not _listening(ports["b"][0])

        recorders = {n: Recorder(n, f"127.0.0.1:{ports[n][0]}") for n in ("a", "b")}
        killed_at: list[float] = []

        def producer() -> None:
            for i in range(total // 10):
                produce(
                    broker.bootstrap,
                    topic,
                    [(None, b"m%d" % (i * 10 + j), None) for j in range(10)],
                )
                time.sleep(0.03)

        async def scenario() -> None:
            tasks = [asyncio.ensure_future(r.run()) for r in recorders.values()]
            producing = threading.Thread(target=producer)
            producing.start()
            try:
                # Kill the holder while it is delivering.
                assert await await_until(lambda: len(recorders["a"].deliveries) >= total // 3)
                killed_at.append(time.monotonic())
                os.kill(procs["a"].pid, signal.SIGKILL)
                deadline = time.monotonic() + 60
                while len(recorders["a"].acked | recorders["b"].acked) < total:
                    assert time.monotonic() < deadline, "not every message was acked"
                    await asyncio.sleep(0.05)
            finally:
                await asyncio.to_thread(producing.join)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(scenario())
        assert procs["a"].wait(10) == -signal.SIGKILL
        a, b = recorders["a"].deliveries, recorders["b"].deliveries
        assert a
        assert b
        # Never both at once: the standby delivered nothing before the holder died, and
        # nothing the holder delivered arrived after the standby's first delivery.
        first_b = min(t for _, _, t in b)
        assert first_b > killed_at[0]
        assert max(t for _, _, t in a) < first_b
        assert first_b - killed_at[0] < LEASE_S + TAKEOVER_SLACK_S
        assert recorders["a"].acked | recorders["b"].acked == set(range(total))
        group = settings.kafka.group_id
        assert wait_until(lambda: committed(broker.bootstrap, group, topic) == total)
        assert _readyz(ports["b"][1]) == (200, "ready")
    finally:
        kill_processes(procs.values())


def test_holder_cut_off_from_dynamodb_stops_delivering_and_exits_before_expiry(
    broker: EmbeddedBroker, topic: str
) -> None:
    # A private moto server, so it can be frozen without disturbing other tests.
    with EmbeddedAWS() as aws:
        settings = settings_for(broker, aws, topic, ownership={"lease_s": 1.0})
        produce(broker.bootstrap, topic, [(None, b"m%d" % i, None) for i in range(10)])

        async def scenario() -> None:
            proxy = Proxy(settings, 0)
            await proxy.start()
            try:
                pipeline = proxy.pipelines.get(proxy.partition)
                assert pipeline is not None
                ownership = pipeline.ownership
                assert ownership is not None
                assert ownership.holding
                async with RawConsumer(target(proxy), credits=5) as c:
                    await c.receive(5)
                    os.kill(aws.pid, signal.SIGSTOP)
                    frozen = time.monotonic()
                    try:
                        await asyncio.wait_for(ownership.lost.wait(), timeout=3)
                        # Before the standby's earliest takeover (last sent + lease_s).
                        assert time.monotonic() - frozen < 1.0
                        with pytest.raises(OwnershipLost):
                            await asyncio.wait_for(proxy.wait_stopped(), timeout=5)
                        assert proxy.state is ProxyState.STOPPED
                        c.settle(acks=[d.offset for d in c.deliveries])
                        with pytest.raises((EOFError, grpc.aio.AioRpcError)):
                            await c.receive(1, timeout=2)  # the stream ended, nothing more
                        assert len(c.deliveries) == 5
                    finally:
                        os.kill(aws.pid, signal.SIGCONT)
            finally:
                proxy.stop()
                with contextlib.suppress(OwnershipLost):
                    await proxy.wait_stopped()
            assert committed(broker.bootstrap, settings.kafka.group_id, topic) <= 0

        asyncio.run(scenario())
