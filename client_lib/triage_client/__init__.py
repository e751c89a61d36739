"""Triage client: consume a Kafka partition through the Triage proxy with a plain handler.

from triage_client import Consumer, Message

async def handle(message: Message) -> None:
    ...  # return to ack; raise to nack (dead-letter); raise Retry to redeliver later

Consumer("proxy:7700", token, handle, concurrency=32).run()
"""

from triage_client.consumer import Consumer, Handler
from triage_client.errors import (
    AuthenticationError,
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
    "Handler",
    "Headers",
    "Message",
    "Retry",
    "StateError",
    "StreamError",
    "TriageClientError",
]
