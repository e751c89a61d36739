"""Proxy processes that serve many partitions each: pinned with a repeated --partition,
or as a fleet whose partitions Kafka's group coordinator assigns (real Tansu, real moto).

One process serving three partitions end to end for one topic-level Consumer; two fleet
processes splitting six partitions, then one stopped with SIGTERM and its partitions
moving to the other with nothing lost; bad input: a pinned partition outside the topic
(exit 2) and a group coordinator that cannot be reached (exit 3).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import (
    TOKEN,
    await_until,
    committed,
    create_topic,
    dead_letters,
    kill_processes,
    produce,
    settings_for,
    target,
    wait_until,
)
from triage_cli.devstack import write_config
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port, free_port_block
from triage_client import Consumer, Message
from triage_proxy.app import Proxy
from triage_proxy.observe.endpoint import NOT_A_MEMBER

pytestmark = pytest.mark.integration


def all_committed(bootstrap: str, group: str, topic: str, expected: dict[int, int]) -> bool:
    return all(committed(bootstrap, group, topic, p) == n for p, n in expected.items())


def produce_all(bootstrap: str, topic: str, partitions: int, each: int) -> None:
    for p in range(partitions):
        sent = [
            (b"k-%d-%d" % (p, i), (b"poison" if i % 25 == 7 else b"ok") + b"-%d" % i, None)
            for i in range(each)
        ]
        produce(bootstrap, topic, sent, partition=p)


class Seen:
    """(partition, offset) handled, and how many times."""

    def __init__(self) -> None:
        self.times: dict[tuple[int, int], int] = {}

    def add(self, message: Message) -> None:
        key = (message.partition, message.offset)
        self.times[key] = self.times.get(key, 0) + 1

    def count(self, partition: int) -> int:
        return sum(1 for p, _ in self.times if p == partition)


def handler(seen: Seen) -> Any:
    async def handle(message: Message) -> None:
        await asyncio.sleep(0.001)
        seen.add(message)
        if (message.value or b"").startswith(b"poison"):
            raise ValueError("poison")

    return handle


# --- one process, several pinned partitions ------------------------------------------------


def test_one_process_serves_three_partitions_to_one_consumer(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    create_topic(broker.bootstrap, unique_name, partitions=3)
    settings = settings_for(broker, aws, unique_name)
    each = 50
    produce_all(broker.bootstrap, unique_name, 3, each)
    expected = dict.fromkeys(range(3), each)
    seen = Seen()

    async def scenario() -> dict[str, Any]:
        async with Proxy(settings, [0, 1, 2]) as proxy:
            assert sorted(proxy.pipelines) == [0, 1, 2]
            consumer = Consumer(target(proxy), TOKEN, handler(seen), concurrency=8)
            task = asyncio.create_task(consumer.run_async())
            try:
                assert await await_until(
                    lambda: all(seen.count(p) == each for p in range(3)), timeout=60
                ), {p: seen.count(p) for p in range(3)}
                assert await asyncio.to_thread(
                    wait_until,
                    lambda: all_committed(
                        broker.bootstrap, settings.kafka.group_id, unique_name, expected
                    ),
                    60,
                )
                status = proxy.status().to_json()
            finally:
                consumer.stop()
                await asyncio.wait_for(task, 30)
            assert sorted(consumer.stats.partitions) == [0, 1, 2]
            return status

    status = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert status["served"] == [0, 1, 2]
    assert [d["partition"] for d in status["partitions"]] == [0, 1, 2]
    assert {d["committed_offset"] for d in status["partitions"]} == {each}
    poison = sum(1 for i in range(each) if i % 25 == 7)
    assert len(dead_letters(settings)) == 3 * poison


# --- a fleet: the group assigns ------------------------------------------------------------


def fleet_config(
    tmp_path: Path, broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str, processes: int
) -> Path:
    settings = settings_for(broker, aws, topic)  # creates the table
    config = tmp_path / "fleet.toml"
    # Process `slot` listens on base + slot and http + slot: probe every port of both
    # blocks, or another test's server may hold http + 1 and answer the status poll.
    base = free_port_block(processes)
    http = free_port_block(processes)
    write_config(
        config,
        {
            "kafka": {
                "bootstrap_servers": broker.bootstrap,
                "topic": topic,
                "group_id": settings.kafka.group_id,
            },
            "server": {"host": "127.0.0.1", "port": base, "http_port": http},
            "auth": {"token": TOKEN},
            "dead_letters": {
                "table": settings.dead_letters.table,
                "endpoint_url": aws.endpoint_url,
                "flush_interval_ms": 5,
            },
            "commit": {"interval_s": 0.1},
            "shutdown": {"drain_timeout_s": 5},
            "ownership": {"lease_s": 5.0},
        },
    )
    return config


def start_fleet_process(config: Path, slot: int, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "triage_cli.main", "proxy", "-c", str(config)]
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*command, "--slot", str(slot)], stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )


def served_by(http_port: int) -> list[int] | None:
    """The partitions the fleet process on `http_port` serves; None when none answers."""
    import http.client
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=2) as r:
            doc = json.loads(r.read())
    except (OSError, http.client.HTTPException):
        return None
    return list(doc["served"])


def readyz(http_port: int) -> tuple[int, str] | None:
    """The fleet process's /readyz: (status, body); None when none answers."""
    import http.client
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as refused:
        with refused:
            return refused.code, refused.read().decode()
    except (OSError, http.client.HTTPException):
        return None


