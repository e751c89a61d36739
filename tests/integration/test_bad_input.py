"""The bad-input table, the half that needs real parts: gRPC frames, HTTP requests and
Kafka records against one running `triage proxy` (real Tansu, real moto server), the
proxy's own exit codes for what it refuses at start, and the commands that reach the
network. The list of what is rejected and how is this module plus
tests/unit/test_bad_input.py (config files, the command line, the pure pieces);
docs/reference/rejected.md links both.

One proxy serves the whole module. After every gRPC, HTTP and Kafka row the module
checks that the proxy still serves and that nothing was lost: a fresh record produced
now is delivered to a well-behaved consumer, which acks everything it gets, and the
group's committed offset reaches every record produced so far.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme

from tests.integration.harness import (
    TOKEN,
    RawConsumer,
    committed,
    create_topic,
    produce,
    wait_until,
)
from triage_cli.devstack import write_config
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port, stop_process, wait_for_port
from triage_protocol import triage_pb2 as pb
from triage_protocol import triage_pb2_grpc as pb_grpc
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.store.provisioning import create_table

# On one worker (--dist loadgroup): the module's proxy starts once.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("bad-input")]

TRIAGE = [sys.executable, "-m", "triage_cli.main"]
TOPIC = "bad-input"


@dataclass
class Stack:
    """The module's one proxy and what it runs against."""

    broker: EmbeddedBroker
    raw: dict[str, dict[str, Any]]
    """The proxy's config (write a copy to vary it)."""
    target: str
    http: str
    """http://host:port of the proxy's HTTP endpoint."""
    folder: Path
    proc: subprocess.Popen[bytes]
    produced: int = 0
    """Records produced to the topic so far (all must end committed)."""


