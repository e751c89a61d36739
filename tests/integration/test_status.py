"""`triage status` as an operator runs it: a real proxy process, the real broker (Tansu)
and DynamoDB (moto server), one partition's proxy deliberately down."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import TOKEN, RawConsumer, create_topic, produce
from triage_cli.devstack import write_config
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port, free_port_block
from triage_cli.exitcodes import ExitCode
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.store.provisioning import create_table

pytestmark = pytest.mark.integration

TRIAGE = [sys.executable, "-m", "triage_cli.main"]


def triage(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TRIAGE, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def status_json(config: Path) -> tuple[int, dict[str, Any]]:
    out = triage("status", "--config", str(config), "--json")
    assert out.stdout, out.stderr
    return out.returncode, json.loads(out.stdout)


def one_by_one(bootstrap: str, topic: str, partition: int, n: int) -> None:
    """One record per produce request, so Tansu's high watermark is exact (DESIGN.md)."""
    for i in range(n):
        produce(bootstrap, topic, [(b"k%d" % i, b"v%d" % i, None)], partition=partition)


def write_stack_config(
    path: Path, broker: str, endpoint: str, topic: str, base: int, partitions: int = 2
) -> Path:
    table = f"dlq-{topic}"
    create_table(DeadLetterSettings(table=table, endpoint_url=endpoint))
    write_config(
        path,
        {
            "kafka": {
                "bootstrap_servers": broker,
                "topic": topic,
                "group_id": f"g-{topic}",
                "partitions": partitions,
            },
            "server": {"host": "127.0.0.1", "port": base, "http_port": base + partitions},
            "auth": {"token": TOKEN},
            "dead_letters": {"table": table, "endpoint_url": endpoint, "flush_interval_ms": 5},
            "commit": {"interval_s": 0.1},
            "shutdown": {"drain_timeout_s": 2},
        },
    )
    return path


