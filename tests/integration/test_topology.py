"""Topology and the Hello partition against real parts: proxies on two partitions of a
Tansu topic, their leases in moto's DynamoDB; a holder killed with kill -9 and its
standby's endpoint showing up; the table frozen."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.integration.harness import (
    TOKEN,
    RawConsumer,
    create_topic,
    kill_processes,
    settings_for,
    start_proxy_process,
    target,
)
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, wait_for_port
from triage_protocol import triage_pb2 as pb
from triage_protocol import triage_pb2_grpc as pb_grpc
from triage_protocol.constants import OWNER_ENDPOINT_METADATA
from triage_proxy.app import Proxy
from triage_proxy.store.leases import DynamoDBLeaseReader, DynamoDBLeases, Lease

pytestmark = pytest.mark.integration

SERVING = pb.PartitionRoute.SERVING
NONE = pb.PartitionRoute.NONE


async def topology(endpoint: str, token: str | None = TOKEN) -> pb.TopologyReply:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = pb_grpc.TriageStub(channel)
        metadata = [("authorization", f"Bearer {token}")] if token else []
        reply: pb.TopologyReply = await stub.Topology(
            pb.TopologyRequest(), metadata=metadata, timeout=10
        )
        return reply


def routes(reply: pb.TopologyReply) -> list[tuple[int, str, int]]:
    return [(r.partition, r.endpoint, r.state) for r in reply.partitions]


async def refused_hello(
    endpoint: str, partition: int
) -> tuple[grpc.aio.AioRpcError, dict[str, Any]]:
    """Open a stream whose Hello names `partition`; return the refusal and its trailers."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = pb_grpc.TriageStub(channel)
        call = stub.Consume(metadata=[("authorization", f"Bearer {TOKEN}")])
        hello = pb.Hello(consumer_id="lost", credits=5, partition=partition)
        await call.write(pb.ConsumerFrame(hello=hello))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        return refused.value, dict(await call.trailing_metadata() or ())


