"""The Kafka clients Triage builds report through Python logging (kafka/logs.py), never
with librdkafka's own `%3|...|FAIL|...` lines on stderr: those land, unformatted and at
every refused connect, in a proxy's log and under a command's output.

The stderr cases run in a child process, since librdkafka writes its own lines to file
descriptor 2 from its threads, where no capture inside this process sees them.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from triage_cli.embedded import free_port
from triage_proxy.config.sections import KafkaSettings
from triage_proxy.kafka.groups import GroupFence
from triage_proxy.kafka.logs import logger as kafka_log

KAFKA_LOG = kafka_log.name
"""triage_proxy.kafka.logs: KafkaLog's error reports, and its librdkafka lines below it."""

CHILD = """
import logging, sys, threading, time

from confluent_kafka import Consumer, Producer

from triage_proxy.config.sections import DeadLetterSettings, KafkaSettings
from triage_proxy.kafka.client import consumer_config
from triage_proxy.kafka.groups import admin_client
from triage_replay.options import ReplayOptions
from triage_replay.segment import producer_config

reported = threading.Event()


class Seen(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        print("logged:", record.getMessage(), flush=True)
        reported.set()


logging.getLogger("triage_proxy.kafka").addHandler(Seen())
logging.getLogger("triage_proxy.kafka").setLevel(logging.DEBUG)
settings = KafkaSettings("127.0.0.1:{port}", "t", "g")
replay = ReplayOptions(DeadLetterSettings("unused"), group="g", bootstrap="127.0.0.1:{port}")
client = {build}
deadline = time.monotonic() + 20
while not reported.is_set() and time.monotonic() < deadline:
    client.poll(0.1)  # serves the error callback
sys.exit(0 if reported.is_set() else 3)
"""


BUILDS = {
    # the group queries' client: a pinned proxy's group fence, `triage init`, `deploy`
    "admin": "admin_client(settings)",
    # the fetching consumer of a pinned partition and of a fleet process's reader
    "consumer": "Consumer(consumer_config(settings))",
    # a Spark replay task's producer, on an executor
    "replay": "Producer(producer_config(replay))",
}


@pytest.mark.parametrize("client", sorted(BUILDS))
def test_a_client_whose_broker_refuses_reports_through_logging_not_stderr(client: str) -> None:
    port = free_port()  # nothing listens there: every connect is refused at once
    child = textwrap.dedent(CHILD).format(port=port, build=BUILDS[client])
    out = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, f"no report reached logging in 20 s\n{out.stdout}{out.stderr}"
    assert f"127.0.0.1:{port}" in out.stdout, out.stdout  # the refusal, through KafkaLog
    assert "|FAIL|" not in out.stderr, out.stderr
    assert "rdkafka#" not in out.stderr, out.stderr


def test_the_group_fence_serves_its_clients_reports_at_each_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The fence's AdminClient lives as long as its process and only the fence uses it:
    unless the fence polls it, each refused connect's report waits in the client's queue
    for as long as the broker stays down."""
    port = free_port()
    fence = GroupFence(KafkaSettings(f"127.0.0.1:{port}", "t", "g"))
    with caplog.at_level(logging.DEBUG, logger="triage_proxy.kafka"):
        assert fence.busy() is None  # no answer (after its call timeout): no reason
    # KafkaLog's loggers: the client's own reports, not the fence's note of the failure
    reports = [r.getMessage() for r in caplog.records if r.name.startswith(KAFKA_LOG)]
    assert any(f"127.0.0.1:{port}" in m for m in reports), caplog.text
