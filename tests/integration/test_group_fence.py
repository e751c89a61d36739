"""Two deployments with one group id and two dead-letter tables (a `triage dev` stack and
a `triage init` that picked the same default group): their leases live in different
tables, so only the group fence keeps them from both delivering partition 0
(kafka/groups.py). Real Tansu, real moto server, real `triage proxy` processes.

Deployment A is a pinned proxy (what `triage dev` runs); B is a fleet process (what
`triage deploy` runs), a member of the group. Once B is a member, A stops delivering
(exit 3 naming the group, as a lost lease does) and, restarted, waits as a standby
while B lives; every record is then delivered through B alone. `triage init` and
`triage deploy` warn that the group is in use.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import (
    TOKEN,
    RawConsumer,
    committed,
    create_topic,
    kill_processes,
    produce,
    wait_until,
)
from triage_cli.devstack import write_config
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port, wait_for_port
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.exitcodes import ExitCode
from triage_proxy.store.provisioning import create_table

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TRIAGE = [sys.executable, "-m", "triage_cli.main"]


def deployment(
    folder: Path, name: str, broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str, group: str
) -> tuple[Path, int, int]:
    """A config of its own table (created), sharing `group`; returns (config, port, http)."""
    table = f"dlq-{topic}-{name}"
    create_table(DeadLetterSettings(table=table, endpoint_url=aws.endpoint_url))
    port, http = free_port(), free_port()
    config = folder / f"{name}.toml"
    write_config(
        config,
        {
            "kafka": {"bootstrap_servers": broker.bootstrap, "topic": topic, "group_id": group},
            "server": {"host": "127.0.0.1", "port": port, "http_port": http},
            "auth": {"token": TOKEN},
            "dead_letters": {"table": table, "endpoint_url": aws.endpoint_url},
            "commit": {"interval_s": 0.1},
            "shutdown": {"drain_timeout_s": 2},
            "ownership": {"lease_s": 3.0},
        },
    )
    return config, port, http


def start(config: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*TRIAGE, "proxy", "-c", str(config), *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )


def status(http: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/status", timeout=2) as response:
            doc: dict[str, Any] = json.loads(response.read())
            return doc
    except OSError:
        return None


def state_of(http: int, partition: int = 0) -> str | None:
    doc = status(http)
    if doc is None:
        return None
    for part in doc.get("partitions", []):
        if part.get("partition") == partition:
            return str(part.get("state"))
    return None


async def consume(target: str, values: set[bytes], timeout: float, committed_to: Any) -> set[bytes]:
    """Ack everything `target` delivers until every one of `values` was seen, then keep
    the stream open until `committed_to()` holds (the acks reached the commit)."""
    seen: set[bytes] = set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with RawConsumer(target, TOKEN) as consumer:
        while not values <= seen:
            got = await consumer.receive(1, timeout=max(0.1, deadline - loop.time()))
            consumer.settle(acks=[d.offset for d in got])
            seen.update(d.value for d in got if d.value is not None)
        assert await asyncio.to_thread(wait_until, committed_to, 30)
    return seen


def test_two_deployments_sharing_a_group_over_two_tables_only_one_delivers(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str, tmp_path: Path
) -> None:
    topic, group = unique_name, f"g-{unique_name}"
    create_topic(broker.bootstrap, topic)
    config_a, port_a, http_a = deployment(tmp_path, "a", broker, aws, topic, group)
    config_b, port_b, http_b = deployment(tmp_path, "b", broker, aws, topic, group)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # A alone: a pinned proxy serves partition 0 (and commits as the group).
        a = start(config_a, tmp_path / "a.log", "-p", "0")
        procs.append(a)
        wait_for_port("127.0.0.1", port_a, 60, a)
        assert wait_until(lambda: state_of(http_a) == "running", 60), status(http_a)
        produce(broker.bootstrap, topic, [(None, b"before-b", None)])
        asyncio.run(
            consume(
                f"127.0.0.1:{port_a}",
                {b"before-b"},
                60,
                lambda: committed(broker.bootstrap, group, topic) == 1,
            )
        )

        # init and deploy warn: the group has committed offsets on the topic
        init = subprocess.run(
            [
                *TRIAGE,
                "init",
                "--non-interactive",
                "--config",
                str(tmp_path / "new.toml"),
                "--bootstrap-servers",
                broker.bootstrap,
                "--topic",
                topic,
                "--group-id",
                group,
                "--endpoint-url",
                aws.endpoint_url,
            ],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        assert init.returncode == 0, init.stderr
        assert f"consumer group {group!r} has committed offsets" in init.stderr

        # B, a fleet process of the same group (another table), joins the group: A stops
        # delivering at its next renewal, exit 3 naming the group.
        b = start(config_b, tmp_path / "b.log", "--slot", "0")
        procs.append(b)
        assert wait_until(lambda: (status(http_b) or {}).get("served") == [0], 120), status(http_b)
        assert a.wait(60) == ExitCode.UNAVAILABLE
        log_a = (tmp_path / "a.log").read_text()
        assert f"consumer group {group!r} has live members" in log_a
        assert "Traceback" not in log_a

        # A restarted (as its supervisor would) waits as a standby while B lives.
        a2 = start(config_a, tmp_path / "a2.log", "-p", "0")
        procs.append(a2)
        assert wait_until(lambda: state_of(http_a) == "standby", 60), status(http_a)
        assert wait_until(lambda: "waiting, asking again" in (tmp_path / "a2.log").read_text())

        # every record now goes through B alone
        values = {b"after-%d" % i for i in range(20)}
        produce(broker.bootstrap, topic, [(None, v, None) for v in sorted(values)])
        seen = asyncio.run(
            consume(
                f"127.0.0.1:{port_b}",
                values,
                90,
                lambda: committed(broker.bootstrap, group, topic) == 21,
            )
        )
        assert values <= seen
        assert state_of(http_a) == "standby"  # it never served meanwhile
        assert a2.poll() is None
        assert "serving from offset" not in (tmp_path / "a2.log").read_text()

        # deploy warns too while B is a live member
        check = subprocess.run(
            [*TRIAGE, "config", "check", "--config", str(config_a), "--connect"],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        assert f"consumer group {group!r} has live members" in check.stderr, check.stderr
    finally:
        kill_processes(procs)
