"""Helpers for end-to-end tests: topics, tables, settings, a raw gRPC consumer.

The raw consumer speaks the wire protocol directly so tests can do what a
well-behaved client never would: ack out of order, forge settlements, vanish
mid-batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import boto3
import grpc
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka import Message as KafkaMessage
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic  # confluent_kafka.admin does not re-export it

from tests.samples import GROUP
from triage_cli.devstack import write_config
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port
from triage_client.message import unpack_messages
from triage_protocol import triage_pb2 as pb
from triage_protocol import triage_pb2_grpc as pb_grpc
from triage_proxy.app import Proxy
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.config.settings import Settings
from triage_proxy.deadletters.writer import DeadLetterWriter
from triage_proxy.kafka.client import PartitionLog
from triage_proxy.kafka.logs import KafkaLog
from triage_proxy.store.deadletter_store import DynamoDBStore
from triage_proxy.store.items import dead_letter_from_item
from triage_proxy.store.provisioning import KEY_ATTRIBUTES, KEY_SCHEMA_SPEC, create_table
from triage_proxy.structs import DeadLetter, Record

TOKEN = "test-token-0123456789"
LEASE_S = 5.0
Message = tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]] | None]


def write_dead_letters(
    settings: DeadLetterSettings, dls: list[DeadLetter], group: str = GROUP
) -> None:
    """Write `dls` to the table through the real writer, as a proxy of `group` does."""

    async def main() -> None:
        with DynamoDBStore(settings, group=group) as store:
            async with DeadLetterWriter(store, settings, lambda dl: None) as writer:
                for dl in dls:
                    writer.submit(dl)
                assert await writer.flush(30)
                assert writer.too_large == 0

    asyncio.run(asyncio.wait_for(main(), 60))


def dynamodb(aws: EmbeddedAWS) -> Any:
    """A DynamoDB client of the embedded AWS endpoint (the caller closes it, or not)."""
    return boto3.session.Session().client(
        "dynamodb",
        region_name="us-east-1",
        endpoint_url=aws.endpoint_url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def create_unindexed_table(client: Any, name: str) -> None:
    """The dead-letter table as `create_table` made it before the `by-state` index: keys
    only (what `triage dlq migrate` and the scan read mode are for)."""
    client.create_table(
        TableName=name,
        KeySchema=KEY_SCHEMA_SPEC,
        AttributeDefinitions=KEY_ATTRIBUTES,
        BillingMode="PAY_PER_REQUEST",
    )


def headers_of(msg: KafkaMessage) -> list[tuple[str, bytes | None]]:
    """A consumed message's headers ([] for none). librdkafka hands them as a list of
    (name, bytes or None); the stub's type also allows a dict and str values (a produce)."""
    headers = msg.headers() or []
    assert isinstance(headers, list), headers
    out: list[tuple[str, bytes | None]] = []
    for name, value in headers:
        assert value is None or isinstance(value, bytes), (name, value)
        out.append((name, value))
    return out


def create_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap, **KafkaLog().config()})
    for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        future.result(timeout=30)


