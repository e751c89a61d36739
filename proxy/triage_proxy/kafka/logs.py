"""librdkafka's error callback and log lines, into Python logging once per cause.

Why: left alone, librdkafka prints its own `%3|...|FAIL|...` lines to stderr (they
spilled onto `triage status`'s output), and every failed connect while the broker is
down arrives twice, once as a log line and once through `error_cb` (~38 lines a
second). So no Kafka client Triage builds is left with librdkafka's defaults: the
proxy's, the group queries', `triage status`'s, the dev stack's, the demo's, the
conformance kit's and a Spark replay task's producer pass `KafkaLog(...).config()` (the
group membership consumer routes its own, `assignment.py`; `triage dlq` and `triage
init`, which report a failure themselves, keep only librdkafka's errors or none).
`KafkaLog`:

- `error_cb` is the one report of a client error, rate-limited per error code through
  `logthrottle.LogThrottle` (WARNING; DEBUG with `quiet`, for a command that reports
  the failure itself, like `triage status`);
- librdkafka's log lines go to the `triage_proxy.kafka.logs.librdkafka` logger: its
  errors (syslog level <= 3, which `error_cb` reports too) at DEBUG, the rest at their
  level, rate-limited per facility;
- an error that says the topic or partition is gone (deleted under a running proxy)
  is logged at ERROR naming the topic: some brokers (Tansu 0.6) then make librdkafka
  fall, and the supervisor's backoff restarts a proxy that finds the topic missing and
  says so (`kafka/client.py`, exit 4).
"""

from __future__ import annotations

import logging
from typing import Any

from triage_proxy.kafka.errors import describe, is_gone
from triage_proxy.observe.logthrottle import LogThrottle

logger = logging.getLogger(__name__)
librdkafka_logger = logging.getLogger(f"{__name__}.librdkafka")


class KafkaLog:
    """The error callback and logger of one Kafka client (see the module docstring)."""

    def __init__(self, topic: str | None = None, *, quiet: bool = False) -> None:
        self._topic = topic
        self._quiet = quiet
        self._errors = LogThrottle(logger)
        self._lines = LogThrottle(librdkafka_logger)

    def config(self) -> dict[str, Any]:
        """The librdkafka properties that route a client's reports here."""
        return {"error_cb": self.on_error, "logger": self}

    def on_error(self, err: Any) -> None:
        """librdkafka's `error_cb` (a KafkaError): one line per error code per interval."""
        code = err.code()
        if is_gone(err):
            where = f"topic {self._topic!r}" if self._topic else "a topic"
            self._errors.log(
                logging.ERROR,
                code,
                "kafka: %s is gone from the broker (deleted?): %s",
                where,
                describe(err),
            )
            return
        level = logging.DEBUG if self._quiet else logging.WARNING
        self._errors.log(level, code, "kafka: %s", describe(err))

    def log(self, level: int, msg: str, *args: object) -> None:
        """What confluent-kafka calls for each librdkafka log line (`logger` property):
        `level` is a Python level, `args` are (facility, client name, text)."""
        if level >= logging.ERROR:
            level = logging.DEBUG  # error_cb reports it (once)
        facility = args[0] if args else msg
        self._lines.log(level, facility, msg, *args)
