"""`GET /consumers` (push/grpc.py's Registration) refuses what the original Triage's Go
consumers would get refused, and dials only allowed addresses."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
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
        ({"Authorization": TOKEN, "grpcport": "\u0663"}, "127.0.0.1", False, 400, None),  # "٣"
        ({"Authorization": TOKEN, "grpcport": "65536"}, "127.0.0.1", False, 400, None),
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


def test_header_bytes_that_are_not_utf8_are_refused_not_a_server_error() -> None:
    """Raw bytes on a loopback socket, as a broken or hostile client sends them: a token
    that is not UTF-8 is a 401 and a port in another script's digits a 400, never a 500."""
    got: list[str] = []
    port = 0  # the server's, once `scenario` started it (bound before `nonlocal port`)

    async def register(address: str) -> None:
        got.append(address)

    async def ask(raw_headers: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /consumers HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + raw_headers)
        writer.write(b"\r\n")
        answer = await reader.read()
        writer.close()
        await writer.wait_closed()
        return answer.split(b"\r\n", 1)[0]

    async def scenario() -> list[bytes]:
        nonlocal port
        registration = Registration(lambda: [TOKEN, "t\u00fcken-non-ascii"], register)
        app = web.Application()
        app.router.add_get("/consumers", registration.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            return [
                await ask(b"Authorization: \xff\xfe\r\ngrpcport: 50051\r\n"),
                await ask(b"Authorization: " + TOKEN.encode() + b"\r\ngrpcport: \xd9\xa3\r\n"),
                await ask("Authorization: t\u00fcken-non-ascii\r\ngrpcport: 50051\r\n".encode()),
            ]
        finally:
            await runner.cleanup()

    lines = asyncio.run(scenario())
    assert lines == [
        b"HTTP/1.1 401 Unauthorized",
        b"HTTP/1.1 400 Bad Request",
        b"HTTP/1.1 200 OK",  # a token that is UTF-8 but not ASCII is compared as sent
    ]
    assert got == ["127.0.0.1:50051"]