def test_two_fleet_processes_split_six_partitions_and_one_leaving_hands_its_over(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str, tmp_path: Path
) -> None:
    from triage_proxy.config.loader import load_settings

    create_topic(broker.bootstrap, unique_name, partitions=6)
    config = fleet_config(tmp_path, broker, aws, unique_name, 2)
    settings = load_settings(config)
    http = settings.server.http_port
    assert http is not None
    everything = list(range(6))
    sent = dict.fromkeys(everything, 0)

    def send(each: int) -> None:
        produce_all(broker.bootstrap, unique_name, 6, each)
        for p in everything:
            sent[p] += each

    seen = Seen()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        a = start_fleet_process(config, 0, tmp_path / "a.log")
        procs.append(a)
        assert wait_until(lambda: served_by(http) == everything, 60), served_by(http)

        async def scenario() -> None:
            endpoint = f"127.0.0.1:{settings.server.port}"  # process a: it stays
            consumer = Consumer(endpoint, TOKEN, handler(seen), concurrency=16)
            task = asyncio.create_task(consumer.run_async())
            try:
                await asyncio.to_thread(send, 40)
                b = start_fleet_process(config, 1, tmp_path / "b.log")
                procs.append(b)

                def split() -> bool:
                    on_a, on_b = served_by(http), served_by(http + 1)
                    return (
                        on_a is not None
                        and on_b is not None
                        and len(on_a) == 3
                        and sorted(on_a + on_b) == everything
                    )

                assert await asyncio.to_thread(wait_until, split, 60), (
                    served_by(http),
                    served_by(http + 1),
                )
                await asyncio.to_thread(send, 40)
                b.terminate()  # SIGTERM: drain, commit, release, leave the group
                assert await asyncio.to_thread(b.wait, 60) == 0
                assert await asyncio.to_thread(
                    wait_until, lambda: served_by(http) == everything, 60
                ), served_by(http)
                await asyncio.to_thread(send, 40)
                assert await await_until(
                    lambda: all(seen.count(p) == sent[p] for p in everything), timeout=90
                ), {p: seen.count(p) for p in everything}
                assert await asyncio.to_thread(
                    wait_until,
                    lambda: all_committed(
                        broker.bootstrap, settings.kafka.group_id, unique_name, sent
                    ),
                    60,
                )
            finally:
                consumer.stop()
                await asyncio.wait_for(task, 30)

        asyncio.run(asyncio.wait_for(scenario(), 300))
        a.terminate()
        assert a.wait(60) == 0
    finally:
        kill_processes(procs)
    lost = [(p, o) for p in everything for o in range(sent[p]) if (p, o) not in seen.times]
    assert lost == []
    log_b = (tmp_path / "b.log").read_text()
    assert "group assigned partitions" in log_b


# --- bad input ------------------------------------------------------------------------------