def produce(bootstrap: str, topic: str, messages: Iterable[Message], partition: int = 0) -> int:
    """Produce (key, value, headers) tuples to one partition; return how many."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 2, **KafkaLog().config()})
    n = 0
    for key, value, headers in messages:
        # a copy typed as the stub's list (invariant) of str or bytes values; ours are bytes
        wire: list[tuple[str, str | bytes | None]] | None = None if headers is None else [*headers]
        producer.produce(topic, value=value, key=key, headers=wire, partition=partition)
        n += 1
    assert producer.flush(30) == 0
    return n


def committed(bootstrap: str, group: str, topic: str, partition: int = 0) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, **KafkaLog().config()})
    try:
        return int(consumer.committed([TopicPartition(topic, partition)], 10)[0].offset)
    finally:
        consumer.close()


def take(log: PartitionLog, n: int, step: int, timeout_s: float = 60.0) -> list[Record]:
    """Fetch from `log`, `step` at a time, until `n` records arrived (a bounded wait)."""
    out: list[Record] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        assert time.monotonic() < deadline, f"only {len(out)} of {n} records arrived"
        out.extend(log.fetch(step))
    return out


def make_settings(
    bootstrap: str, endpoint: str, topic: str, table: str, **sections: Any
) -> Settings:
    raw: dict[str, Any] = {
        "kafka": {"bootstrap_servers": bootstrap, "topic": topic, "group_id": f"g-{topic}"},
        "server": {"host": "127.0.0.1", "port": 0, "http_port": 0},
        "auth": {"token": TOKEN},
        "dead_letters": {"table": table, "endpoint_url": endpoint, "flush_interval_ms": 5},
        "commit": {"interval_s": 0.1},
        "shutdown": {"drain_timeout_s": 5},
        # Short enough that a restart after a kill waits little for the lease to lapse,
        # long enough to ride out the 1.5 s DynamoDB freezes some tests make.
        "ownership": {"lease_s": LEASE_S},
    }
    for name, values in sections.items():
        if isinstance(values, list):  # an array of tables ([[push]])
            raw[name] = values
        else:
            raw.setdefault(name, {}).update(values)
    settings = settings_from_dict(raw, {})
    create_table(settings.dead_letters)
    return settings


def dead_letters(settings: Settings) -> list[DeadLetter]:
    client = boto3.client(
        "dynamodb",
        endpoint_url=settings.dead_letters.endpoint_url,
        region_name=settings.dead_letters.region,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    try:
        items: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {"TableName": settings.dead_letters.table}
        while True:
            page = client.scan(**kwargs)
            items.extend(page["Items"])
            if "LastEvaluatedKey" not in page:
                break
            kwargs["ExclusiveStartKey"] = page["LastEvaluatedKey"]
        letters = (dead_letter_from_item(i) for i in items if int(i["offset"]["N"]) >= 0)
        return sorted(letters, key=lambda d: d.record.offset)
    finally:
        client.close()


def wait_until(predicate: Any, timeout: float = 15.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


async def await_until(predicate: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.02)


PROBE_OFFSET = 10**9
"""An offset no test holds: `RawConsumer.sync` settles it to learn the proxy has read up to it."""


class RawConsumer:
    """One Consume stream driven by hand."""

    def __init__(
        self,
        target: str,
        token: str | None = TOKEN,
        credits: int = 100,
        credentials: grpc.ChannelCredentials | None = None,
        max_frame_bytes: int = 0,
        hello: bool = True,
        packed: bool = False,
        isolation: bool = False,
    ) -> None:
        self.target = target
        self.hello = hello
        self.packed = packed
        self.isolation = isolation
        """Hello.isolation (a newer client): suspects come flagged, see `isolated`."""
        self.isolated: list[int] = []
        """Offsets the proxy flagged isolated (Deliveries.isolated), in arrival order."""
        self.started: list[int] = []
        """Offsets the proxy answered Started for."""
        """Hello.packed_deliveries (a newer client); packed deliveries are read into
        `deliveries` as Delivery messages, and counted in `packed_received`."""
        self.packed_received = 0
        """False: open the stream and send nothing. A refusal test wants this: the proxy
        refuses from the metadata alone, and a Hello write racing that refusal can end the
        call INTERNAL ("Failed execute_batch") on the client's side instead of with the
        proxy's status."""
        self.max_frame_bytes = max_frame_bytes
        """Hello.max_frame_bytes (0: not sent, as by an older client) and, when set, the
        channel's receive limit."""
        self.credentials = credentials
        """TLS channel credentials; None: plaintext."""
        self.token = token
        self.credits = credits
        self.consumer_id = f"raw-{id(self)}"
        self._outgoing: asyncio.Queue[pb.ConsumerFrame | None] = asyncio.Queue()
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall[pb.ConsumerFrame, pb.ProxyFrame] | None = None
        self._reading: asyncio.Future[pb.ProxyFrame] | None = None
        """The call's read in flight, kept when a caller stops waiting for it (`read`)."""
        self.deliveries: list[pb.Delivery] = []
        self.rejected: list[int] = []
        self.welcome: pb.Welcome | None = None

    async def __aenter__(self) -> RawConsumer:
        options = []
        if self.max_frame_bytes:
            options.append(("grpc.max_receive_message_length", self.max_frame_bytes))
        if self.credentials is None:
            self._channel = grpc.aio.insecure_channel(self.target, options)
        else:
            self._channel = grpc.aio.secure_channel(self.target, self.credentials, options)
        stub = pb_grpc.TriageStub(self._channel)
        metadata = [("authorization", f"Bearer {self.token}")] if self.token else []
        if self.hello:
            self._outgoing.put_nowait(
                pb.ConsumerFrame(
                    hello=pb.Hello(
                        consumer_id=self.consumer_id,
                        credits=self.credits,
                        max_frame_bytes=self.max_frame_bytes,
                        packed_deliveries=self.packed,
                        isolation=self.isolation,
                    )
                )
            )
        self._call = stub.Consume(self._frames(), metadata=metadata)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _frames(self) -> Any:
        while True:
            frame = await self._outgoing.get()
            if frame is None:
                return
            yield frame

    async def read(self) -> pb.ProxyFrame:
        """The next frame. A caller that stops waiting (a timeout, a cancel) leaves the
        call's read running for the next `read`: cancelling the read itself would cancel
        the whole call (grpc.aio), and a receive with a short timeout in a loop then
        ended the stream the first time no frame came in time."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read_frame())
        reading = self._reading
        try:
            return await asyncio.shield(reading)
        finally:
            if reading.done():
                self._reading = None

    async def _read_frame(self) -> pb.ProxyFrame:
        assert self._call is not None, "read before __aenter__ or after close"
        frame = await self._call.read()
        if frame is grpc.aio.EOF:
            raise EOFError
        assert isinstance(frame, pb.ProxyFrame), frame  # the stub types EOF as object
        kind = frame.WhichOneof("frame")
        if kind == "welcome":
            self.welcome = frame.welcome
        elif kind == "deliveries":
            batch = frame.deliveries
            if batch.HasField("packed"):
                unpacked = unpack_messages(batch.topic, batch.partition, batch.packed)
                self.packed_received += len(unpacked)
                self.deliveries.extend(
                    pb.Delivery(
                        offset=m.offset,
                        key=m.key,
                        value=m.value,
                        timestamp_ms=m.timestamp,
                        attempt=m.attempt,
                    )
                    for m in unpacked
                )
            self.deliveries.extend(batch.deliveries)
            self.isolated.extend(batch.isolated)
        elif kind == "started":
            self.started.extend(frame.started.offsets)
        elif kind == "rejected":
            self.rejected.extend(frame.rejected.offsets)
        return frame

    async def receive(self, count: int, timeout: float = 15.0) -> list[pb.Delivery]:
        """Read until `count` more deliveries arrived; return them."""
        before = len(self.deliveries)
        async with asyncio.timeout(timeout):
            while len(self.deliveries) < before + count:
                await self.read()
        return self.deliveries[before:]

    def settle(
        self,
        acks: Sequence[int] = (),
        nacks: Sequence[tuple[int, str]] = (),
        ranges: Sequence[tuple[int, int]] = (),
    ) -> None:
        """A Settle frame; `ranges` (first, last) go as Settle.ack_ranges (a newer client)."""
        frame = pb.ConsumerFrame(
            settle=pb.Settle(
                acks=list(acks),
                nacks=[pb.Nack(offset=o, reason=r) for o, r in nacks],
                ack_ranges=[pb.OffsetRange(first=f, last=la) for f, la in ranges],
            )
        )
        self._outgoing.put_nowait(frame)

    async def sync(self, timeout: float = 15.0) -> None:
        """Until the proxy has read every frame written so far: a Settle of an offset never
        held is answered Rejected on this stream, after what the frames before it caused
        (the dispatcher hands out deliveries before the answer is queued). It counts as one
        rejected settlement."""
        self.settle(acks=[PROBE_OFFSET])
        async with asyncio.timeout(timeout):
            seen = self.rejected.count(PROBE_OFFSET)
            while self.rejected.count(PROBE_OFFSET) == seen:
                await self.read()

    def start(self, offset: int) -> None:
        """A Started frame for an isolated delivery (the proxy answers with one)."""
        self._outgoing.put_nowait(pb.ConsumerFrame(started=pb.Started(offsets=[offset])))

    async def close(self) -> None:
        """Vanish: cancel the call without settling anything."""
        reading, self._reading = self._reading, None
        if reading is not None:
            if reading.done() and not reading.cancelled():
                reading.exception()  # retrieved: the call ends here either way
            reading.cancel()
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def settings_for(broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str, **sections: Any) -> Settings:
    """Settings for a proxy of `topic` on the given broker and AWS endpoint (table created)."""
    return make_settings(broker.bootstrap, aws.endpoint_url, topic, f"dlq-{topic}", **sections)


def target(proxy: Proxy) -> str:
    return f"127.0.0.1:{proxy.port}"


def start_proxy_process(
    tmp_path: Path, name: str, base: dict[str, Any], partition: int
) -> tuple[subprocess.Popen[bytes], str]:
    """`triage proxy` for `partition` on its own fixed port; returns (process, endpoint).
    `base`: the config's sections, tables or arrays of tables ([[push]]), but `server`."""
    port = free_port()
    config = tmp_path / f"{name}.toml"
    server = {"host": "127.0.0.1", "port": port - partition, "http_port": free_port() - partition}
    write_config(config, {**base, "server": server})
    command = [sys.executable, "-m", "triage_cli.main", "proxy", "-c", str(config)]
    with open(tmp_path / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(
            [*command, "-p", str(partition)], stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    return proc, f"127.0.0.1:{port}"


def kill_processes(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """Test teardown: kill -9 whichever of `procs` still run, and reap them."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


class ChildProcess:
    """A test helper module (`python -m <module> '<json options>'`) run as its own process,
    so a test can kill it -9 as a crash would: its first line (JSON) says it is ready, and
    it is killed by PID, never left running."""

    def __init__(self, module: str, options: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, json.dumps(options)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.ready: dict[str, Any] = json.loads(line) if line else {}
        """What its first line said (empty: it ended before saying anything)."""

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Killable(Protocol):
    def kill(self) -> None: ...


def run_then_kill(
    scenario: Callable[[], Coroutine[Any, Any, None]], children: Sequence[Killable]
) -> None:
    """Run a test's `scenario` in its own event loop, then kill every child it started,
    also when it failed: no receiver or consumer outlives its test."""
    try:
        asyncio.run(scenario())
    finally:
        for child in children:
            child.kill()


async def restart_until_committed(
    start: Callable[[], ChildProcess],
    children: list[ChildProcess],
    bootstrap: str,
    group: str,
    topic: str,
    total: int,
    timeout_s: float = 90.0,
) -> None:
    """Keep one child running (`start` another whenever the last one died, as a process
    manager would) until `group` has committed `total` records of partition 0 of `topic`.
    `children` collects every start, for the test to count and to kill."""
    deadline = time.monotonic() + timeout_s
    while committed(bootstrap, group, topic) < total:
        assert time.monotonic() < deadline, f"{len(children)} starts, not all committed"
        if not children or children[-1].proc.poll() is not None:
            children.append(await asyncio.to_thread(start))
        await asyncio.sleep(0.1)
