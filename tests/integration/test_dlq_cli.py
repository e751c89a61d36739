"""`triage dlq` end to end: a config file like the proxy's, real moto server and Tansu,
every subcommand, and the bad input a person will type."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests import samples
from tests.integration.harness import TOKEN, create_topic, write_dead_letters
from triage_cli.devstack import write_config
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port
from triage_cli.exitcodes import ExitCode
from triage_cli.main import app
from triage_proxy.config.loader import load_settings
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.kafka.logs import KafkaLog
from triage_proxy.store.items import MAX_ITEM_BYTES
from triage_proxy.store.provisioning import create_bucket, create_table
from triage_proxy.store.query import DeadLetterTable, Filters
from triage_proxy.store.replay import REPLAY_OF_HEADER
from triage_proxy.structs import DeadLetter

pytestmark = pytest.mark.integration

NOW_MS = int(time.time() * 1000)
HOUR_MS = 3_600_000
EVERY_BYTE = bytes(range(256))


def make_dl(topic: str, offset: int, *, age_ms: int = 0, **fields: Any) -> DeadLetter:
    """The sample dead letter of `topic`, produced and dead-lettered `age_ms` ago."""
    at = NOW_MS - age_ms
    return samples.make_dl(offset, topic=topic, timestamp_ms=at, at_ms=at, **fields)


@dataclass
class Stack:
    config: Path
    settings: DeadLetterSettings
    topic: str
    bootstrap: str
    dls: list[DeadLetter]


def config_file(path: Path, bootstrap: str, topic: str, dead_letters: dict[str, Any]) -> Path:
    write_config(
        path,
        {
            "kafka": {"bootstrap_servers": bootstrap, "topic": topic, "group_id": f"g-{topic}"},
            "auth": {"token": TOKEN},
            "dead_letters": dead_letters,
        },
    )
    return path


@pytest.fixture
def stack(aws: EmbeddedAWS, broker: EmbeddedBroker, unique_name: str, tmp_path: Path) -> Stack:
    topic = unique_name
    bucket = unique_name.lower()[:55].strip("-") + "-b"
    config = config_file(
        tmp_path / "triage.toml",
        broker.bootstrap,
        topic,
        {"table": unique_name, "endpoint_url": aws.endpoint_url, "overflow_bucket": bucket},
    )
    settings = load_settings(config).dead_letters
    create_table(settings)
    create_bucket(settings)
    create_topic(broker.bootstrap, topic, partitions=2)
    dls = [
        make_dl(topic, 0, key=None, value=b'{"order": 1, "items": ["a", "b"]}', age_ms=3 * HOUR_MS),
        make_dl(topic, 1, key=b"\x00\xff", value=EVERY_BYTE, reason="TimeoutError: slow"),
        make_dl(
            topic, 2, value="plain text ✓".encode(), headers=(("trace", b"t-1"), ("none", None))
        ),
        make_dl(topic, 3, key=b"big", value=os.urandom(MAX_ITEM_BYTES + 1000), age_ms=HOUR_MS // 2),
        make_dl(
            topic, 0, partition=1, value=None, reason="TimeoutError: again", age_ms=2 * HOUR_MS
        ),
    ]
    write_dead_letters(settings, dls, f"g-{topic}")
    return Stack(config, settings, topic, broker.bootstrap, dls)


TRIAGE_PROCESS = [sys.executable, "-m", "triage_cli.main"]


def triage(*args: str | Path) -> Any:
    runner = CliRunner(env={"COLUMNS": "200"})  # rich sizes tables to the terminal
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def listed(stack: Stack, *args: str) -> list[tuple[int, int]]:
    out = triage("dlq", "list", "--config", stack.config, "--json", *args)
    assert out.exit_code == 0, out.output
    return sorted((d["partition"], d["offset"]) for d in json_lines(out.stdout))


def status_of(stack: Stack, partition: int, offset: int) -> str:
    with DeadLetterTable(stack.settings, group=f"g-{stack.topic}") as table:
        return str(table.get((stack.topic, partition, offset))["status"]["S"])


def consume_all(bootstrap: str, topic: str, partitions: int = 2) -> list[Any]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"c-{time.monotonic_ns()}",
            **KafkaLog().config(),
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    found = []
    quiet = time.monotonic() + 3
    try:
        while time.monotonic() < quiet:
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                found.append(msg)
                quiet = time.monotonic() + 1.5
    finally:
        consumer.close()
    return found


# --- list -----------------------------------------------------------------------------


def test_list_shows_a_table_and_json_lines(stack: Stack) -> None:
    out = triage("dlq", "list", "--config", stack.config)
    assert out.exit_code == 0, out.output
    assert "5 dead letters" in out.stdout
    assert "TimeoutError" in out.stdout
    assert "(in S3)" in out.stdout
    rows = json_lines(triage("dlq", "list", "--config", stack.config, "--json").stdout)
    assert len(rows) == 5
    big = next(r for r in rows if r["offset"] == 3)
    assert big["payload_s3"].startswith("s3://")
    assert big["status"] == "pending"
    limited = triage("dlq", "list", "--config", stack.config, "--json", "--limit", "2")
    assert len(json_lines(limited.stdout)) == 2


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]),
        (("--partition", "1"), [(1, 0)]),
        (("--partition", "0"), [(0, 0), (0, 1), (0, 2), (0, 3)]),
        (("--reason", "timeout"), [(0, 1), (1, 0)]),
        (("--since", "1h"), [(0, 1), (0, 2), (0, 3)]),
        (("--until", "1h"), [(0, 0), (1, 0)]),
        (("--since", "150m", "--until", "10m"), [(0, 3), (1, 0)]),
        (("--status", "replayed"), []),
        (("--status", "pending", "--reason", "again"), [(1, 0)]),
    ],
)
def test_list_filters_select_exactly_what_they_say(
    stack: Stack, args: tuple[str, ...], expected: list[tuple[int, int]]
) -> None:
    assert listed(stack, "--topic", stack.topic, *args) == expected


# --- show -----------------------------------------------------------------------------


def test_show_renders_text_json_and_binary_safely(stack: Stack) -> None:
    json_value = triage("dlq", "show", "--config", stack.config, stack.topic, "0", "0")
    assert json_value.exit_code == 0, json_value.output
    assert "value (json" in json_value.stdout
    assert '  "order": 1,' in json_value.stdout
    assert "key (null)" in json_value.stdout
    binary = triage("dlq", "show", "--config", stack.config, stack.topic, "0", "1")
    assert binary.exit_code == 0
    assert "value (hex, 256 bytes)" in binary.stdout
    assert "00000000  00 01 02 03" in binary.stdout
    assert "\x00" not in binary.stdout
    assert "\x1b" not in binary.stdout
    text = triage("dlq", "show", "--config", stack.config, stack.topic, "0", "2")
    assert "plain text ✓" in text.stdout
    assert "none (null)" in text.stdout
    assert "trace (text, 3 bytes)" in text.stdout
    big = triage("dlq", "show", "--config", stack.config, stack.topic, "0", "3")
    assert big.exit_code == 0
    assert "s3://" in big.stdout
    assert "value (base64" in big.stdout


LONG_REASON = "ValueError: first line\nsecond line\x1b[31m " + "r" * 300 + " END"


def test_a_long_multiline_reason_stays_whole_and_on_one_line(stack: Stack) -> None:
    """Bad-input rows: `dlq list` piped (not a terminal) prints the whole reason, and a
    newline or an escape in a reason is shown escaped, on one line, in `list` and `show`."""
    write_dead_letters(
        stack.settings, [make_dl(stack.topic, 9, reason=LONG_REASON)], f"g-{stack.topic}"
    )
    shown = "ValueError: first line\\nsecond line\\x1b[31m " + "r" * 300 + " END"
    piped = subprocess.run(
        [sys.executable, "-m", "triage_cli.main", "dlq", "list", "-c", str(stack.config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "COLUMNS"},
    )
    assert piped.returncode == 0, piped.stderr
    [row] = [line for line in piped.stdout.splitlines() if "first line" in line]
    assert shown in row
    assert "second line" not in piped.stdout.replace(row, "")  # no extra line
    assert "\x1b" not in piped.stdout
    show = triage("dlq", "show", "--config", stack.config, stack.topic, "0", "9")
    assert show.exit_code == 0, show.output
    [line] = [line for line in show.stdout.splitlines() if "first line" in line]
    assert line.startswith("reason")
    assert line.endswith(shown)
    assert "\x1b" not in show.stdout


def test_show_json_gives_the_exact_bytes(stack: Stack) -> None:
    import base64

    out = triage("dlq", "show", "--config", stack.config, stack.topic, "0", "3", "--json")
    assert out.exit_code == 0, out.output
    [doc] = json_lines(out.stdout)
    assert base64.b64decode(doc["value"]["base64"]) == stack.dls[3].record.value
    two = json_lines(
        triage("dlq", "show", "-c", stack.config, stack.topic, "0", "2", "--json").stdout
    )
    assert two[0]["headers"] == [
        {"name": "trace", "kind": "text", "text": "t-1", "base64": "dC0x"},
        {"name": "none", "kind": "null", "text": "(null)", "base64": None},
    ]


def test_show_of_a_missing_item(stack: Stack) -> None:
    out = triage("dlq", "show", "--config", stack.config, stack.topic, "0", "99")
    assert out.exit_code == ExitCode.NOT_FOUND
    assert f"no dead letter {stack.topic}/0/99" in out.stderr


# --- replay ---------------------------------------------------------------------------


def test_replay_dry_run_changes_nothing(stack: Stack) -> None:
    out = triage(
        "dlq", "replay", "--config", stack.config, "--reason", "timeout", "--dry-run", "--json"
    )
    assert out.exit_code == 0, out.output
    assert sorted((d["partition"], d["offset"]) for d in json_lines(out.stdout)) == [(0, 1), (1, 0)]
    assert status_of(stack, 0, 1) == "pending"
    assert consume_all(stack.bootstrap, stack.topic) == []


def test_replay_is_byte_exact_and_a_rerun_replays_nothing(stack: Stack) -> None:
    out = triage("dlq", "replay", "--config", stack.config, "--topic", stack.topic)
    assert out.exit_code == 0, out.output
    assert "selected 5, replayed 5, skipped 0, failed 0" in out.stdout
    again = triage("dlq", "replay", "--config", stack.config, "--topic", stack.topic, "--json")
    assert again.exit_code == 0, again.output
    summary = json_lines(again.stdout)[-1]
    assert summary["replayed"] == 0
    assert summary["selected"] == 0
    copies = consume_all(stack.bootstrap, stack.topic)
    assert len(copies) == 5
    for dl in stack.dls:
        origin = f"{stack.topic}/{dl.record.partition}/{dl.record.offset}".encode()
        [copy] = [m for m in copies if dict(m.headers())[REPLAY_OF_HEADER] == origin]
        assert copy.partition() == dl.record.partition
        assert copy.key() == dl.record.key
        assert copy.value() == dl.record.value
        assert copy.headers()[: len(dl.record.headers)] == list(dl.record.headers)
        assert status_of(stack, dl.record.partition, dl.record.offset) == "replayed"
    assert listed(stack, "--status", "replayed") == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]


def test_sigint_during_replay_says_it_was_interrupted_and_what_remains(
    stack: Stack, tmp_path: Path
) -> None:
    """A bad-input row: Ctrl-C in the middle of a replay of 600 items (chunks of 500). The chunk in
    flight finishes and is marked; the command exits 130 and says it was interrupted and
    how many items it did not reach (still pending: a rerun replays them)."""
    import signal

    from confluent_kafka import Consumer, TopicPartition

    topic = f"{stack.topic}-many"
    create_topic(stack.bootstrap, topic)
    many = [make_dl(topic, o, value=b"v%d" % o, reason="boom") for o in range(600)]
    write_dead_letters(stack.settings, many, f"g-{stack.topic}")
    proc = subprocess.Popen(
        [
            *TRIAGE_PROCESS,
            "dlq",
            "replay",
            "-c",
            str(stack.config),
            "--topic",
            topic,
            "--partition",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watcher = Consumer(
        {"bootstrap.servers": stack.bootstrap, "group.id": f"w-{topic}", **KafkaLog().config()}
    )
    watcher.assign([TopicPartition(topic, 0, 0)])
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            message = watcher.poll(0.2)
            if message is not None and not message.error():
                break  # the first chunk is being produced: interrupt now
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        watcher.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == ExitCode.INTERRUPTED, err
    assert "Traceback" not in err
    summary = [line for line in out.splitlines() if line.startswith("selected ")]
    assert summary, out
    replayed = int(summary[0].split("replayed ", 1)[1].split(",")[0])
    assert 0 < replayed < 600
    assert f"interrupted: replayed {replayed} of 600; {600 - replayed} not reached" in err
    assert "Run the same command again" in err
    with DeadLetterTable(stack.settings, group=f"g-{stack.topic}") as table:
        assert table.get((topic, 0, 0))["status"]["S"] == "replayed"  # the first chunk
        assert table.get((topic, 0, 599))["status"]["S"] == "pending"  # not reached


def test_replay_one_offset_to_another_topic(stack: Stack) -> None:
    target = f"{stack.topic}-fixed"
    create_topic(stack.bootstrap, target)
    out = triage(
        "dlq", "replay", "-c", stack.config,
        "--topic", stack.topic, "--partition", "0", "--offset", "2", "--to-topic", target,
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "replayed 1" in out.stdout
    [copy] = consume_all(stack.bootstrap, target, partitions=1)
    assert copy.value() == "plain text ✓".encode()
    with DeadLetterTable(stack.settings, group=f"g-{stack.topic}") as table:
        item = table.get((stack.topic, 0, 2))
    assert item["replayed_to"] == {"S": f"{target}/{copy.partition()}/{copy.offset()}"}
    assert listed(stack, "--status", "pending") == [(0, 0), (0, 1), (0, 3), (1, 0)]
    rerun = triage(
        "dlq", "replay", "-c", stack.config,
        "--topic", stack.topic, "--partition", "0", "--offset", "2", "--to-topic", target,
    )  # fmt: skip
    assert rerun.exit_code == 0
    assert "is replayed" in rerun.stderr


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        ((), ExitCode.BAD_INPUT, "give a filter or --all"),
        (("--since", "yesterday"), ExitCode.BAD_INPUT, "malformed --since"),
        (("--since", "1h", "--until", "2h"), ExitCode.BAD_INPUT, "empty time range"),
        (("--offset", "1"), ExitCode.BAD_INPUT, "--offset needs --topic and --partition"),
        (("--topic", "T", "--partition", "0", "--offset", "99"), ExitCode.NOT_FOUND,
         "no dead letter T/0/99"),
        (("--all", "--to-topic", "no-such-topic"), ExitCode.NOT_FOUND,
         "topic no-such-topic does not exist"),
        (("--partition", "-1"), ExitCode.BAD_INPUT, "partition must be >= 0"),
    ],
)  # fmt: skip
def test_replay_refuses_bad_input(
    stack: Stack, args: tuple[str, ...], code: ExitCode, needle: str
) -> None:
    out = triage("dlq", "replay", "--config", stack.config, *args)
    assert out.exit_code == code, out.output
    assert needle in out.stderr
    assert listed(stack, "--status", "pending") == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]


# --- discard --------------------------------------------------------------------------


def test_discard_is_conditional(stack: Stack) -> None:
    replayed = triage(
        "dlq", "replay", "-c", stack.config, "--topic", stack.topic, "--partition", "1"
    )
    assert replayed.exit_code == 0, replayed.output
    out = triage("dlq", "discard", "--config", stack.config, "--reason", "timeout")
    assert out.exit_code == 0, out.output
    assert "selected 1, discarded 1, skipped 0" in out.stdout  # (1, 0) is replayed already
    assert status_of(stack, 0, 1) == "discarded"
    assert status_of(stack, 1, 0) == "replayed"
    missing = triage(
        "dlq", "discard", "-c", stack.config, "--topic", stack.topic, "--partition", "0",
        "--offset", "42",
    )  # fmt: skip
    assert missing.exit_code == ExitCode.NOT_FOUND
    assert "no dead letter" in missing.stderr
    with DeadLetterTable(stack.settings, group=f"g-{stack.topic}") as table:
        assert not table.discard((stack.topic, 0, 1))  # twice: no-op
        claimed = list(table.scan(Filters(topic=stack.topic, status="pending")))
    assert len(claimed) == 3


# --- errors that are not about items --------------------------------------------------


def test_unknown_table(aws: EmbeddedAWS, broker: EmbeddedBroker, tmp_path: Path) -> None:
    config = config_file(
        tmp_path / "t.toml",
        broker.bootstrap,
        "t",
        {"table": "no-such-table", "endpoint_url": aws.endpoint_url},
    )
    for command in (
        ["list"],
        ["show", "t", "0", "1"],
        ["replay", "--all"],
        ["discard", "--all"],
    ):
        out = triage("dlq", command[0], "--config", config, *command[1:])
        assert out.exit_code == ExitCode.NOT_FOUND, out.output
        assert "table 'no-such-table' does not exist" in out.stderr


def test_unreachable_endpoint_and_bad_config(tmp_path: Path) -> None:
    config = config_file(
        tmp_path / "t.toml",
        "127.0.0.1:1",
        "t",
        {"table": "tlq", "endpoint_url": f"http://127.0.0.1:{free_port()}"},
    )
    out = triage("dlq", "list", "--config", config)
    assert out.exit_code == ExitCode.UNAVAILABLE
    assert "127.0.0.1" in out.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[kafka\n")
    out = triage("dlq", "list", "--config", bad)
    assert out.exit_code == ExitCode.BAD_INPUT
    assert "not valid TOML" in out.stderr
    out = triage("dlq", "list", "--config", tmp_path / "missing.toml")
    assert out.exit_code == ExitCode.BAD_INPUT


def test_unreachable_broker_replays_nothing(stack: Stack, tmp_path: Path) -> None:
    config = config_file(
        tmp_path / "dead-kafka.toml",
        f"127.0.0.1:{free_port()}",
        stack.topic,
        {
            "table": stack.settings.table,
            "endpoint_url": stack.settings.endpoint_url,
            "overflow_bucket": stack.settings.overflow_bucket,
        },
    )
    out = triage("dlq", "replay", "--config", config, "--all")
    assert out.exit_code == ExitCode.UNAVAILABLE, out.output
    assert "cannot reach Kafka" in out.stderr
    assert listed(stack, "--status", "pending") == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]


def test_a_real_process(stack: Stack) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "triage_cli.main", "dlq", "list", "-c", str(stack.config), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert len(json_lines(out.stdout)) == 5
