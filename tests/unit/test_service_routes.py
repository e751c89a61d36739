"""Routing a Hello while a partition starts: a pinned process listens once its leases
are held, so a Hello can arrive before the partition's pipeline serves. It waits for the
partition (bounded) instead of being refused; one for a partition that withdraws instead
is refused at once."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from tests.unit import virtual_time
from triage_protocol import triage_pb2 as pb
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.settings import Settings
from triage_proxy.errors import FrameError, PartitionNotServed
from triage_proxy.pipeline.dispatch import Dispatcher
from triage_proxy.server.service import TriageService
from triage_proxy.server.topology import Topology


def make_settings() -> Settings:
    return settings_from_dict(
        {
            "kafka": {
                "bootstrap_servers": "127.0.0.1:1",
                "topic": "orders",
                "group_id": "g",
                "partitions": 2,
            },
            "auth": {"token": "routes-unit-token-0123456"},
            "dead_letters": {"table": "dlq"},
            "server": {"host": "127.0.0.1", "port": 0, "http_port": 0},
            "ownership": {"enabled": False},
        },
        {},
    )


def service() -> TriageService:
    settings = make_settings()
    return TriageService(settings, {}, Topology(settings, "me"))


DISPATCHER = cast(Dispatcher, object())


def route(svc: TriageService, **hello: Any) -> asyncio.Task[int]:
    return asyncio.ensure_future(svc._partition_for(pb.Hello(credits=1, **hello)))


def test_a_hello_for_a_starting_partition_waits_until_it_serves() -> None:
    async def run() -> None:
        svc = service()
        svc.expect_partition(1)
        named, unnamed = route(svc, partition=1), route(svc)
        await asyncio.sleep(0.05)
        assert not named.done()  # waiting, not refused
        assert not unnamed.done()
        svc.serve_partition(1, DISPATCHER)
        assert await asyncio.wait_for(named, 5) == 1
        assert await asyncio.wait_for(unnamed, 5) == 1  # an old client's Hello

    virtual_time.run(run())  # the 0.05 s pass at once, exactly


def test_a_hello_for_a_partition_that_withdraws_instead_is_refused() -> None:
    async def run() -> None:
        svc = service()
        svc.expect_partition(0)
        named, unnamed = route(svc, partition=0), route(svc)
        await asyncio.sleep(0.05)
        svc.withdraw_partition(0)
        with pytest.raises(PartitionNotServed):
            await asyncio.wait_for(named, 5)
        with pytest.raises(FrameError):
            await asyncio.wait_for(unnamed, 5)

    virtual_time.run(run())  # the 0.05 s pass at once, exactly


def test_a_hello_for_a_partition_not_starting_here_does_not_wait() -> None:
    async def run() -> None:
        svc = service()
        svc.expect_partition(0)
        with pytest.raises(PartitionNotServed):
            await asyncio.wait_for(route(svc, partition=1), 1)

    asyncio.run(run())
