"""A slow commit or log-end query never holds up the fetch (partition.py's threads).

On Tansu a synchronous commit takes up to ~100 ms and a log-end query up to 200 ms; when
they shared the fetch's thread, every record fetched meanwhile waited for them. Here the
twin's commit and log-end query block until the test lets them go, and a record appended
meanwhile must still be delivered to a real gRPC instance on localhost.
"""

from __future__ import annotations

import asyncio
import threading

from tests.unit.wire import consume_call, hello, serving, take
from tests.waiting import eventually
from triage_protocol import triage_pb2 as pb
from triage_proxy.app import Proxy
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.kafka.client import MemoryPartition
from triage_proxy.store.checkpoints import MemoryCheckpoints
from triage_proxy.store.deadletter_store import MemoryStore

TOKEN = "kafka-threads-token-0123"
READ_TIMEOUT_S = 20.0


class HeldPartition(MemoryPartition):
    """Commits and log-end queries wait for `gate` (set: they pass at once)."""

    def __init__(self) -> None:
        super().__init__("orders", 0)
        self.gate = threading.Event()
        self.commit_waiting = threading.Event()
        self.log_end_waiting = threading.Event()

    def commit(self, offset: int, metadata: str | None = None) -> None:
        self.commit_waiting.set()
        self.gate.wait()
        super().commit(offset, metadata)

    def log_end(self) -> int:
        self.log_end_waiting.set()
        self.gate.wait()
        return super().log_end()


def test_fetching_goes_on_while_a_commit_and_a_log_end_query_are_held() -> None:
    log = HeldPartition()
    log.append(b"first")
    settings = settings_from_dict(
        {
            "kafka": {"bootstrap_servers": "127.0.0.1:1", "topic": "orders", "group_id": "g"},
            "auth": {"token": TOKEN},
            "dead_letters": {"table": "dlq"},
            "server": {"host": "127.0.0.1", "port": 0, "http_port": 0},
            "commit": {"interval_s": 0.01},
            "ownership": {"enabled": False},
        },
        {},
    )
    proxy = Proxy(settings, 0, log=log, store=MemoryStore(), checkpoints=MemoryCheckpoints())

    async def scenario() -> None:
        async with serving(proxy), consume_call(proxy, TOKEN) as call:
            try:
                await hello(call)
                assert await take(call, 1) == [0]
                # The log-end watcher asks at once and is held; the ack makes a commit due.
                await call.write(pb.ConsumerFrame(settle=pb.Settle(acks=[0])))
                await eventually(log.commit_waiting.is_set, within=READ_TIMEOUT_S)
                assert log.log_end_waiting.is_set()
                log.append(b"second")
                second = await asyncio.wait_for(call.read(), READ_TIMEOUT_S)
                assert [d.value for d in second.deliveries.deliveries] == [b"second"]
                assert log.commits == []  # the commit is still held
                log.gate.set()
                await eventually(lambda: any(o == 1 for o, _ in log.commits), within=READ_TIMEOUT_S)
            finally:
                log.gate.set()  # else the proxy's stop waits for the held commit

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert log.closed