def test_either_proxy_lists_both_partitions_and_sends_a_stray_hello_to_the_owner(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    create_topic(broker.bootstrap, unique_name, partitions=2)
    settings = settings_for(broker, aws, unique_name)  # ownership on, ports picked at bind
    assert settings.ownership.enabled
    assert settings.kafka.partitions is None  # the count comes from the broker

    async def scenario() -> None:
        async with Proxy(settings, 0) as p0, Proxy(settings, 1) as p1:
            endpoints = [target(p0), target(p1)]
            assert [p0.endpoint, p1.endpoint] == endpoints
            for asked in endpoints:
                reply = await topology(asked)
                assert (reply.topic, reply.partition_count) == (unique_name, 2)
                assert reply.complete, reply.problem
                assert routes(reply) == [(0, endpoints[0], SERVING), (1, endpoints[1], SERVING)]
                assert [r.owner_id for r in reply.partitions] == [p0.owner, p1.owner]

            # Where Topology reads it: the lease items carry the port picked at bind.
            for p, proxy in enumerate((p0, p1)):
                store = DynamoDBLeases(
                    settings.dead_letters, unique_name, p, settings.kafka.group_id
                )
                try:
                    lease = await asyncio.to_thread(store.get)
                finally:
                    store.close()
                assert lease is not None
                assert (lease.owner, lease.endpoint) == (proxy.owner, endpoints[p])

            # A Hello for the partition the other proxy serves: refused, with its endpoint.
            refused, trailers = await refused_hello(endpoints[0], 1)
            assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "partition 1" in (refused.details() or "")
            assert trailers[OWNER_ENDPOINT_METADATA] == endpoints[1]

            # An old-style Hello (no partition: RawConsumer sends none) gets the proxy's one.
            for p, asked in enumerate(endpoints):
                async with RawConsumer(asked) as old:
                    await old.read()
                    assert old.welcome is not None
                    assert (old.welcome.topic, old.welcome.partition) == (unique_name, p)

            # A wrong or missing token: UNAUTHENTICATED, and nothing of the topology.
            for token in (None, "not-the-token-0123456789"):
                with pytest.raises(grpc.aio.AioRpcError) as denied:
                    await topology(endpoints[0], token)
                assert denied.value.code() is grpc.StatusCode.UNAUTHENTICATED
                details = denied.value.details() or ""
                assert unique_name not in details
                assert str(p1.port) not in details

    asyncio.run(scenario())


# --- failover: a standby's endpoint shows up after the holder's kill -9 -----------------

LEASE_S = 3.0


def test_the_standby_endpoint_shows_up_within_two_leases_of_the_holders_kill_9(
    tmp_path: Path, broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    create_topic(broker.bootstrap, unique_name, partitions=2)
    settings = settings_for(broker, aws, unique_name)  # creates the table
    base: dict[str, dict[str, Any]] = {
        "kafka": {
            "bootstrap_servers": broker.bootstrap,
            "topic": unique_name,
            "group_id": settings.kafka.group_id,
        },
        "auth": {"token": TOKEN},
        "dead_letters": {"table": settings.dead_letters.table, "endpoint_url": aws.endpoint_url},
        "ownership": {"lease_s": LEASE_S},
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["a"], holder = start_proxy_process(tmp_path, "a", base, 0)
        wait_for_port("127.0.0.1", int(holder.rsplit(":", 1)[1]), 30, procs["a"])
        procs["b"], standby = start_proxy_process(tmp_path, "b", base, 0)
        procs["c"], other = start_proxy_process(tmp_path, "c", base, 1)
        wait_for_port("127.0.0.1", int(other.rsplit(":", 1)[1]), 30, procs["c"])

        async def scenario() -> float:
            expected = [(0, holder, SERVING), (1, other, SERVING)]
            for asked in (holder, other):
                # A proxy's port opens before its partition does, and an answer asked in
                # between is incomplete ("no partition is open yet", asked again after
                # COUNT_RETRY_S): wait for both to serve (the claim under test is the
                # failover's time).
                deadline = time.monotonic() + 30
                while True:
                    reply = await topology(asked)
                    if reply.complete and routes(reply) == expected:
                        break
                    assert time.monotonic() < deadline, (reply.problem, routes(reply))
                    await asyncio.sleep(0.1)
            os.kill(procs["a"].pid, signal.SIGKILL)
            killed = time.monotonic()
            while True:
                reply = await topology(other)
                if routes(reply)[0] == (0, standby, SERVING):
                    return time.monotonic() - killed
                assert routes(reply)[0][1] in (holder, ""), routes(reply)
                assert time.monotonic() - killed < 4 * LEASE_S, routes(reply)
                await asyncio.sleep(0.05)

        took = asyncio.run(scenario())
        assert procs["a"].wait(10) == -signal.SIGKILL
        assert took < 2 * LEASE_S, f"the standby's endpoint showed up after {took:.2f}s"
        # The new holder answers too, and serves what it advertises.
        wait_for_port("127.0.0.1", int(standby.rsplit(":", 1)[1]), 30, procs["b"])

        expected = [(0, standby, SERVING), (1, other, SERVING)]

        async def standby_answers() -> list[tuple[int, str, int]]:
            # Its answer is incomplete until its partition has opened (as above), and
            # until then its own partition may read STANDBY_ONLY from a lease item cached
            # before it wrote its endpoint ("try again soon"): ask until it serves.
            deadline = time.monotonic() + 30
            while True:
                reply = await topology(standby)
                got = routes(reply)
                if (reply.complete and got == expected) or time.monotonic() > deadline:
                    return got
                await asyncio.sleep(0.1)

        assert asyncio.run(standby_answers()) == expected
    finally:
        kill_processes(procs.values())


# --- an unreadable table ----------------------------------------------------------------


def test_a_table_that_does_not_answer_gives_what_the_proxy_knows_and_complete_false(
    broker: EmbeddedBroker, unique_name: str
) -> None:
    create_topic(broker.bootstrap, unique_name, partitions=2)
    # A private moto server, frozen without disturbing other tests; a lease long enough
    # to outlive the freeze.
    with EmbeddedAWS() as aws:
        settings = settings_for(broker, aws, unique_name, ownership={"lease_s": 60.0})

        # Partition 1 is held by a proxy elsewhere (its lease item, written here).
        elsewhere = DynamoDBLeases(settings.dead_letters, unique_name, 1, settings.kafka.group_id)
        try:
            now_ms = time.time_ns() // 1_000_000
            elsewhere.acquire("elsewhere", now_ms, now_ms + 60_000, "192.0.2.1:7701")
        finally:
            elsewhere.close()

        async def scenario() -> None:
            async with Proxy(settings, 0) as proxy:
                here = target(proxy)
                reply = await topology(here)
                assert reply.complete, reply.problem
                assert routes(reply) == [(0, here, SERVING), (1, "192.0.2.1:7701", SERVING)]
                await asyncio.sleep(1.0)  # past the cache
                os.kill(aws.pid, signal.SIGSTOP)
                try:
                    reply = await topology(here)
                    # A Hello for partition 1 meanwhile (the failed read is what is known
                    # for a second): refused, and no owner named rather than a stale one.
                    # Still frozen, so that a Hello that comes after that second (a loop
                    # descheduled on a loaded machine) meets a failed read too, not a
                    # fresh good one.
                    refused, trailers = await refused_hello(here, 1)
                finally:
                    os.kill(aws.pid, signal.SIGCONT)
                assert not reply.complete
                assert "lease table" in reply.problem
                assert routes(reply) == [(0, here, SERVING), (1, "", NONE)]
                assert reply.partitions[0].owner_id == proxy.owner

                assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION
                assert OWNER_ENDPOINT_METADATA not in trailers

                # The table answers again: so does the topology, whole.
                await asyncio.sleep(1.0)
                reply = await topology(here)
                assert reply.complete, reply.problem
                assert routes(reply)[1] == (1, "192.0.2.1:7701", SERVING)

        asyncio.run(scenario())


def test_the_lease_reader_reads_past_100_partitions_and_old_items_as_unknown(
    broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    """BatchGetItem takes 100 keys: 130 partitions take two calls; an item written the way
    proxies before `endpoint` wrote it reads with an unknown ("") endpoint."""
    settings = settings_for(broker, aws, unique_name)  # creates the table
    held = {p: f"10.0.0.{p % 250}:{7700 + p}" for p in range(130) if p % 3}
    for p, endpoint in held.items():
        store = DynamoDBLeases(settings.dead_letters, unique_name, p, settings.kafka.group_id)
        try:
            store.acquire(f"owner-{p}", 0, 10**13, "" if p == 1 else endpoint)
        finally:
            store.close()
    reader = DynamoDBLeaseReader(settings.dead_letters, unique_name, settings.kafka.group_id)
    try:
        found = reader.get_many(range(130))
    finally:
        reader.close()
    assert sorted(found) == sorted(held)
    assert found[1] == Lease("owner-1", 10**13, "")  # no endpoint attribute at all
    assert all(found[p] == Lease(f"owner-{p}", 10**13, held[p]) for p in held if p != 1)
