"""The Topology answer (which endpoint serves which partition now) from in-memory twins:
the advertised endpoint formula, the pure route policy, the cached reads, and the RPC and
the Hello partition check on a real localhost gRPC server over a proxy of twins."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import pytest

from triage_protocol import triage_pb2 as pb
from triage_protocol import triage_pb2_grpc as pb_grpc
from triage_protocol.constants import OWNER_ENDPOINT_METADATA
from triage_proxy.app import Proxy
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.sections import OwnershipSettings
from triage_proxy.config.settings import Settings
from triage_proxy.errors import BrokerUnavailable, ConfigError, PartitionNotServed
from triage_proxy.kafka.client import MemoryPartition
from triage_proxy.pipeline.ownership import Ownership, wall_ms
from triage_proxy.server.status import grpc_status, grpc_trailers
from triage_proxy.server.topology import (
    COUNT_RETRY_S,
    COUNT_TTL_S,
    LEASES_TTL_S,
    Route,
    RouteState,
    Topology,
    plan_routes,
)
from triage_proxy.store.checkpoints import MemoryCheckpoints
from triage_proxy.store.deadletter_store import MemoryStore
from triage_proxy.store.leases import Lease, MemoryLeaseReader, MemoryLeases, lease_from_item

TOKEN = "topology-unit-token-0123"
NOW_MS = 1_000_000_000
LEASE_MS = 10_000
SERVING, STANDBY_ONLY, NONE = RouteState.SERVING, RouteState.STANDBY_ONLY, RouteState.NONE


def make_settings(**sections: dict[str, Any]) -> Settings:
    raw: dict[str, dict[str, Any]] = {
        "kafka": {"bootstrap_servers": "127.0.0.1:1", "topic": "orders", "group_id": "g"},
        "auth": {"token": TOKEN},
        "dead_letters": {"table": "dlq", "flush_interval_ms": 1},
        "server": {"host": "127.0.0.1", "port": 0, "http_port": 0},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return settings_from_dict(raw, {})


# --- the advertised endpoint ------------------------------------------------------------


def test_the_advertised_endpoint_defaults_to_the_bound_address() -> None:
    server = make_settings(server={"port": 7700}).server
    assert server.advertised_endpoint(2) == "127.0.0.1:7702"
    assert server.advertised_endpoint(2, bound_port=7702) == "127.0.0.1:7702"
    ephemeral = make_settings().server  # port 0: known only once bound
    assert ephemeral.advertised_endpoint(1) is None
    assert ephemeral.advertised_endpoint(1, bound_port=41234) == "127.0.0.1:41234"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_a_wildcard_host_advertises_the_machine_name(host: str) -> None:
    server = make_settings(server={"host": host, "port": 7700}).server
    assert server.advertised_endpoint(0) == f"{socket.gethostname()}:7700"


def test_advertised_host_and_port_win_and_ipv6_is_bracketed() -> None:
    server = make_settings(
        server={"port": 0, "advertised_host": "nlb.example.com", "advertised_port": 9000}
    ).server
    assert server.advertised_endpoint(3, bound_port=41234) == "nlb.example.com:9003"
    v6 = make_settings(server={"host": "::1", "port": 7700}).server
    assert v6.advertised_endpoint(1) == "[::1]:7701"


def test_an_advertised_port_past_65535_or_out_of_range_is_a_config_error() -> None:
    server = make_settings(server={"advertised_port": 65535}).server
    assert server.advertised_endpoint(0) == "127.0.0.1:65535"
    with pytest.raises(ConfigError, match=r"server\.advertised_port"):
        server.advertised_endpoint(1)
    for bad in (0, 65536, True, "7700"):
        with pytest.raises(ConfigError, match=r"server\.advertised_port"):
            make_settings(server={"advertised_port": bad})


# --- the lease item carries the endpoint ------------------------------------------------


def test_acquire_and_renew_write_the_endpoint_and_an_old_item_reads_as_unknown() -> None:
    store = MemoryLeases()
    lease = store.acquire("a", 0, 1000, "h:7700")
    assert lease == Lease("a", 1000, "h:7700")
    assert store.renew("a", 1, 2000)  # no endpoint given: the one written stays
    assert store.lease == Lease("a", 2000, "h:7700")
    assert store.renew("a", 2, 3000, "h:7800")
    assert store.lease == Lease("a", 3000, "h:7800")
    old = {"owner": {"S": "old"}, "lease_until_ms": {"N": "5"}}  # before the attribute
    assert lease_from_item(old) == Lease("old", 5, "")
    assert lease_from_item({**old, "endpoint": {"S": "h:1"}}).endpoint == "h:1"


def test_ownership_advertises_its_endpoint_with_every_write() -> None:
    async def scenario() -> None:
        store = MemoryLeases()
        holder = Ownership(store, OwnershipSettings(lease_s=5), endpoint="")
        assert await holder.acquire(asyncio.Event())
        assert store.lease is not None
        assert store.lease.endpoint == ""  # not bound yet
        holder.endpoint = "127.0.0.1:41234"
        await holder.renew()
        assert store.lease.endpoint == "127.0.0.1:41234"

    asyncio.run(scenario())


# --- the route policy (pure) ------------------------------------------------------------


def routes(
    count: int,
    leases: dict[int, Lease] | None,
    *,
    ownership: bool = True,
    served: dict[int, str] | None = None,
    withdrawn: tuple[int, ...] = (),
    layout: Callable[[int], str | None] = lambda p: f"cfg:{7700 + p}",
) -> tuple[list[Route], list[str]]:
    return plan_routes(
        count,
        owner="me",
        served={0: "me:7700"} if served is None else served,
        withdrawn=withdrawn,
        ownership=ownership,
        leases=leases,
        layout=layout,
        now_ms=NOW_MS,
        lease_ms=LEASE_MS,
    )


def test_live_leases_with_an_endpoint_are_serving_and_the_own_partition_comes_from_itself() -> None:
    leases = {
        0: Lease("someone-else", NOW_MS + 5000, "stale:1"),  # the table lags our own state
        1: Lease("b", NOW_MS + 5000, "b:7701"),
        2: Lease("c", NOW_MS, "c:7702"),  # lapses exactly now: still live
    }
    got, problems = routes(3, leases)
    assert got == [
        Route(0, SERVING, "me:7700", "me"),
        Route(1, SERVING, "b:7701", "b"),
        Route(2, SERVING, "c:7702", "c"),
    ]
    assert problems == []


def test_lapsed_absent_and_endpointless_leases() -> None:
    leases = {
        1: Lease("dead", NOW_MS - 1, "d:7701"),  # just lapsed: a standby takes it now
        2: Lease("dead", NOW_MS - LEASE_MS, "d:7702"),  # at the end of the grace
        3: Lease("dead", NOW_MS - LEASE_MS - 1, "d:7703"),  # nobody took it: none waits
        5: Lease("old", NOW_MS + 5000),  # live, no endpoint: starting, or a version without
    }
    got, problems = routes(6, leases)
    assert [r.state for r in got] == [SERVING, STANDBY_ONLY, STANDBY_ONLY, NONE, NONE, STANDBY_ONLY]
    # Never an endpoint or an owner without SERVING.
    assert all(not r.endpoint and not r.owner for r in got if r.state is not SERVING)
    assert problems == [
        "partition 5: its holder advertises no endpoint (starting, or its version has none)"
    ]


def test_an_unreadable_table_leaves_every_other_partition_none() -> None:
    got, problems = routes(3, None)
    assert got == [Route(0, SERVING, "me:7700", "me"), Route(1, NONE), Route(2, NONE)]
    assert problems == []  # the caller says why (it knows the table failed)


def test_a_stopping_own_partition_is_standby_only_while_its_lease_is_ours() -> None:
    leases = {0: Lease("me", NOW_MS + 5000, "me:7700")}
    got, _ = routes(1, leases, served={}, withdrawn=(0,))
    assert got == [Route(0, STANDBY_ONLY)]
    leases = {0: Lease("successor", NOW_MS + 5000, "s:7700")}  # already taken over
    got, _ = routes(1, leases, served={}, withdrawn=(0,))
    assert got == [Route(0, SERVING, "s:7700", "successor")]


def test_without_ownership_the_configured_layout_answers() -> None:
    got, problems = routes(3, None, ownership=False)
    assert got == [
        Route(0, SERVING, "me:7700", "me"),
        Route(1, SERVING, "cfg:7701"),
        Route(2, SERVING, "cfg:7702"),
    ]
    assert problems == []
    got, problems = routes(2, None, ownership=False, layout=lambda p: None)  # port 0
    assert got == [Route(0, SERVING, "me:7700", "me"), Route(1, NONE)]
    assert problems == ["partition 1: endpoint unknown (server.port is 0)"]
    got, problems = routes(1, None, ownership=False, served={}, withdrawn=(0,))
    assert got == [Route(0, NONE)]  # stopping: the layout would name this very proxy
    assert problems == []


# --- the cached reads -------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CountSource:
    def __init__(self, count: int) -> None:
        self.count = count
        self.calls = 0
        self.failing = False

    async def __call__(self) -> int:
        self.calls += 1
        await asyncio.sleep(0.01)
        if self.failing:
            raise BrokerUnavailable("metadata: broker down (twin)")
        return self.count


def topology_of(
    settings: Settings, reader: MemoryLeaseReader | None, count: Callable[[], Awaitable[int]]
) -> tuple[Topology, Clock]:
    clock = Clock()
    topology = Topology(
        settings,
        "me",
        leases=reader,
        partition_count=count,
        wall_clock_ms=lambda: NOW_MS,
        monotonic=clock,
    )
    topology.serve(0, "me:7700")
    return topology, clock


def leases_of(*endpoints: str) -> MemoryLeaseReader:
    """Partition p + 1 held by "owner-<p+1>" at endpoints[p]."""
    stores: dict[int, MemoryLeases] = {}
    for i, endpoint in enumerate(endpoints, start=1):
        store = MemoryLeases()
        store.lease = Lease(f"owner-{i}", NOW_MS + 5000, endpoint)
        stores[i] = store
    return MemoryLeaseReader(stores)


def test_a_burst_of_calls_costs_one_read_of_each_source() -> None:
    reader = leases_of("b:7701", "c:7702")
    count = CountSource(3)
    topology, clock = topology_of(make_settings(), reader, count)

    async def scenario() -> None:
        answers = await asyncio.gather(*(topology.answer() for _ in range(50)))
        assert {a.routes for a in answers} == {answers[0].routes}
        assert (reader.calls, count.calls) == (1, 1)
        answer = answers[0]
        assert (answer.topic, answer.partition_count, answer.complete) == ("orders", 3, True)
        assert [r.endpoint for r in answer.routes] == ["me:7700", "b:7701", "c:7702"]
        assert [r.owner for r in answer.routes] == ["me", "owner-1", "owner-2"]
        clock.now += LEASES_TTL_S
        await topology.answer()
        assert (reader.calls, count.calls) == (2, 1)  # the count lives longer
        clock.now += COUNT_TTL_S
        await topology.answer()
        assert (reader.calls, count.calls) == (3, 2)

    asyncio.run(scenario())


def test_a_table_outage_answers_the_own_partition_and_says_it_is_incomplete() -> None:
    reader = leases_of("b:7701")
    topology, clock = topology_of(make_settings(), reader, CountSource(2))

    async def scenario() -> None:
        reader.down = True
        answer = await topology.answer()
        assert not answer.complete
        assert "lease table could not be read" in answer.problem
        assert answer.routes == (Route(0, SERVING, "me:7700", "me"), Route(1, NONE))
        clock.now += LEASES_TTL_S / 2
        await topology.answer()
        assert reader.calls == 1  # the failure is cached too: a burst costs one attempt
        reader.down = False
        clock.now += LEASES_TTL_S
        answer = await topology.answer()
        assert answer.complete
        assert answer.routes[1] == Route(1, SERVING, "b:7701", "owner-1")

    asyncio.run(scenario())


def test_a_slow_failing_read_is_not_repeated_by_each_caller_queued_behind_it() -> None:
    clock = Clock()

    class SlowDownReader(MemoryLeaseReader):
        def get_many(self, partitions: Sequence[int]) -> dict[int, Lease]:
            clock.now += 2 * LEASES_TTL_S  # a read that times out after a while
            return super().get_many(partitions)

    reader = SlowDownReader()
    reader.down = True
    topology = Topology(
        make_settings(kafka={"partitions": 2}), "me", leases=reader, monotonic=clock
    )
    topology.serve(0, "me:7700")

    async def scenario() -> None:
        answers = await asyncio.gather(*(topology.answer() for _ in range(10)))
        assert reader.calls == 1
        assert not any(a.complete for a in answers)

    asyncio.run(scenario())


def test_the_partition_count_comes_from_the_config_else_the_broker_else_the_last_known() -> None:
    count = CountSource(4)
    configured, _ = topology_of(make_settings(kafka={"partitions": 2}), leases_of(), count)
    asked, clock = topology_of(make_settings(), leases_of(), count)

    async def scenario() -> None:
        assert (await configured.answer()).partition_count == 2
        assert count.calls == 0
        assert (await asked.answer()).partition_count == 4
        count.failing = True
        clock.now += COUNT_TTL_S
        answer = await asked.answer()
        assert answer.partition_count == 4  # the last count read
        assert not answer.complete
        assert "partition count" in answer.problem
        fresh, _ = topology_of(make_settings(), leases_of(), count)
        answer = await fresh.answer()
        assert answer.partition_count == 1  # never read: at least what this proxy serves
        assert answer.routes == (Route(0, SERVING, "me:7700", "me"),)

    asyncio.run(scenario())


def test_a_failed_count_read_is_tried_again_soon_and_a_good_one_lasts() -> None:
    # At start a proxy's port opens before its partition does, so the first count read
    # fails ("no partition is open yet"); holding that for COUNT_TTL_S left the answer
    # incomplete for up to 5 s after the proxy served.
    count = CountSource(3)
    topology, clock = topology_of(make_settings(), leases_of("b:7701", "c:7702"), count)

    async def scenario() -> None:
        count.failing = True
        assert not (await topology.answer()).complete
        clock.now += COUNT_RETRY_S / 2
        await topology.answer()
        assert count.calls == 1  # a burst still costs one attempt
        count.failing = False
        clock.now += COUNT_RETRY_S / 2
        answer = await topology.answer()
        assert count.calls == 2
        assert (answer.partition_count, answer.complete) == (3, True)
        clock.now += COUNT_TTL_S - 0.01
        await topology.answer()
        assert count.calls == 2  # a count read lasts COUNT_TTL_S

    asyncio.run(scenario())


def test_a_withdrawn_partition_is_no_longer_served_here() -> None:
    topology, _ = topology_of(make_settings(ownership={"enabled": False}), None, CountSource(1))
    assert topology.served == {0: "me:7700"}
    topology.withdraw(0)
    topology.withdraw(0)  # twice is fine
    assert topology.served == {}
    answer = asyncio.run(topology.answer())
    assert answer.routes == (Route(0, NONE),)


def test_a_hello_for_another_partition_maps_to_failed_precondition_with_the_owner() -> None:
    exc = PartitionNotServed("partition 1 of orders is not served here", 1, "b:7701")
    assert grpc_status(exc) is grpc.StatusCode.FAILED_PRECONDITION
    assert grpc_trailers(exc) == ((OWNER_ENDPOINT_METADATA, "b:7701"),)
    assert grpc_trailers(PartitionNotServed("unknown owner", 1)) == ()
    assert grpc_trailers(BrokerUnavailable("x")) == ()


# --- the RPC and the Hello check, on a real localhost server over twins -----------------


def proxy_of_twins(
    settings: Settings, other_partitions: dict[int, Lease]
) -> tuple[Proxy, MemoryLeaseReader, MemoryPartition]:
    log = MemoryPartition("orders", 0)
    log.partitions = 1 + max(other_partitions, default=0)
    own = MemoryLeases()
    stores: dict[int, MemoryLeases] = {0: own}
    for p, lease in other_partitions.items():
        stores[p] = MemoryLeases()
        stores[p].lease = lease
    reader = MemoryLeaseReader(stores)
    proxy = Proxy(
        settings,
        0,
        log=log,
        store=MemoryStore(),
        checkpoints=MemoryCheckpoints(),
        leases=own,
        lease_reader=reader,
    )
    return proxy, reader, log


async def topology_call(target: str, token: str | None = TOKEN) -> pb.TopologyReply:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.TriageStub(channel)
        metadata = [("authorization", f"Bearer {token}")] if token else []
        reply: pb.TopologyReply = await stub.Topology(pb.TopologyRequest(), metadata=metadata)
        return reply


async def hello(target: str, partition: int | None) -> tuple[Any, Any]:
    """Open a stream with one Hello; return (first frame or the error, the call)."""
    channel = grpc.aio.insecure_channel(target)
    stub = pb_grpc.TriageStub(channel)
    call = stub.Consume(metadata=[("authorization", f"Bearer {TOKEN}")])
    frame = pb.Hello(consumer_id="unit", credits=5)
    if partition is not None:
        frame.partition = partition
    try:
        await call.write(pb.ConsumerFrame(hello=frame))
        return await call.read(), call
    except grpc.aio.AioRpcError as exc:
        return exc, call
    finally:
        call.cancel()
        await channel.close()


def test_topology_hello_and_auth_over_grpc() -> None:
    live = Lease("owner-b", wall_ms() + 60_000, "127.0.0.1:7801")
    proxy, reader, _ = proxy_of_twins(make_settings(), {1: live})

    async def scenario() -> None:
        await proxy.start()
        try:
            here = f"127.0.0.1:{proxy.port}"
            assert proxy.endpoint == here
            assert proxy.snapshot().to_json()["advertised_endpoint"] == here
            reply = await topology_call(here)
            assert (reply.topic, reply.partition_count, reply.complete) == ("orders", 2, True)
            assert [(r.partition, r.endpoint, r.state, r.owner_id) for r in reply.partitions] == [
                (0, here, pb.PartitionRoute.SERVING, proxy.owner),
                (1, "127.0.0.1:7801", pb.PartitionRoute.SERVING, "owner-b"),
            ]
            # The own lease item advertises the port bound (0 in the config: picked then).
            own = reader.stores[0].get()
            assert own is not None
            assert (own.owner, own.endpoint) == (proxy.owner, here)

            for token in (None, "wrong-token-0123456789"):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await topology_call(here, token)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
                assert "7801" not in (refused.value.details() or "")

            # An old-style Hello (no partition) and one naming partition 0 are welcome.
            for partition in (None, 0):
                frame, _ = await hello(here, partition)
                assert frame.welcome.partition == 0, partition

            frame, call = await hello(here, 1)
            assert isinstance(frame, grpc.aio.AioRpcError)
            assert frame.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "partition 1 of orders" in (frame.details() or "")
            trailers = dict(await call.trailing_metadata() or ())
            assert trailers[OWNER_ENDPOINT_METADATA] == "127.0.0.1:7801"

            frame, call = await hello(here, 5)  # the topic has 2
            assert frame.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "does not exist" in (frame.details() or "")
            assert OWNER_ENDPOINT_METADATA not in dict(await call.trailing_metadata() or ())

            frame, _ = await hello(here, -1)
            assert frame.code() is grpc.StatusCode.INVALID_ARGUMENT

            reader.down = True  # the table: unreadable from now on
            await asyncio.sleep(LEASES_TTL_S)
            reply = await topology_call(here)
            assert not reply.complete
            assert reply.problem
            assert [(r.endpoint, r.state) for r in reply.partitions] == [
                (here, pb.PartitionRoute.SERVING),
                ("", pb.PartitionRoute.NONE),
            ]
            frame, call = await hello(here, 1)  # the owner is not known now: no trailer
            assert frame.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert OWNER_ENDPOINT_METADATA not in dict(await call.trailing_metadata() or ())
        finally:
            proxy.stop()
            await proxy.wait_stopped()

    asyncio.run(asyncio.wait_for(scenario(), 30))
