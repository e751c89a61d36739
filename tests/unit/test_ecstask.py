"""`ecstask`: a task's own address from the ECS task metadata endpoint, served here by a
local HTTP server with the documented v4 container document."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from triage_proxy.config.ecs import (
    ECS_TASK_DNS,
    ECS_TASK_IP,
    LOOKUP_ATTEMPTS,
    METADATA_ENV,
    resolve_advertised_host,
    task_address,
)
from triage_proxy.config.sections import ServerSettings
from triage_proxy.errors import ConfigError

CONTAINER = {
    "DockerId": "cd189a933e5849daa93386466019ab50-2495160603",
    "Name": "triage",
    "Networks": [
        {
            "NetworkMode": "awsvpc",
            "IPv4Addresses": ["10.0.2.106"],
            "AttachmentIndex": 0,
            "IPv4SubnetCIDRBlock": "10.0.2.0/24",
            "DomainNameSearchList": ["us-west-2.compute.internal"],
            "PrivateDNSName": "ip-10-0-2-106.us-west-2.compute.internal",
        }
    ],
}


class Metadata:
    """A stand-in for the ECS agent's endpoint: answers `body` (or `status`) on any path."""

    def __init__(self) -> None:
        self.body: Any = CONTAINER
        self.status = 200
        self.failures_left = 0
        self.paths: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.paths.append(self.path)
                if outer.failures_left:
                    outer.failures_left -= 1
                    self.send_error(503)
                    return
                data = (
                    outer.body if isinstance(outer.body, bytes) else json.dumps(outer.body).encode()
                )
                self.send_response(outer.status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def env(self) -> dict[str, str]:
        host, port = self.server.server_address[:2]
        return {METADATA_ENV: f"http://{host!s}:{port}/v4/abc-123"}


@pytest.fixture
def metadata() -> Iterator[Metadata]:
    served = Metadata()
    served.thread.start()
    yield served
    served.server.shutdown()
    served.server.server_close()


def test_the_private_dns_name_and_ip_come_from_the_container_document(
    metadata: Metadata,
) -> None:
    assert task_address(ECS_TASK_DNS, metadata.env) == "ip-10-0-2-106.us-west-2.compute.internal"
    assert task_address(ECS_TASK_IP, metadata.env) == "10.0.2.106"
    assert metadata.paths == ["/v4/abc-123", "/v4/abc-123"]  # the container's own document


def test_resolve_replaces_only_an_ecs_kind(metadata: Metadata) -> None:
    server = ServerSettings(host="0.0.0.0", port=7700, advertised_host=ECS_TASK_IP)
    resolved = resolve_advertised_host(server, metadata.env)
    assert resolved.advertised_host == "10.0.2.106"
    assert resolved.advertised_endpoint(0, 7700) == "10.0.2.106:7700"
    for plain in (ServerSettings(advertised_host="nlb.example.com"), ServerSettings()):
        assert resolve_advertised_host(plain, {}) is plain
    assert metadata.paths == ["/v4/abc-123"]


def test_outside_ecs_the_kind_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_advertised_host(ServerSettings(advertised_host=ECS_TASK_DNS), {})
    assert caught.value.key == "server.advertised_host"
    assert METADATA_ENV in caught.value.problem


def test_a_failing_endpoint_is_retried_then_named(metadata: Metadata) -> None:
    metadata.failures_left = LOOKUP_ATTEMPTS - 1
    assert task_address(ECS_TASK_IP, metadata.env, delay_s=0) == "10.0.2.106"
    metadata.failures_left = LOOKUP_ATTEMPTS
    with pytest.raises(ConfigError, match="did not answer usefully"):
        task_address(ECS_TASK_IP, metadata.env, delay_s=0)
    metadata.body = b"not json"
    with pytest.raises(ConfigError, match="did not answer usefully"):
        task_address(ECS_TASK_IP, metadata.env, delay_s=0)


@pytest.mark.parametrize(
    ("body", "kind", "says"),
    [
        ({"Name": "triage"}, ECS_TASK_IP, "no network"),
        ({"Networks": [{"IPv4Addresses": []}]}, ECS_TASK_IP, "no IPv4 address"),
        ({"Networks": [{"IPv4Addresses": ["10.0.0.1"]}]}, ECS_TASK_DNS, "PrivateDNSName"),
        ({"Networks": [{"PrivateDNSName": ""}]}, ECS_TASK_DNS, "PrivateDNSName"),
    ],
)
def test_a_document_without_the_address_says_what_is_missing(
    metadata: Metadata, body: dict[str, Any], kind: str, says: str
) -> None:
    metadata.body = body
    with pytest.raises(ConfigError, match=says) as caught:
        task_address(kind, metadata.env, delay_s=0)
    assert caught.value.key == "server.advertised_host"