def test_a_pinned_partition_outside_the_topic_exits_2(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str, tmp_path: Path
) -> None:
    create_topic(broker.bootstrap, unique_name, partitions=2)
    config = fleet_config(tmp_path, broker, aws, unique_name, 1)
    command = [sys.executable, "-m", "triage_cli.main", "proxy", "-c", str(config)]
    done = subprocess.run(
        [*command, "-p", "1", "-p", "2"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert "--partition" in done.stderr
    assert "2 outside topic" in done.stderr


def test_a_fleet_process_that_cannot_reach_the_group_coordinator_exits_3(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str, tmp_path: Path
) -> None:
    config = tmp_path / "unreachable.toml"
    write_config(
        config,
        {
            "kafka": {
                "bootstrap_servers": f"127.0.0.1:{free_port()}",
                "topic": unique_name,
                "group_id": "g",
            },
            "server": {"host": "127.0.0.1", "port": 0, "http_port": 0},
            "auth": {"token": TOKEN},
            "dead_letters": {"table": "tlq", "endpoint_url": aws.endpoint_url},
        },
    )
    started = time.monotonic()
    command = [sys.executable, "-m", "triage_cli.main", "proxy", "-c", str(config)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 3, done.stderr
    assert "cannot reach the group coordinator of group 'g'" in done.stderr
    assert time.monotonic() - started < 60


# --- deploy --proxies N and status ---------------------------------------------------------


def test_deploy_local_runs_a_fleet_and_status_shows_who_serves_what(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str, tmp_path: Path
) -> None:
    import json

    create_topic(broker.bootstrap, unique_name, partitions=4)
    config = fleet_config(tmp_path, broker, aws, unique_name, 2)
    triage = [sys.executable, "-m", "triage_cli.main"]
    state = tmp_path / "state"
    where = ["--config", str(config), "--state-dir", str(state)]
    try:
        deployed = subprocess.run(
            [*triage, "deploy", "--target", "local", *where, "--proxies", "2", "--timeout", "120"],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        assert "a fleet of 2 proxies" in deployed.stdout
        doc = json.loads((state / "state.json").read_text())
        assert doc["mode"] == "fleet"
        assert [e["slot"] for e in doc["proxies"]] == [0, 1]
        pids = {e["pid"] for e in doc["proxies"]}

        def rows() -> list[dict[str, Any]]:
            shown = subprocess.run(
                [*triage, "status", "--config", str(config), "--json"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            return list(json.loads(shown.stdout)["partitions"]) if shown.stdout else []

        def split() -> list[dict[str, Any]] | None:
            got = rows()
            if len(got) != 4 or any(r["proxy"] != "running" for r in got):
                return None
            served = {r["served_by"]["pid"] for r in got}
            return got if served == pids else None

        got = wait_until(split, 60, interval=1.0)
        assert got, rows()
        assert all(r["endpoint"] for r in got)
    finally:
        destroyed = subprocess.run(
            [*triage, "destroy", "--target", "local", *where],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert destroyed.returncode == 0, destroyed.stderr
    assert not list(state.glob("*.pid"))


# --- the group coordinator lost later --------------------------------------------------------


def test_a_fleet_process_that_loses_the_group_coordinator_stops_delivering(
    aws: EmbeddedAWS, unique_name: str, tmp_path: Path
) -> None:
    """Its own broker, frozen with SIGSTOP while a fleet process serves two partitions:
    once the group session times out the process drains every partition and its leases
    end (released, or lapsed), so it never serves a partition it may no longer own; it
    stays up, and serves again once the coordinator answers."""
    import signal

    from triage_proxy.config.loader import load_settings
    from triage_proxy.store.leases import DynamoDBLeaseReader

    with EmbeddedBroker() as broker:
        create_topic(broker.bootstrap, unique_name, partitions=2)
        config = fleet_config(tmp_path, broker, aws, unique_name, 1)
        settings = load_settings(config)
        http = settings.server.http_port
        assert http is not None
        reader = DynamoDBLeaseReader(settings.dead_letters, unique_name, settings.kafka.group_id)
        proc = start_fleet_process(config, 0, tmp_path / "p.log")

        def leases_live() -> list[int]:
            now_ms = int(time.time() * 1000)
            found = reader.get_many([0, 1])
            return sorted(p for p, lease in found.items() if lease.until_ms > now_ms)

        try:
            assert wait_until(lambda: served_by(http) == [0, 1], 60), served_by(http)
            assert leases_live() == [0, 1]
            broker.signal(signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                assert wait_until(lambda: served_by(http) == [], 30), served_by(http)
                drained_after = time.monotonic() - stopped
                # Serving nothing of nothing assigned is not ready: out of the group.
                assert readyz(http) == (503, f"{NOT_A_MEMBER}\n"), readyz(http)
                assert wait_until(lambda: leases_live() == [], 30), leases_live()
                assert proc.poll() is None  # it stays up, delivering nothing
            finally:
                broker.signal(signal.SIGCONT)
            assert wait_until(lambda: served_by(http) == [0, 1], 90), served_by(http)
            assert wait_until(lambda: (readyz(http) or (0, ""))[0] == 200, 30), readyz(http)
        finally:
            kill_processes([proc])
            reader.close()
    log = (tmp_path / "p.log").read_text()
    assert "group session lost" in log, log[-3000:]
    # The session timeout (6 s) and the coordinator's silence, not a drain of its own.
    assert drained_after < 25, drained_after
