"""The one producer configuration of a replay, whichever tool replays.

Why one: `triage dlq replay` and the Spark job both produce replays, and two producer
configurations may partition a key differently (librdkafka's default `consistent_random`
against `murmur2_random`), so a dead letter replayed to another topic would land on a
partition that depends on the tool. Both build theirs here. `murmur2_random` is the Java client's
partitioner: a key lands where a Java (or Kafka Streams, or Connect) producer puts it,
which is what users of a Kafka tool expect. A replay back to its source topic names the
source partition itself (store/replay.py), so the partitioner decides only `--to-topic`.

`never_written` reads a failed delivery report for the replay: which librdkafka errors
prove the message never reached the broker is a rule about librdkafka, so it lives here,
at the Kafka edge, and the replay (store/, which knows no Kafka) is handed it.

No confluent-kafka import here: the Spark executors import this module, and load the
client only when a segment produces. Errors are read by `KafkaError.name()`, which needs
no import either.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REPLAY_PARTITIONER = "murmur2_random"
"""The Java client's partitioner (murmur2 of the key; a random partition without one)."""
REPLAY_DELIVERY_TIMEOUT_S = 60.0
"""How long librdkafka keeps trying to deliver one replayed message (message.timeout.ms);
a message it gives up on is in doubt (store/replay.py)."""
LINGER_MS = 5
"""A replay sends chunks of messages: a short linger batches them."""
NOT_SENT_ERRORS = frozenset(
    {
        "_PURGE_QUEUE",
        "_UNKNOWN_TOPIC",
        "_UNKNOWN_PARTITION",
        "_INVALID_ARG",
        "UNKNOWN_TOPIC_OR_PART",
        "MSG_SIZE_TOO_LARGE",
        "TOPIC_AUTHORIZATION_FAILED",
    }
)
"""librdkafka delivery errors (by `KafkaError.name()`) that guarantee the message was never
written; every other error may have written it."""


def replay_producer_config(
    connection: Mapping[str, Any], *, delivery_timeout_s: float = REPLAY_DELIVERY_TIMEOUT_S
) -> dict[str, Any]:
    """The librdkafka properties of a replay's producer: `connection` (bootstrap servers,
    security, secrets resolved, `[kafka.client]` extras), then replay's own, which win:
    idempotence (librdkafka's own retries never duplicate), acks from every replica, and
    the partitioner every replay shares."""
    return {
        **connection,
        "acks": "all",
        "enable.idempotence": True,
        "linger.ms": LINGER_MS,
        "message.timeout.ms": int(delivery_timeout_s * 1000),
        "partitioner": REPLAY_PARTITIONER,
    }


def never_written(err: object) -> bool:
    """Whether a delivery report's error (a `KafkaError`, read by its `name()`) proves the
    broker never took the message. Anything unknown may have been written: a replay must
    keep its claim."""
    name = getattr(err, "name", None)
    return str(name() if callable(name) else err) in NOT_SENT_ERRORS
