"""The group membership (`kafka.assignment.Assignment`) does not leak its Consumer when
joining fails.

The Consumer is faked here: a real one cannot be made to refuse `subscribe` after the
topic was found. Joining, assignments and leaving with the real Consumer are covered by
tests/integration/test_group_admin.py and the fleet tests.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import pytest
from confluent_kafka import KafkaError, KafkaException

from triage_proxy.config.sections import KafkaSettings
from triage_proxy.errors import BrokerUnavailable
from triage_proxy.kafka import assignment
from triage_proxy.kafka.assignment import Assignment


class RefusingConsumer:
    """A Consumer whose subscribe fails as librdkafka's does (KafkaException)."""

    made: ClassVar[list[RefusingConsumer]] = []

    def __init__(self, config: dict[str, Any]) -> None:
        self.closed = 0
        RefusingConsumer.made.append(self)

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "broker went away"))

    def close(self) -> None:
        self.closed += 1


def test_a_subscribe_that_fails_closes_the_consumer_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(assignment, "check_group", lambda settings: None)
    monkeypatch.setattr(assignment, "Consumer", RefusingConsumer)
    RefusingConsumer.made.clear()
    member = Assignment(KafkaSettings("127.0.0.1:9", "orders", "g"), "m1")
    with pytest.raises(BrokerUnavailable, match="joining group 'g'"):
        asyncio.run(member.start())
    assert [c.closed for c in RefusingConsumer.made] == [1]
    asyncio.run(member.stop())  # nothing started: a no-op, not a hang
