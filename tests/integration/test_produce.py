"""`triage produce` against a real broker: what it prints is where the records are, byte
for byte, and each bad input ends with its message and exit code, producing nothing."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from typer.testing import CliRunner

from tests.integration.harness import TOKEN, create_topic
from triage_cli.devstack import write_config
from triage_cli.embedded import EmbeddedBroker, free_port
from triage_cli.exitcodes import ExitCode
from triage_cli.main import app

pytestmark = pytest.mark.integration


def config(tmp_path: Path, bootstrap: str, topic: str) -> Path:
    path = tmp_path / "triage.toml"
    write_config(
        path,
        {
            "kafka": {"bootstrap_servers": bootstrap, "topic": topic, "group_id": f"g-{topic}"},
            "auth": {"token": TOKEN},
            "dead_letters": {"table": "unused-table"},
        },
    )
    return path


def triage(*args: str | Path, stdin: str | None = None) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args], input=stdin, catch_exceptions=False)


def read(bootstrap: str, topic: str, partition: int, offset: int) -> Any:
    """The record at topic[partition]@offset, read back with a plain Kafka consumer."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "reader", "logger": None})
    try:
        consumer.assign([TopicPartition(topic, partition, offset)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                return msg
        raise AssertionError(f"{topic}[{partition}]@{offset} never arrived")
    finally:
        consumer.close()


def landed(output: str) -> list[tuple[str, int, int]]:
    found = re.findall(r"^(.+)\[(\d+)\]@(\d+)$", output, re.MULTILINE)
    return [(t, int(p), int(o)) for t, p, o in found]


def test_produces_what_it_is_given_and_prints_where_it_landed(
    broker: EmbeddedBroker, unique_name: str, tmp_path: Path
) -> None:
    create_topic(broker.bootstrap, unique_name, partitions=2)
    path = config(tmp_path, broker.bootstrap, unique_name)
    out = triage(
        "produce", "-c", path, "--key", "k-1", "--value", "héllo", "--partition", "1",
        "--header", "source=test", "--header", "empty=",
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    [(topic, partition, offset)] = landed(out.output)
    assert (topic, partition) == (unique_name, 1)
    msg = read(broker.bootstrap, topic, partition, offset)
    assert msg.key() == b"k-1"
    assert msg.value() == "héllo".encode()
    assert msg.headers() == [("source", b"test"), ("empty", b"")]


def test_one_record_per_stdin_line(
    broker: EmbeddedBroker, unique_name: str, tmp_path: Path
) -> None:
    create_topic(broker.bootstrap, unique_name)
    path = config(tmp_path, broker.bootstrap, unique_name)
    out = triage("produce", "-c", path, stdin="a\nb\n\nc\n")
    assert out.exit_code == 0, out.output
    places = landed(out.output)
    assert len(places) == 4
    values = [read(broker.bootstrap, t, p, o).value() for t, p, o in places]
    assert values == [b"a", b"b", b"", b"c"]


@pytest.mark.parametrize(
    ("args", "stdin", "code", "needle"),
    [
        (["--value", "x", "--header", "no-equals"], None, ExitCode.BAD_INPUT, "NAME=VALUE"),
        (["--value", "x", "--partition", "7"], None, ExitCode.BAD_INPUT, "has partitions 0..0"),
        (["--value", "x", "--topic", "no-such-topic"], None, ExitCode.NOT_FOUND, "does not exist"),
        ([], "", ExitCode.BAD_INPUT, "no lines on stdin"),
    ],
)
def test_bad_input_is_named_and_produces_nothing(
    broker: EmbeddedBroker,
    topic: str,
    tmp_path: Path,
    args: list[str],
    stdin: str | None,
    code: ExitCode,
    needle: str,
) -> None:
    path = config(tmp_path, broker.bootstrap, topic)
    out = triage("produce", "-c", path, *args, stdin=stdin)
    assert out.exit_code == code, out.output
    assert needle in out.output
    assert landed(out.output) == []


def test_an_unreachable_broker_exits_3(tmp_path: Path) -> None:
    path = config(tmp_path, f"127.0.0.1:{free_port()}", "orders")
    out = triage("produce", "-c", path, "--value", "x")
    assert out.exit_code == ExitCode.UNAVAILABLE, out.output
    assert "cannot reach Kafka" in out.output
