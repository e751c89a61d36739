"""The gRPC channels of one Consumer: one per endpoint, shared by its streams and topology reads."""

from __future__ import annotations

import grpc

from triage_client.stream import INITIAL_BACKOFF_S, Consume
from triage_protocol import triage_pb2
from triage_protocol.constants import CLIENT_MAX_FRAME_BYTES

__all__ = ["Channels"]

_SERVICE = triage_pb2.DESCRIPTOR.services_by_name["Triage"]
_CONSUME = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['Consume'].name}"


class Channels:
    """Opens a channel to an endpoint when first asked, and closes them all at the end."""

    def __init__(self, credentials: grpc.ChannelCredentials | None, max_backoff: float) -> None:
        self.credentials = credentials
        """TLS credentials; None: plaintext."""
        self._max_backoff = max_backoff
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._consumes: dict[str, Consume] = {}

    def endpoints(self) -> list[str]:
        """The endpoints a channel is open to."""
        return list(self._channels)

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        """The one channel to `endpoint`."""
        channel = self._channels.get(endpoint)
        if channel is None:
            options = [
                ("grpc.max_receive_message_length", CLIENT_MAX_FRAME_BYTES),
                ("grpc.max_send_message_length", CLIENT_MAX_FRAME_BYTES),
                # gRPC's own reconnect backoff defaults to 1 s growing to 120 s; keep it in
                # step with ours so a restarted proxy is found again within max_backoff.
                ("grpc.initial_reconnect_backoff_ms", int(INITIAL_BACKOFF_S * 1000)),
                ("grpc.max_reconnect_backoff_ms", int(self._max_backoff * 1000)),
            ]
            if self.credentials is not None:
                channel = grpc.aio.secure_channel(endpoint, self.credentials, options)
            else:
                channel = grpc.aio.insecure_channel(endpoint, options)
            self._channels[endpoint] = channel
        return channel

    def consume(self, endpoint: str) -> Consume:
        """The Consume method on the channel to `endpoint`."""
        consume = self._consumes.get(endpoint)
        if consume is None:
            consume = self._consumes[endpoint] = self.channel(endpoint).stream_stream(
                _CONSUME,
                request_serializer=triage_pb2.ConsumerFrame.SerializeToString,
                response_deserializer=triage_pb2.ProxyFrame.FromString,
            )
        return consume

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
