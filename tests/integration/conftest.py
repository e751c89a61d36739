"""Fixtures for the integration tests (the broker and AWS endpoint are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.integration.harness import create_topic
from triage_cli.embedded import EmbeddedBroker


@pytest.fixture
def topic(broker: EmbeddedBroker, unique_name: str) -> str:
    """A fresh one-partition topic."""
    create_topic(broker.bootstrap, unique_name)
    return unique_name
