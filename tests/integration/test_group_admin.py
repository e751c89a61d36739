"""The group queries (kafka/groups.py, kafka/assignment.py) ask through the AdminClient
they are given, against real Tansu.

An AdminClient is falsy (its len() is 0), so `admin or AdminClient(...)` made a new
one, a librdkafka handle with its own threads and connections, for every call: a pinned
proxy's group fence built and destroyed one at every lease renewal, and destroying one
while the broker hung (SIGSTOP in the fault suite) tripped an assertion in librdkafka
that aborted the proxy.
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from tests.integration.harness import create_topic
from triage_cli.embedded import EmbeddedBroker, free_port
from triage_proxy.config.settings import KafkaSettings
from triage_proxy.kafka import assignment, groups

pytestmark = pytest.mark.integration


def nowhere(topic: str) -> KafkaSettings:
    """Settings whose broker does not exist: only an admin given to a call can answer."""
    return KafkaSettings(f"127.0.0.1:{free_port()}", topic, topic)


def test_the_group_queries_ask_through_the_admin_they_are_given(
    broker: EmbeddedBroker, unique_name: str
) -> None:
    create_topic(broker.bootstrap, unique_name, partitions=3)
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    settings = nowhere(unique_name)
    assert groups.describe_group(settings, admin).live is False
    assert groups.committed_partitions(settings, admin) == []
    assert assignment.topic_partitions(settings, admin) == 3


def test_a_group_fence_asks_through_one_admin(
    broker: EmbeddedBroker, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[dict[str, Any]] = []

    class Counted(AdminClient):  # type: ignore[misc]
        """A real AdminClient, counted."""

        def __init__(self, config: dict[str, Any]) -> None:
            made.append(config)
            super().__init__(config)

    monkeypatch.setattr(groups, "AdminClient", Counted)
    create_topic(broker.bootstrap, unique_name)
    fence = groups.GroupFence(KafkaSettings(broker.bootstrap, unique_name, unique_name))
    for _ in range(3):
        assert fence.busy() is None  # no live members: the pinned proxy may deliver
    assert len(made) == 1