def triage(
    *args: str, stdin: str | None = None, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TRIAGE, *args], input=stdin, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def stack(
    broker: EmbeddedBroker, aws: EmbeddedAWS, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("bad-input")
    create_topic(broker.bootstrap, TOPIC)
    table = f"dlq-{TOPIC}"
    create_table(DeadLetterSettings(table=table, endpoint_url=aws.endpoint_url))
    port, http_port = free_port(), free_port()
    raw: dict[str, dict[str, Any]] = {
        "kafka": {
            "bootstrap_servers": broker.bootstrap,
            "topic": TOPIC,
            "group_id": f"g-{TOPIC}",
            "partitions": 1,
        },
        "server": {"host": "127.0.0.1", "port": port, "http_port": http_port},
        "auth": {"token": TOKEN},
        "dead_letters": {"table": table, "endpoint_url": aws.endpoint_url, "flush_interval_ms": 5},
        "commit": {"interval_s": 0.1},
        "shutdown": {"drain_timeout_s": 2},
    }
    config = folder / "triage.toml"
    write_config(config, raw)
    with open(folder / "proxy.log", "ab") as log:
        proc = subprocess.Popen(
            [*TRIAGE, "proxy", "-c", str(config), "-p", "0"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    try:
        wait_for_port("127.0.0.1", port, 60, proc)
        yield Stack(broker, raw, f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", folder, proc)
    finally:
        stop_process(proc, 30)
    text = (folder / "proxy.log").read_text()
    assert "Traceback" not in text  # no bad input made the proxy log a traceback


def still_serves_and_nothing_lost(stack: Stack) -> None:
    """A record produced now reaches a good consumer; everything produced is committed."""
    marker = f"probe-{stack.produced}".encode()
    stack.produced += produce(stack.broker.bootstrap, TOPIC, [(None, marker, None)])

    async def consume() -> None:
        async with RawConsumer(stack.target, credits=100) as consumer:
            async with asyncio.timeout(30):
                while True:
                    frame = await consumer.read()
                    if frame.WhichOneof("frame") == "deliveries":
                        consumer.settle(acks=[d.offset for d in frame.deliveries.deliveries])
                        if any(d.value == marker for d in frame.deliveries.deliveries):
                            break
            done = await asyncio.to_thread(
                wait_until,
                lambda: committed(stack.broker.bootstrap, f"g-{TOPIC}", TOPIC) >= stack.produced,
                30,
            )
            assert done, "the committed offset did not reach every produced record"

    asyncio.run(consume())


# --- gRPC frames ---------------------------------------------------------------------------


def _frame(**kwargs: Any) -> bytes:
    return pb.ConsumerFrame(**kwargs).SerializeToString()


HELLO = _frame(hello=pb.Hello(consumer_id="bad-input", credits=1))
GARBAGE = b"\xff\xff\xff\xff\x0f"

# (id, frames sent as raw bytes, token, expected status, fragment of the details)
GRPC_CASES: list[tuple[str, list[bytes], str | None, grpc.StatusCode, str]] = [
    ("garbage-first-frame", [GARBAGE], TOKEN, grpc.StatusCode.INVALID_ARGUMENT, "does not parse"),
    ("garbage-after-hello", [HELLO, GARBAGE], TOKEN, grpc.StatusCode.INVALID_ARGUMENT, "frame 2"),
    ("second-hello", [HELLO, HELLO], TOKEN, grpc.StatusCode.INVALID_ARGUMENT, "second Hello"),
    (
        "settle-two-million-plain-acks",
        [HELLO, _frame(settle=pb.Settle(acks=[0] * 2_000_000))],
        TOKEN,
        grpc.StatusCode.INVALID_ARGUMENT,
        "settles at most 100000 offsets",
    ),
    (
        "settle-too-many-nacks",
        [HELLO, _frame(settle=pb.Settle(nacks=[pb.Nack(offset=0)] * 100_001))],
        TOKEN,
        grpc.StatusCode.INVALID_ARGUMENT,
        "nacks together",
    ),
    (
        "extend-too-many-offsets",
        [HELLO, _frame(extend=pb.Extend(offsets=[0] * 100_001))],
        TOKEN,
        grpc.StatusCode.INVALID_ARGUMENT,
        "an Extend names at most 100000",
    ),
    (
        "settle-before-hello",
        [_frame(settle=pb.Settle(acks=[0]))],
        TOKEN,
        grpc.StatusCode.INVALID_ARGUMENT,
        "first frame must be Hello",
    ),
    ("no-frame-at-all", [], TOKEN, grpc.StatusCode.INVALID_ARGUMENT, "expected a Hello"),
    (
        "zero-credits",
        [_frame(hello=pb.Hello(consumer_id="c", credits=0))],
        TOKEN,
        grpc.StatusCode.INVALID_ARGUMENT,
        "credits",
    ),
    (
        "too-many-credits",
        [_frame(hello=pb.Hello(consumer_id="c", credits=100_001))],
        TOKEN,
        grpc.StatusCode.INVALID_ARGUMENT,
        "credits",
    ),
    (
        "consumer-id-newline",
        [_frame(hello=pb.Hello(consumer_id="a\nb", credits=1))],
        TOKEN,
        grpc.StatusCode.INVALID_ARGUMENT,
        "consumer_id",
    ),
    (
        "consumer-id-escape",
        [_frame(hello=pb.Hello(consumer_id="\x1b[31m", credits=1))],
        TOKEN,
        grpc.StatusCode.INVALID_ARGUMENT,
        "consumer_id",
    ),
    (
        "consumer-id-too-long",
        [_frame(hello=pb.Hello(consumer_id="x" * 3000, credits=1))],
        TOKEN,
        grpc.StatusCode.INVALID_ARGUMENT,
        "consumer_id",
    ),
    (
        "negative-partition",
        [_frame(hello=pb.Hello(consumer_id="c", credits=1, partition=-1))],
        TOKEN,
        grpc.StatusCode.INVALID_ARGUMENT,
        "partition",
    ),
    (
        "partition-not-in-topic",
        [_frame(hello=pb.Hello(consumer_id="c", credits=1, partition=7))],
        TOKEN,
        grpc.StatusCode.FAILED_PRECONDITION,
        "partition 7",
    ),
    # No frame: the proxy refuses from the metadata alone, and a Hello write racing that
    # refusal can end the call INTERNAL on the client's side (seen in CI).
    ("wrong-token", [], "wrong-token-0123456789", grpc.StatusCode.UNAUTHENTICATED, "token"),
    ("no-token", [], None, grpc.StatusCode.UNAUTHENTICATED, "token"),
]


async def raw_stream(
    target: str, frames: list[bytes], token: str | None, gap_s: float = 0.1
) -> tuple[grpc.StatusCode, str]:
    """Send `frames` as they are (bytes, no serializer) on one Consume stream, `gap_s`
    apart; return the status it ends with."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.stream_stream(
            "/triage.v1.Triage/Consume",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )

        async def send() -> Any:
            for frame in frames:
                yield frame
                await asyncio.sleep(gap_s)
            await asyncio.sleep(1.0 if gap_s else 0)  # then half-close

        metadata = [("authorization", f"Bearer {token}")] if token else []
        stream = call(send(), metadata=metadata)
        async with asyncio.timeout(30):
            try:
                async for _ in stream:
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details() or ""
            return await stream.code(), await stream.details() or ""


@pytest.mark.parametrize(
    ("frames", "token", "code", "names"),
    [pytest.param(f, t, c, n, id=name) for name, f, t, c, n in GRPC_CASES],
)
def test_grpc_bad_frames_end_the_stream_naming_the_cause(
    stack: Stack, frames: list[bytes], token: str | None, code: grpc.StatusCode, names: str
) -> None:
    got, details = asyncio.run(raw_stream(stack.target, frames, token))
    assert got == code, details
    assert names in details
    still_serves_and_nothing_lost(stack)


def test_a_second_hello_right_behind_the_first_ends_the_stream(stack: Stack) -> None:
    # Both written at once, then the half-close: the second arrives before the proxy
    # has sent its Welcome.
    for _ in range(5):
        got, details = asyncio.run(raw_stream(stack.target, [HELLO, HELLO], TOKEN, gap_s=0))
        assert got == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "second Hello" in details
    still_serves_and_nothing_lost(stack)


def test_topology_with_a_wrong_token_is_unauthenticated(stack: Stack) -> None:
    async def ask() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(stack.target) as channel:
            stub = pb_grpc.TriageStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Topology(pb.TopologyRequest(), metadata=[("authorization", "Bearer x")])
            return info.value.code()

    assert asyncio.run(ask()) == grpc.StatusCode.UNAUTHENTICATED
    still_serves_and_nothing_lost(stack)


def test_fifty_garbage_topology_requests_are_refused_with_one_log_line(stack: Stack) -> None:
    async def ask() -> list[tuple[grpc.StatusCode, str]]:
        async with grpc.aio.insecure_channel(stack.target) as channel:
            call = channel.unary_unary(
                "/triage.v1.Triage/Topology",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            got = []
            for _ in range(50):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(GARBAGE, metadata=[("authorization", f"Bearer {TOKEN}")])
                got.append((info.value.code(), info.value.details() or ""))
            return got

    log = stack.folder / "proxy.log"
    before = log.read_text().count("refused a Topology call")
    answers = asyncio.run(ask())
    assert {code for code, _ in answers} == {grpc.StatusCode.INVALID_ARGUMENT}
    assert all("does not parse" in details for _, details in answers)
    text = log.read_text()
    assert text.count("refused a Topology call") - before <= 1  # one line per interval
    assert "DecodeError" not in text
    still_serves_and_nothing_lost(stack)


def test_a_forged_settlement_is_rejected_not_committed(stack: Stack) -> None:
    async def forge() -> list[int]:
        async with RawConsumer(stack.target, credits=1) as consumer:
            await consumer.read()  # Welcome
            consumer.settle(acks=[10**9], nacks=[(10**9 + 1, "forged")])
            async with asyncio.timeout(15):
                while len(consumer.rejected) < 2:
                    await consumer.read()
            return sorted(consumer.rejected)

    assert asyncio.run(forge()) == [10**9, 10**9 + 1]
    still_serves_and_nothing_lost(stack)


def test_sighup_with_the_config_in_another_encoding_keeps_the_running_config(
    stack: Stack,
) -> None:
    config = stack.folder / "triage.toml"
    good = config.read_bytes()
    log = stack.folder / "proxy.log"
    before = log.read_text().count("token reload failed")
    config.write_bytes(good + "# café, saved as Latin-1\n".encode("latin-1"))
    try:
        stack.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "token reload failed" in log.read_text()[-4000:], 15)
    finally:
        config.write_bytes(good)
    text = log.read_text()
    assert text.count("token reload failed") == before + 1
    assert "is not UTF-8" in text
    assert stack.proc.poll() is None
    still_serves_and_nothing_lost(stack)  # with the tokens it had


# --- HTTP ----------------------------------------------------------------------------------

HTTP_CASES: list[tuple[str, str, str, int]] = [
    ("unknown-path", "GET", "/nope", 404),
    ("post-to-status", "POST", "/status", 405),
    ("put-to-metrics", "PUT", "/metrics", 405),
    ("path-traversal", "GET", "/../../etc/passwd", 404),
]


@pytest.mark.parametrize(
    ("method", "path", "code"), [pytest.param(m, p, c, id=n) for n, m, p, c in HTTP_CASES]
)
def test_http_bad_requests_get_their_status(
    stack: Stack, method: str, path: str, code: int
) -> None:
    request = urllib.request.Request(
        stack.http + path, method=method, data=b"" if method != "GET" else None
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=5)
    info.value.close()
    assert info.value.code == code
    # Still ready: asked until it says so (a broker query that fails on a loaded machine
    # makes /readyz answer 503 for a moment, which is not what this test is about).
    assert wait_until(lambda: http_status(stack.http + "/readyz") == 200, 30)
    still_serves_and_nothing_lost(stack)


def http_status(url: str) -> int:
    """The status an HTTP GET of `url` answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as refused:
        refused.close()
        return refused.code


# --- Kafka records -------------------------------------------------------------------------

Headers = list[tuple[str, bytes | None]] | None
RECORD_CASES: list[tuple[str, bytes | None, bytes | None, Headers]] = [
    ("null-value", b"k", None, None),
    ("null-key-and-value", None, None, None),
    ("empty-value", None, b"", None),
    ("not-utf8", b"\xff\xfe", b"\x00\xff\x1b[31m\xc3\x28", None),
    ("null-header-and-duplicates", None, b"v", [("h", None), ("h", b"1"), ("h", b"2")]),
    ("half-megabyte-value", None, b"x" * 500_000, None),
]


@pytest.mark.parametrize(
    ("key", "value", "headers"), [pytest.param(k, v, h, id=n) for n, k, v, h in RECORD_CASES]
)
def test_odd_kafka_records_travel_byte_exact(
    stack: Stack, key: bytes | None, value: bytes | None, headers: Headers
) -> None:
    stack.produced += produce(stack.broker.bootstrap, TOPIC, [(key, value, headers)])
    offset = stack.produced - 1

    async def consume() -> pb.Delivery:
        async with RawConsumer(stack.target, credits=10) as consumer:
            async with asyncio.timeout(30):
                while True:
                    frame = await consumer.read()
                    if frame.WhichOneof("frame") != "deliveries":
                        continue
                    consumer.settle(acks=[d.offset for d in frame.deliveries.deliveries])
                    for d in frame.deliveries.deliveries:
                        if d.offset == offset:
                            await asyncio.sleep(0.3)  # let the ack go out
                            return d

    got = asyncio.run(consume())
    assert (got.key if got.HasField("key") else None) == key
    assert (got.value if got.HasField("value") else None) == value
    sent = [(h, v) for h, v in headers or []]
    assert [(h.key, h.value if h.HasField("value") else None) for h in got.headers] == sent
    still_serves_and_nothing_lost(stack)


# --- what the proxy refuses at start, with its exit code -----------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    files = {n: folder / f"{n}.pem" for n in ("cert", "key", "other", "enc", "garbage")}
    files["cert"].write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    server.private_key_pem.write_to_path(str(files["key"]))
    trustme.CA().issue_cert("x").private_key_pem.write_to_path(str(files["other"]))
    encrypt = ["openssl", "pkey", "-in", str(files["key"]), "-aes256", "-passout", "pass:pw"]
    subprocess.run([*encrypt, "-out", str(files["enc"])], check=True, capture_output=True)
    files["garbage"].write_bytes(
        b"-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n"
    )
    return files


def _variant(stack: Stack, pki: dict[str, Path], case: str) -> tuple[dict[str, Any], int]:
    """The module's config changed for one start-up case; returns (config, partition)."""
    raw = json.loads(json.dumps(stack.raw))
    raw["server"].update({"port": 0, "http_port": 0})
    raw["kafka"]["topic"] = f"{TOPIC}-{case}"  # its own lease: never a standby behind ours
    partition = 0
    if case.startswith("tls-"):
        key, ca = {"tls-mismatch": ("other", None), "tls-encrypted": ("enc", None)}.get(
            case, ("key", "garbage")
        )
        raw["tls"] = {"cert_file": str(pki["cert"]), "key_file": str(pki[key])}
        if ca:
            raw["tls"]["client_ca_file"] = str(pki[ca])
    elif case == "unknown-librdkafka-property":
        raw["kafka"]["client"] = {"no.such.property": 1}
    elif case == "missing-partition":
        raw["kafka"]["topic"] = TOPIC
        partition = 5
    elif case == "missing-table":
        raw["dead_letters"]["table"] = "no-such-table"
    elif case == "bad-server-host":
        raw["server"]["host"] = "192.0.2.1"
    elif case == "bad-endpoint-url":
        raw["dead_letters"]["endpoint_url"] = "localhost:5000"
    elif case == "port-overflow":  # 65533 + 5: the proxy would bind some other port
        raw["server"].update({"port": 65533, "http_port": 0})
        partition = 5
    elif case == "bad-bootstrap":
        raw["kafka"]["bootstrap_servers"] = f"127.0.0.1:{free_port()}"
        raw["ownership"] = {"enabled": False}
    return raw, partition


START_CASES: list[tuple[str, int, str]] = [
    ("tls-mismatch", 2, "tls.key_file"),
    ("tls-encrypted", 2, "tls.key_file"),
    ("tls-garbage-ca", 2, "tls.client_ca_file"),
    ("unknown-librdkafka-property", 2, "no.such.property"),
    ("missing-topic", 4, "does not exist"),
    ("missing-partition", 2, "5 outside topic"),  # a partition the topic lacks: bad input
    ("missing-table", 4, "no-such-table"),
    ("bad-server-host", 2, "server.host"),
    ("bad-endpoint-url", 2, "dead_letters.endpoint_url"),
    ("port-overflow", 2, "set server.port to at most 65530"),
    ("bad-bootstrap", 3, "Timed out"),
]


@pytest.mark.parametrize(("case", "code", "names"), START_CASES, ids=[c[0] for c in START_CASES])
def test_triage_proxy_refuses_at_start_with_its_exit_code(
    stack: Stack, pki: dict[str, Path], case: str, code: int, names: str
) -> None:
    raw, partition = _variant(stack, pki, case)
    config = stack.folder / f"{case}.toml"
    write_config(config, raw)
    out = triage("proxy", "-c", str(config), "-p", str(partition))
    assert out.returncode == code, out.stderr
    assert names in out.stderr
    assert "Traceback" not in out.stderr
    assert TOKEN not in out.stderr


@pytest.mark.parametrize("which", ["port", "http_port"])
def test_a_port_in_use_is_blamed_on_its_own_key(stack: Stack, which: str) -> None:
    raw = json.loads(json.dumps(stack.raw))
    raw["kafka"]["topic"] = f"{TOPIC}-port-{which}"
    create_topic(stack.broker.bootstrap, raw["kafka"]["topic"])  # gRPC binds once Kafka opens
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        raw["server"].update({"port": 0, "http_port": 0, which: taken.getsockname()[1]})
        config = stack.folder / f"in-use-{which}.toml"
        write_config(config, raw)
        out = triage("proxy", "-c", str(config), "-p", "0")
    assert out.returncode == 2, out.stderr
    assert f"server.{which}" in out.stderr


# --- commands that reach the network -------------------------------------------------------


def test_init_with_a_topic_the_broker_lacks_names_it(stack: Stack) -> None:
    out = triage(
        "init",
        "--non-interactive",
        "--config",
        str(stack.folder / "init.toml"),
        "--bootstrap-servers",
        stack.broker.bootstrap,
        "--topic",
        "no-such-topic",
    )
    assert out.returncode == 4, out.stderr
    assert "'no-such-topic' does not exist" in out.stderr
    assert "cannot be asked" not in out.stderr


def test_config_check_connect_names_a_missing_topic(stack: Stack) -> None:
    raw = json.loads(json.dumps(stack.raw))
    raw["kafka"]["topic"] = "no-such-topic"
    raw["kafka"].pop("partitions")
    config = stack.folder / "check.toml"
    write_config(config, raw)
    out = triage("config", "check", "--config", str(config), "--connect")
    assert out.returncode == 4, out.stderr
    assert "no-such-topic" in out.stderr


def test_status_with_the_broker_gone_prints_what_the_proxies_say(stack: Stack) -> None:
    raw = json.loads(json.dumps(stack.raw))
    raw["kafka"]["bootstrap_servers"] = f"127.0.0.1:{free_port()}"
    raw["kafka"].pop("partitions")
    config = stack.folder / "status.toml"
    write_config(config, raw)
    out = triage("status", "--config", str(config), "--json")
    assert out.returncode == 3, out.stderr
    doc = json.loads(out.stdout)
    assert doc["broker_error"]
    assert [row["proxy"] for row in doc["partitions"]] == ["running"]
    assert "%3|" not in out.stderr  # librdkafka's raw lines stay off stderr


STATUS_CASES: list[tuple[str, dict[str, str], int, list[str]]] = [
    # this config's ports answer for another deployment (same topic, another group and
    # table): nothing of this one is deployed, and the other's proxy is not shown as ours
    (
        "group-nobody-deployed",
        {"group_id": "g-never-deployed", "table": "dlq-bad-input"},
        1,
        ["nothing is deployed for group 'g-never-deployed'", "triage deploy --config"],
    ),
    # the dead-letter table does not exist: exit 4 with what to do
    (
        "table-missing",
        {"table": "no-such-dlq-table"},
        4,
        ["'no-such-dlq-table' does not exist", "triage deploy --config", "dead_letters.table"],
    ),
]


@pytest.mark.parametrize(
    ("case", "change", "code", "names"), STATUS_CASES, ids=[c[0] for c in STATUS_CASES]
)
def test_status_counts_only_this_deployment_and_its_table(
    stack: Stack, case: str, change: dict[str, str], code: int, names: list[str]
) -> None:
    raw = json.loads(json.dumps(stack.raw))
    if "group_id" in change:
        raw["kafka"]["group_id"] = change["group_id"]
    raw["dead_letters"]["table"] = change["table"]
    config = stack.folder / f"status-{case}.toml"
    write_config(config, raw)
    out = triage("status", "--config", str(config), "--json")
    assert out.returncode == code, out.stderr
    doc = json.loads(out.stdout)
    for text in names:
        assert text in out.stderr
    assert "Traceback" not in out.stderr
    if case == "group-nobody-deployed":
        assert [row["proxy"] for row in doc["partitions"]] == ["down"]
        assert doc["deployed"] is False
        assert doc["other_deployments"]  # the process that answered, named
        table = triage("status", "--config", str(config))
        assert "nothing is deployed for group 'g-never-deployed'" in table.stdout
    else:
        assert doc["dead_letters_missing"] is True
