"""Pins the client library's public names: changing them is a breaking change for users."""

import triage_client


def test_public_api_is_exactly_this() -> None:
    assert triage_client.__all__ == [
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


def test_every_public_name_exists() -> None:
    for name in triage_client.__all__:
        assert getattr(triage_client, name) is not None, name
