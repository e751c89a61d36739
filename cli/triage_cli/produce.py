"""`triage produce`: write test records to the deployment's topic, the way a newcomer (or
a smoke test after a deploy) sends their own messages to their own handler.

    triage produce -c triage.toml --key order-1 --value '{"id": 1}'
    seq 5 | triage produce -c triage.toml --key k      # one record per stdin line

It reads the broker connection (`kafka.*`, secrets resolved) and the topic from the
proxy's own config, so it reaches exactly the broker and topic the proxies read, and
produces with the replay producer (`kafka/producer.py`: idempotent, acks from every
replica, the Java client's partitioner, so a key lands where any Kafka tool puts it).
Each record is confirmed by the broker before the command says where it landed; one
that is not ends the command with a named exit code and nothing is reported as sent.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from triage_cli.exitcodes import CommandFailed, ExitCode, exit_on_errors

DELIVERY_TIMEOUT_S = 30.0
"""How long the command waits for the broker to confirm every record."""


def parse_header(text: str) -> tuple[str, bytes]:
    """NAME=VALUE as a Kafka header (the value may be empty; the name may not)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise CommandFailed(
            ExitCode.BAD_INPUT, f"--header {text!r}: write it as NAME=VALUE, e.g. source=test"
        )
    return name, value.encode()


def produce(
    config: Annotated[
        Path, typer.Option("--config", "-c", help="The proxies' TOML config (kafka.* is read).")
    ],
    value: Annotated[
        str | None,
        typer.Option(help="The record's value (UTF-8). Without it: one record per stdin line."),
    ] = None,
    key: Annotated[str | None, typer.Option(help="The record's key (default: none).")] = None,
    header: Annotated[
        list[str] | None,
        typer.Option("--header", metavar="NAME=VALUE", help="A header (repeatable)."),
    ] = None,
    partition: Annotated[
        int | None,
        typer.Option(
            min=0, help="Write to this partition (default: by key, as Kafka's Java client does)."
        ),
    ] = None,
    topic: Annotated[
        str | None, typer.Option(help="Write to this topic instead of kafka.topic.")
    ] = None,
) -> None:
    """Produce records to the deployment's topic and print where each landed
    (topic[partition]@offset)."""
    from triage_cli.dlq.broker import producer_config
    from triage_proxy.config.loader import load_settings
    from triage_proxy.store.aws import read_secret

    with exit_on_errors():
        headers: list[tuple[str, str | bytes | None]] = [parse_header(h) for h in header or []]
        settings = load_settings(config, fetch_secret=read_secret)
        target = topic or settings.kafka.topic
        if value is not None:
            values = [value]
        elif sys.stdin.isatty():
            raise CommandFailed(
                ExitCode.BAD_INPUT,
                "give --value TEXT, or pipe the values in, one record per line",
            )
        else:
            values = [line.rstrip("\r\n") for line in sys.stdin]
            if not values:
                raise CommandFailed(
                    ExitCode.BAD_INPUT, "no lines on stdin: give --value TEXT, or pipe lines in"
                )
        landed = _send(
            producer_config(settings),
            settings.kafka.bootstrap_servers,
            target,
            partition,
            key,
            values,
            headers,
        )
        for where in landed:
            typer.echo(where)


def _send(
    config: dict[str, Any],
    bootstrap: str,
    topic: str,
    partition: int | None,
    key: str | None,
    values: list[str],
    headers: list[tuple[str, str | bytes | None]],
) -> list[str]:
    """Produce `values` and wait for the broker's answer to each; the places they landed."""
    from confluent_kafka import Producer

    from triage_proxy.kafka.errors import describe, kafka_errors

    producer = Producer(config)
    unreachable = f"cannot reach Kafka at {bootstrap}"
    with kafka_errors(unreachable, lambda why: CommandFailed(ExitCode.UNAVAILABLE, why)):
        metadata = producer.list_topics(timeout=10)
    found = metadata.topics.get(topic)
    if found is None or found.error is not None:
        raise CommandFailed(ExitCode.NOT_FOUND, f"topic {topic} does not exist on {bootstrap}")
    if partition is not None and partition not in found.partitions:
        raise CommandFailed(
            ExitCode.BAD_INPUT,
            f"--partition {partition}: topic {topic} has partitions 0..{len(found.partitions) - 1}",
        )
    landed: list[str] = []
    failed: list[str] = []

    def report(err: Any, msg: Any) -> None:
        if err is not None:
            failed.append(describe(err))
        else:
            landed.append(f"{msg.topic()}[{msg.partition()}]@{msg.offset()}")

    extra: dict[str, Any] = {} if partition is None else {"partition": partition}
    for text in values:
        producer.produce(
            topic,
            value=text.encode(),
            key=None if key is None else key.encode(),
            headers=headers or None,
            on_delivery=report,
            **extra,
        )
        producer.poll(0)
    left = producer.flush(DELIVERY_TIMEOUT_S)
    if failed or left:
        why = failed[0] if failed else f"{left} records unconfirmed after {DELIVERY_TIMEOUT_S:g} s"
        raise CommandFailed(
            ExitCode.FAILURE,
            f"{len(failed) + left} of {len(values)} records were not confirmed: {why}",
        )
    return landed
