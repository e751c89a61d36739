"""The group queries (kafka/groups.py, kafka/assignment.py) ask through the AdminClient
they are given, and a pinned process asks through one, against real Tansu (and moto).

An AdminClient is falsy (its len() is 0), so `admin or AdminClient(...)` made a new
one, a librdkafka handle with its own threads and connections, for every call: a pinned
proxy's group fence built and destroyed one at every lease renewal, and destroying one
while the broker hung (SIGSTOP in the fault suite) tripped an assertion in librdkafka
that aborted the proxy.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from tests.integration.harness import await_until, create_topic, settings_for
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port
from triage_proxy.app import Proxy
from triage_proxy.config.sections import KafkaSettings
from triage_proxy.kafka import assignment, groups

pytestmark = pytest.mark.integration


def nowhere(topic: str) -> KafkaSettings:
    """Settings whose broker does not exist: only an admin given to a call can answer."""
    return KafkaSettings(f"127.0.0.1:{free_port()}", topic, topic)


def counted_admins(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The configs of the AdminClients the proxy builds from now on (real ones, counted):
    every one is built by kafka/groups.py (`admin_client`)."""
    made: list[dict[str, Any]] = []

    class Counted(AdminClient):
        def __init__(self, config: dict[str, Any]) -> None:
            made.append(config)
            super().__init__(config)

    monkeypatch.setattr(groups, "AdminClient", Counted)
    return made


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
    made = counted_admins(monkeypatch)
    create_topic(broker.bootstrap, unique_name)
    fence = groups.GroupFence(KafkaSettings(broker.bootstrap, unique_name, unique_name))
    for _ in range(3):
        assert fence.busy() is None  # no live members: the pinned proxy may deliver
    assert len(made) == 1


def test_a_pinned_process_fences_all_its_partitions_through_one_admin(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One admin client per process, not per partition (each is a librdkafka handle with
    threads and broker connections of its own), asked at every partition's renewals."""
    made = counted_admins(monkeypatch)
    create_topic(broker.bootstrap, unique_name, partitions=3)
    settings = settings_for(broker, aws, unique_name)
    assert settings.ownership.enabled

    async def scenario() -> None:
        async with Proxy(settings, [0, 1, 2]) as proxy:
            assert sorted(proxy.pipelines) == [0, 1, 2]
            # each partition's fence asked, at its renewals
            assert await await_until(lambda: asked[0] >= 6, timeout=60), asked[0]

    asked = [0]
    busy = groups.GroupFence.busy

    def counted_busy(fence: groups.GroupFence) -> str | None:
        asked[0] += 1
        return busy(fence)

    monkeypatch.setattr(groups.GroupFence, "busy", counted_busy)
    asyncio.run(asyncio.wait_for(scenario(), 120))
    # one for the start's check that the pins are inside the topic (pinned.py), one for
    # the group fence of all three partitions
    assert len(made) == 2
