"""The Kafka clients Triage builds report through Python logging (kafka/logs.py), never
with librdkafka's own `%3|...|FAIL|...` lines on stderr: those land, unformatted and at
every refused connect, in a proxy's log and under a command's output.

Each case runs in a child process, since librdkafka writes its own lines to file
descriptor 2 from its threads, where no capture inside this process sees them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from triage_cli.embedded import free_port

CHILD = """
import logging, sys, threading, time

from confluent_kafka import Consumer

from triage_proxy.config.settings import KafkaSettings
from triage_proxy.kafka.client import consumer_config
from triage_proxy.kafka.groups import admin_client

reported = threading.Event()


class Seen(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        print("logged:", record.getMessage(), flush=True)
        reported.set()


logging.getLogger("triage_proxy.kafka").addHandler(Seen())
logging.getLogger("triage_proxy.kafka").setLevel(logging.DEBUG)
settings = KafkaSettings("127.0.0.1:{port}", "t", "g")
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
