"""Where a deployment's partitions are served now.

Any proxy of a deployment answers the Topology RPC; `Layout` is its answer, read once into
plain values. (How credits are split over the partition streams is in credits.py.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from triage_protocol import triage_pb2
from triage_protocol.constants import OWNER_ENDPOINT_METADATA

__all__ = ["TOPOLOGY", "Layout", "layout_from_reply", "owner_endpoint"]

_SERVICE = triage_pb2.DESCRIPTOR.services_by_name["Triage"]
TOPOLOGY = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['Topology'].name}"


@dataclass(frozen=True, slots=True)
class Layout:
    """One Topology answer."""

    topic: str
    """The deployment's topic."""
    partition_count: int
    """Partitions of the topic (0 .. partition_count - 1)."""
    endpoints: Mapping[int, str]
    """Partition -> the endpoint serving it now; partitions nobody serves now are absent."""
    complete: bool
    """False when the answering proxy could not read where ownership lives."""
    problem: str
    """Why the answer is incomplete, if it is."""


def layout_from_reply(reply: triage_pb2.TopologyReply) -> Layout:
    """A Topology reply as plain values: only SERVING routes with an endpoint count."""
    serving = triage_pb2.PartitionRoute.State.SERVING
    endpoints = {
        route.partition: route.endpoint
        for route in reply.partitions
        if route.state == serving and route.endpoint
    }
    return Layout(reply.topic, reply.partition_count, endpoints, reply.complete, reply.problem)


def owner_endpoint(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The `triage-owner-endpoint` a proxy named when it refused a Hello, if it named one."""
    for key, value in metadata or ():
        if key == OWNER_ENDPOINT_METADATA:
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            return text or None
    return None


async def fetch_layout(
    channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]], limit_s: float
) -> Layout:
    """Ask one proxy for the topology; raises grpc.aio.AioRpcError as the call failed."""
    call = channel.unary_unary(
        TOPOLOGY,
        request_serializer=triage_pb2.TopologyRequest.SerializeToString,
        response_deserializer=triage_pb2.TopologyReply.FromString,
    )
    reply = await call(triage_pb2.TopologyRequest(), metadata=tuple(metadata), timeout=limit_s)
    return layout_from_reply(reply)
