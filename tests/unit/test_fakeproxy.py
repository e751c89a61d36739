"""The shared fake proxy's control interface (`python -m tests.fakeproxy --control`), as the
TypeScript client's tests drive it: JSON lines in, events and replies out."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from triage_protocol import triage_pb2 as pb
from triage_protocol import triage_pb2_grpc as pb_grpc
from triage_protocol.constants import OWNER_ENDPOINT_METADATA

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "control-token"
WAIT_S = 10.0
AUTH = (("authorization", f"Bearer {TOKEN}"),)


class Control:
    """The fake's process: commands out, replies and events in (read on a thread)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.events: list[dict[str, Any]] = []
        self._next = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.ready = self.lines.get(timeout=WAIT_S * 3)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def send(self, command: dict[str, Any]) -> dict[str, Any]:
        """Send `command`; its reply (events read meanwhile go to `events`)."""
        assert self.proc.stdin is not None
        self._next += 1
        self.proc.stdin.write(json.dumps({**command, "id": self._next}) + "\n")
        self.proc.stdin.flush()
        while "reply" not in (message := self.lines.get(timeout=WAIT_S)):
            self.events.append(message)
        assert message["reply"] == self._next
        return message

    def close(self) -> None:
        """Kill the process by its PID if it still runs, then close its pipes."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(WAIT_S)
        self._reader.join(WAIT_S)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()

    def seen(self, count: int) -> list[str]:
        """The kinds of the first `count` events, once the fake emitted that many."""
        deadline = time.monotonic() + WAIT_S
        while len(self.events) < count:
            assert time.monotonic() < deadline, f"{len(self.events)} events, not {count}"
            time.sleep(0.01)
            self.send({"cmd": "sync"})
        return self.kinds()[:count]

    def kinds(self) -> list[str]:
        return [e["event"] for e in self.events]


@pytest.fixture
def control() -> Iterator[Control]:
    """Two scripted fake proxies in a child process, killed by PID at teardown."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fakeproxy", "--control", "--proxies", "2", "--token", TOKEN],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        fake = Control(proc)
    except BaseException:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    yield fake
    fake.close()


def test_a_scripted_stream_gets_what_the_test_writes_and_reports_what_it_sent(
    control: Control,
) -> None:
    assert control.ready["ready"] is True
    assert len(control.ready["endpoints"]) == 2
    frames: queue.Queue[pb.ConsumerFrame | None] = queue.Queue()
    frames.put(pb.ConsumerFrame(hello=pb.Hello(consumer_id="c", credits=4, partition=0)))
    with grpc.insecure_channel(control.ready["endpoints"][1]) as channel:
        stub = pb_grpc.TriageStub(channel)
        call = stub.Consume(iter(frames.get, None), metadata=AUTH)
        assert control.seen(1) == ["stream"]
        hello = control.events[0]
        assert (hello["proxy"], hello["stream"]) == (1, 1)
        assert hello["frame"] == {
            "hello": {"consumer_id": "c", "credits": 4, "partition": 0},
            "frame": "hello",
        }, "as proto-loader reads it: a partition of 0 that was sent is there"
        welcome = {"welcome": {"topic": "t", "partition": 0, "ack_deadline_ms": 300}}
        deliveries = {
            "deliveries": {
                "topic": "t",
                "deliveries": [{"offset": 7, "value": "AP8=", "headers": [{"key": "h"}]}],
            }
        }
        for frame in (welcome, deliveries):
            assert control.send({"proxy": 1, "cmd": "write", "stream": 1, "frame": frame})["ok"]
        assert next(call).welcome.ack_deadline_ms == 300
        got = next(call).deliveries.deliveries[0]
        assert (got.offset, got.value, got.HasField("key")) == (7, b"\x00\xff", False)
        assert not got.headers[0].HasField("value")
        frames.put(pb.ConsumerFrame(settle=pb.Settle(acks=[7], nacks=[pb.Nack(offset=8)])))
        frames.put(None)  # half-close: the fake ends the stream with OK
        assert list(call) == []
        assert call.code() is grpc.StatusCode.OK
    assert control.seen(3)[1:] == ["frame", "half-close"]
    settle = control.events[1]
    assert settle["frame"] == {"settle": {"acks": [7], "nacks": [{"offset": 8}]}, "frame": "settle"}
    report = control.send({"proxy": 1, "cmd": "report"})
    assert (report["acks"], report["nacks"]) == ([[1, 7]], [[1, 8, "", False]])


def test_topology_answers_and_a_failed_stream_carry_what_the_test_set(control: Control) -> None:
    endpoint = control.ready["endpoints"][0]
    with grpc.insecure_channel(endpoint) as channel:
        stub = pb_grpc.TriageStub(channel)
        with pytest.raises(grpc.RpcError) as older:
            stub.Topology(pb.TopologyRequest(), metadata=AUTH)
        assert older.value.code() is grpc.StatusCode.UNIMPLEMENTED
        route = {"partition": 0, "endpoint": endpoint, "state": 1}
        reply = {"topic": "orders", "partition_count": 1, "partitions": [route]}
        control.send({"cmd": "topology", "reply": reply})
        assert stub.Topology(pb.TopologyRequest(), metadata=AUTH).partitions[0].endpoint == endpoint
        control.send({"cmd": "topology", "code": 16, "details": "bad token"})
        with pytest.raises(grpc.RpcError) as refused:
            stub.Topology(pb.TopologyRequest(), metadata=AUTH)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED

        frames: queue.Queue[pb.ConsumerFrame | None] = queue.Queue()
        frames.put(pb.ConsumerFrame(hello=pb.Hello(credits=1)))
        call = stub.Consume(iter(frames.get, None), metadata=AUTH)
        assert control.seen(4)[3:] == ["stream"]
        control.send(
            {
                "cmd": "fail",
                "stream": 1,
                "code": 9,
                "details": "moved",
                "trailers": {OWNER_ENDPOINT_METADATA: "10.0.0.1:50051"},
            }
        )
        with pytest.raises(grpc.RpcError) as failed:
            next(call)
        frames.put(None)
    assert failed.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    # object: the stubs type every value bytes, but a key without "-bin" reads as str.
    trailers: dict[str, object] = {m.key: m.value for m in failed.value.trailing_metadata() or ()}
    assert trailers[OWNER_ENDPOINT_METADATA] == "10.0.0.1:50051"
    topology = [e for e in control.events if e["event"] == "topology"]
    assert len(topology) == 3
    assert topology[0]["metadata"]["authorization"] == [f"Bearer {TOKEN}"]


def test_a_bad_command_is_answered_with_an_error_and_stdin_closed_ends_the_fake(
    control: Control,
) -> None:
    assert "unknown command" in control.send({"cmd": "nonsense"})["error"]
    assert "no stream 3" in control.send({"cmd": "end", "stream": 3})["error"]
    assert control.proc.stdin is not None
    control.proc.stdin.close()
    assert control.proc.wait(WAIT_S) == 0
