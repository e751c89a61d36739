"""Session fixtures: the real broker (Tansu) and the real AWS endpoint (moto server).

Both run as child processes on free loopback ports and are stopped by PID when
the session ends, pass or fail.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from triage_proxy.embedded import EmbeddedAWS, EmbeddedBroker

_names = itertools.count()


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as proc:
        yield proc


@pytest.fixture(scope="session")
def aws() -> Iterator[EmbeddedAWS]:
    with EmbeddedAWS() as proc:
        yield proc


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A topic/table name no other test in this session uses."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name)[:40]
    return f"{base}-{next(_names)}"