async def until_status(config: Path, predicate: Any, timeout: float = 20) -> dict[str, Any]:
    """Run `triage status --json` until `predicate(doc)` holds; return that doc."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        _, doc = await asyncio.to_thread(status_json, config)
        if predicate(doc) or asyncio.get_running_loop().time() > deadline:
            return doc
        await asyncio.sleep(0.3)


def test_status_reports_known_lag_in_flight_dead_letters_and_a_down_proxy(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str, tmp_path: Path
) -> None:
    topic = unique_name
    create_topic(broker.bootstrap, topic, 2)
    one_by_one(broker.bootstrap, topic, 0, 5)
    one_by_one(broker.bootstrap, topic, 1, 3)
    base = free_port_block(4)
    config = write_stack_config(
        tmp_path / "triage.toml", broker.bootstrap, aws.endpoint_url, topic, base
    )

    # Nothing runs yet: lag is the whole partition, both proxies are down, no crash.
    code, doc = status_json(config)
    assert code == ExitCode.FAILURE
    p0, p1 = doc["partitions"]
    assert (p0["committed_offset"], p0["log_end_offset"], p0["lag"]) == (None, 5, 5)
    assert (p1["committed_offset"], p1["log_end_offset"], p1["lag"]) == (None, 3, 3)
    assert p0["proxy"] == p1["proxy"] == "down"
    assert p0["proxy_url"] == f"http://127.0.0.1:{base + 2}/status"
    assert p0["proxy_error"]
    assert p0["dead_letters_pending"] == 0
    assert doc["totals"] == {"lag": 8, "in_flight": None, "dead_letters_pending": 0,
                             "proxies_down": 2, "processes_down": 2}  # fmt: skip
    assert doc["broker_error"] is None

    with open(tmp_path / "proxy-0.log", "wb") as log:
        proxy = subprocess.Popen(
            [*TRIAGE, "proxy", "--config", str(config), "--partition", "0"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:

        async def scenario() -> None:
            doc = await until_status(config, lambda d: d["partitions"][0]["proxy"] == "running")
            assert doc["partitions"][0]["proxy"] == "running", doc
            async with RawConsumer(f"127.0.0.1:{base}") as consumer:
                await consumer.receive(5)
                doc = await until_status(
                    config, lambda d: d["partitions"][0]["connected_instances"] == 1
                )
                p0, p1 = doc["partitions"]
                assert p0["in_flight"] == 5
                assert p0["instances"] == [consumer.consumer_id]
                assert p0["oldest_unsettled_age_s"] > 0
                assert p0["lag"] == 5  # delivered, not settled: nothing committed
                assert p1["proxy"] == "down"

                consumer.settle(acks=[0, 1, 2, 3], nacks=[(4, "cannot parse")])
                doc = await until_status(
                    config,
                    lambda d: (
                        d["partitions"][0]["lag"] == 0
                        and d["partitions"][0]["dead_letters_pending"] == 1
                    ),
                )
                p0, p1 = doc["partitions"]
                assert (p0["committed_offset"], p0["log_end_offset"], p0["lag"]) == (5, 5, 0)
                assert p0["dead_letters_pending"] == 1
                assert p0["in_flight"] == 0
                assert p0["oldest_unsettled_age_s"] is None
                assert p1["lag"] == 3
                assert doc["totals"]["lag"] == 3
                assert doc["totals"]["proxies_down"] == 1

        asyncio.run(scenario())

        table = triage("status", "--config", str(config))
        assert table.returncode == ExitCode.FAILURE  # partition 1's proxy is down
        assert "running" in table.stdout
        assert "down" in table.stdout
        assert f"proxy 1 down (http://127.0.0.1:{base + 3}/status)" in table.stdout

        watch = subprocess.Popen(
            [*TRIAGE, "status", "--config", str(config), "--watch", "--interval", "0.3"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert watch.stderr is not None
        started = watch.stderr.readline()  # once it says so, a signal ends it with 0
        assert "watching every 0.3 s" in started, started
        os.kill(watch.pid, signal.SIGTERM)  # ends a watch like Ctrl-C
        out, err = watch.communicate(timeout=30)
        assert watch.returncode == ExitCode.OK, err
        assert "running" in out  # the table drawn last stays on a non-terminal
    finally:
        if proxy.poll() is None:
            os.kill(proxy.pid, signal.SIGTERM)
            try:
                proxy.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(proxy.pid, signal.SIGKILL)
                proxy.wait()


def test_status_with_the_broker_unreachable_exits_unavailable_and_still_reports(
    aws: EmbeddedAWS, unique_name: str, tmp_path: Path
) -> None:
    closed = free_port()  # nothing listens here
    config = write_stack_config(
        tmp_path / "triage.toml",
        f"127.0.0.1:{closed}",
        aws.endpoint_url,
        unique_name,
        free_port_block(2),
        partitions=1,
    )
    code, doc = status_json(config)
    assert code == ExitCode.UNAVAILABLE
    assert doc["broker_error"]
    (p0,) = doc["partitions"]
    assert (p0["committed_offset"], p0["lag"], p0["proxy"]) == (None, None, "down")
    assert p0["dead_letters_pending"] == 0


def test_status_with_the_dead_letter_table_unreachable_exits_unavailable_and_still_reports(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str, tmp_path: Path
) -> None:
    create_topic(broker.bootstrap, unique_name, partitions=1)
    config = write_stack_config(
        tmp_path / "triage.toml",
        broker.bootstrap,
        aws.endpoint_url,
        unique_name,
        free_port_block(2),
        partitions=1,
    )
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    config.write_text(config.read_text().replace(aws.endpoint_url, closed))
    code, doc = status_json(config)
    assert code == ExitCode.UNAVAILABLE
    assert doc["dead_letters_error"]
    assert not doc["dead_letters_missing"]
    assert doc["broker_error"] is None
    (p0,) = doc["partitions"]
    assert p0["dead_letters_pending"] is None  # unknown, not 0


def test_status_without_partition_count_or_broker_fails_cleanly(
    aws: EmbeddedAWS, unique_name: str, tmp_path: Path
) -> None:
    config = write_stack_config(
        tmp_path / "triage.toml",
        f"127.0.0.1:{free_port()}",
        aws.endpoint_url,
        unique_name,
        free_port_block(2),
        partitions=1,
    )
    text = config.read_text().replace("partitions = 1\n", "")
    config.write_text(text)
    out = triage("status", "--config", str(config), "--json")
    assert out.returncode == ExitCode.UNAVAILABLE
    assert "error:" in out.stderr
    assert "Traceback" not in out.stderr


def test_dead_letter_counts_give_up_within_seconds_while_dynamodb_does_not_answer(
    unique_name: str,
) -> None:
    """Its own DynamoDB endpoint, frozen with SIGSTOP (it accepts connections and never
    answers): the counts fail with the cause after TABLE_ATTEMPTS read timeouts, where
    the tools' five kept an operator waiting 25 s for the report."""
    from triage_cli.status.sources import TABLE_ATTEMPTS, Sources
    from triage_proxy.config.loader import settings_from_dict
    from triage_proxy.store.aws import DEFAULT_READ_TIMEOUT_S

    with EmbeddedAWS() as frozen:
        table = f"dlq-{unique_name}"
        create_table(DeadLetterSettings(table=table, endpoint_url=frozen.endpoint_url))
        raw = {
            "kafka": {
                "bootstrap_servers": "127.0.0.1:9",
                "topic": unique_name,
                "group_id": f"g-{unique_name}",
                "partitions": 1,
            },
            "auth": {"token": TOKEN},
            "dead_letters": {"table": table, "endpoint_url": frozen.endpoint_url},
        }
        sources = Sources(settings_from_dict(raw, {}), None)
        frozen.signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            counts, error, missing = sources.dead_letters(1)
            took = time.monotonic() - started
        finally:
            frozen.signal(signal.SIGCONT)
            sources.close()
    assert counts == {0: None}
    assert error
    assert not missing
    # Each attempt waits out the read timeout: five took 26 s, two take 10-11 s; the bound
    # leaves a busy machine a third more.
    assert TABLE_ATTEMPTS * DEFAULT_READ_TIMEOUT_S <= took < 18.0, took
