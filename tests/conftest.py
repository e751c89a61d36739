"""Session fixtures: the real broker (Tansu) and the real AWS endpoint (moto server).

Both run as child processes on free loopback ports and are stopped by PID when
the session ends, pass or fail.
"""

from __future__ import annotations

import itertools
import signal
from collections.abc import Iterator
from types import FrameType

import pytest

from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker

_names = itertools.count()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def pytest_configure(config: pytest.Config) -> None:
    # A SIGTERM (CI timeout, kill) then tears the fixtures down like Ctrl-C does, so the
    # broker and moto server are stopped by PID instead of outliving the run.
    signal.signal(signal.SIGTERM, _interrupt)


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
