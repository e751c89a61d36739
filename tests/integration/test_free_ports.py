"""Issue 10: the suite passes beside a local deployment on the default ports.

tests/conftest.py holds every default port while integration tests run, so a listener
a test starts on a default port fails its test (the kill -9 tests of
test_guarantees.py once did: their proxies bound the default HTTP port and exited 2).
This checks that the hold is really in place.
"""

from __future__ import annotations

import socket

import pytest

from tests.conftest import DEFAULT_PORTS
from triage_proxy.config.sections import DEFAULT_HTTP_PORT, DEFAULT_PORT

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_the_default_ports_are_taken_while_integration_tests_run(host: str) -> None:
    assert {DEFAULT_PORT, DEFAULT_PORT + 1, DEFAULT_HTTP_PORT, DEFAULT_HTTP_PORT + 1} <= set(
        DEFAULT_PORTS
    )
    for port in DEFAULT_PORTS:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
            with pytest.raises(OSError, match="in use"):
                sock.bind((host, port))
