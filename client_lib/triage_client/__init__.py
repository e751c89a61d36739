"""Triage client: consume a Kafka topic through the Triage proxies with a plain handler.

from triage_client import Consumer, Message

async def handle(message: Message) -> None:
    ...  # return to ack; raise to nack (dead-letter); raise Retry to redeliver later

Consumer("proxy:7700", token, handle, concurrency=32).run()  # any proxy: every partition
"""

from triage_client.consumer import Consumer, Handler
from triage_client.errors import (
    AuthenticationError,
    EndpointError,
    PartitionError,
    Retry,
    StateError,
    StreamError,
    TriageClientError,
)
from triage_client.message import ConsumerStats, Headers, Message

__all__ = [
    "AuthenticationError",
    "Consumer",
    "ConsumerStats",
    "EndpointError",
    "Handler",
    "Headers",
    "Message",
    "PartitionError",
    "Retry",
    "StateError",
    "StreamError",
    "TriageClientError",
]
