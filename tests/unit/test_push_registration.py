"""`GET /consumers` (push/grpc.py's Registration) refuses what the original Triage's Go
consumers would get refused, and dials only allowed addresses."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import make_mocked_request

from triage_proxy.config.push import DEFAULT_ALLOW
from triage_proxy.push.grpc import Registration, address_allowed

TOKEN = "the-deployment-token"


def test_the_default_allow_list_is_loopback_and_private_networks() -> None:
    for ok in ("127.0.0.1", "10.1.2.3", "172.16.0.9", "192.168.1.1", "::1", "fd00::1"):
        assert address_allowed(ok, DEFAULT_ALLOW), ok
    for refused in ("8.8.8.8", "172.32.0.1", "2001:db8::1", "not-an-ip", ""):
        assert not address_allowed(refused, DEFAULT_ALLOW), refused
    assert address_allowed("::ffff:10.0.0.1", DEFAULT_ALLOW)  # IPv4-mapped


@pytest.mark.parametrize(
    ("headers", "remote", "trust", "status", "registered"),
    [
        ({}, "127.0.0.1", False, 400, None),
        ({"Authorization": "Bearer " + TOKEN, "grpcport": "50051"}, "127.0.0.1", False, 401, None),
        ({"Authorization": TOKEN}, "127.0.0.1", False, 400, None),
        ({"Authorization": TOKEN, "grpcport": "0"}, "127.0.0.1", False, 400, None),
        ({"Authorization": TOKEN, "grpcport": "x"}, "127.0.0.1", False, 400, None),
        ({"Authorization": TOKEN, "grpcport": "50051"}, "8.8.8.8", False, 403, None),
        ({"Authorization": TOKEN, "grpcport": "50051"}, "10.0.0.7", False, 200, "10.0.0.7:50051"),
        (
            {"Authorization": TOKEN, "grpcport": "50051", "X-Forwarded-For": "10.9.9.9, 1.2.3.4"},
            "127.0.0.1",
            True,
            200,
            "10.9.9.9:50051",
        ),
        (
            {"Authorization": TOKEN, "grpcport": "50051", "X-Forwarded-For": "10.9.9.9"},
            "127.0.0.1",
            False,
            200,
            "127.0.0.1:50051",
        ),
        ({"Authorization": TOKEN, "grpcport": "50051"}, "::1", False, 200, "[::1]:50051"),
    ],
)
def test_registration_answers(
    headers: dict[str, str], remote: str, trust: bool, status: int, registered: str | None
) -> None:
    got: list[str] = []

    async def register(address: str) -> None:
        got.append(address)

    registration = Registration(lambda: [TOKEN], register, trust_forwarded_for=trust)

    async def ask() -> int:
        request = make_mocked_request("GET", "/consumers", headers=headers)
        request = request.clone(remote=remote)
        return (await registration.handle(request)).status

    assert asyncio.run(ask()) == status
    assert got == ([registered] if registered else [])
