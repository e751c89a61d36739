"""What `triage dlq` asks Kafka: the replay producer (its config, shared with
`triage produce` and the console) and a topic's partition count, with librdkafka's
own log lines kept quiet."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from triage_cli.exitcodes import CommandFailed, ExitCode

if TYPE_CHECKING:
    from triage_proxy.config.settings import Settings


LEGACY_METADATA_TIMEOUT_S = 3.0


def partition_count(settings: Settings, topic: str) -> int:
    """The topic's partition count from the broker; 1 (partition 0 only) when it does not
    answer in LEGACY_METADATA_TIMEOUT_S (dlq works without a broker)."""
    from confluent_kafka.admin import AdminClient

    from triage_proxy.errors import BrokerUnavailable
    from triage_proxy.kafka.errors import kafka_errors

    config = {**settings.kafka.librdkafka_config(), "logger": _quiet_kafka_logger()}
    try:
        with kafka_errors(f"reading the metadata of {topic}"):
            meta = AdminClient(config).list_topics(topic, timeout=LEGACY_METADATA_TIMEOUT_S)
    except BrokerUnavailable:
        return 1
    found = meta.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        return 1
    return len(found.partitions)


def producer_config(settings: Settings) -> dict[str, Any]:
    """The replay producer every tool shares (`kafka.producer`), on this config's broker;
    a broker that does not answer fails the command in 10 s, quietly."""
    from triage_proxy.kafka.producer import replay_producer_config

    return {
        **replay_producer_config(settings.kafka.librdkafka_config()),
        "socket.connection.setup.timeout.ms": 10_000,
        "logger": _quiet_kafka_logger(),
    }


def replay_producer(settings: Settings, to_topic: str | None, topics: Collection[str]) -> Any:
    """A confluent-kafka producer, after checking the broker answers and the targets
    (`to_topic`, or the dead letters' source `topics`) exist."""
    from confluent_kafka import Producer

    from triage_proxy.kafka.errors import kafka_errors

    producer = Producer(producer_config(settings))
    unreachable = f"cannot reach Kafka at {settings.kafka.bootstrap_servers}"
    with kafka_errors(unreachable, lambda why: CommandFailed(ExitCode.UNAVAILABLE, why)):
        metadata = producer.list_topics(timeout=10)
    wanted = {to_topic} if to_topic else set(topics)
    missing = sorted(t for t in wanted if t not in metadata.topics)
    if missing:
        raise CommandFailed(ExitCode.NOT_FOUND, f"topic {', '.join(missing)} does not exist")
    return producer


def _quiet_kafka_logger() -> Any:
    """librdkafka's own log lines go to a logger that only shows errors."""
    import logging

    log = logging.getLogger("triage_cli.dlq.kafka")
    log.setLevel(logging.ERROR)
    return log
