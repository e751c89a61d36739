"""Whether librdkafka takes a config's `[kafka.client]` properties: a consumer is built
from them and closed at once (it sends nothing that matters before it is closed), so a
property librdkafka refuses is found before the proxy starts, named by its config key."""

from __future__ import annotations

from typing import Any

from confluent_kafka import Consumer

from triage_proxy.config.settings import Settings
from triage_proxy.config.validation import is_secret_property
from triage_proxy.kafka.errors import client_config_errors
from triage_proxy.kafka.logs import KafkaLog


def check_client_properties(settings: Settings) -> None:
    """Raise ConfigError naming the first `[kafka.client]` property librdkafka refuses."""
    if not settings.kafka.client:
        return
    config: dict[str, Any] = {
        name: "x" if is_secret_property(name) else value
        for name, value in settings.kafka.client.items()
    }
    config.update(
        {
            "bootstrap.servers": settings.kafka.bootstrap_servers,
            "group.id": settings.kafka.group_id,
            **KafkaLog(settings.kafka.topic, quiet=True).config(),
        }
    )
    with client_config_errors(settings.kafka.client):
        Consumer(config).close()
