"""Security against real parts: TLS and mTLS on the listener (certificates made here with
trustme), named tokens revoked by SIGHUP in a real `triage proxy`, and no secret or
payload in the logs of a proxy running at DEBUG."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import trustme

from tests.integration.harness import (
    RawConsumer,
    await_until,
    dead_letters,
    produce,
    settings_for,
    target,
)
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port, wait_for_port
from triage_cli.main import quiet_noisy_loggers
from triage_client import Consumer, Message
from triage_proxy.app import Proxy
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.observe.logthrottle import LogThrottle
from triage_proxy.server import service
from triage_proxy.store.provisioning import create_table

pytestmark = pytest.mark.integration

ALPHA = "alpha-token-0123456789abcdef"
BETA = "beta-token-fedcba9876543210"


@dataclass
class Pki:
    ca: trustme.CA
    server_cert: Path
    server_key: Path
    ca_file: Path
    client: trustme.LeafCert

    def channel(self, *, client_cert: bool) -> grpc.ChannelCredentials:
        if not client_cert:
            return grpc.ssl_channel_credentials(self.ca.cert_pem.bytes())
        return grpc.ssl_channel_credentials(
            self.ca.cert_pem.bytes(),
            self.client.private_key_pem.bytes(),
            b"".join(blob.bytes() for blob in self.client.cert_chain_pems),
        )


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    cert, key, ca_file = tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "ca.pem"
    cert.write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    server.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    return Pki(ca, cert, key, ca_file, ca.issue_cert("orders-consumer"))


async def _refused(consumer: RawConsumer) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async with asyncio.timeout(15):
            await consumer.read()
    assert consumer.deliveries == []
    return info.value.code()


async def _read_to_the_end(consumer: RawConsumer) -> None:
    while True:
        await consumer.read()


def test_tls_end_to_end_with_the_client_library(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str, pki: Pki
) -> None:
    tls = {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)}
    settings = settings_for(broker, aws, topic, tls=tls)
    produce(broker.bootstrap, topic, [(None, b"v%d" % i, None) for i in range(20)])

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy:
            # A plaintext client gets nothing from a TLS listener.
            async with RawConsumer(target(proxy)) as plain:
                assert await _refused(plain) == grpc.StatusCode.UNAVAILABLE
            seen: list[bytes] = []

            async def handle(message: Message) -> None:
                seen.append(message.value or b"")
                if len(seen) == 20:
                    consumer.stop()

            consumer = Consumer(
                target(proxy),
                settings.auth.token or "",
                handle,
                root_certificates=pki.ca.cert_pem.bytes(),
                max_backoff=0.2,
            )
            async with asyncio.timeout(30):
                await consumer.run_async()
            assert sorted(seen) == sorted(b"v%d" % i for i in range(20))
            assert consumer.stats.acked == 20

    asyncio.run(scenario())


def test_mtls_refuses_a_client_without_a_certificate_and_accepts_a_signed_one(
    broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str, pki: Pki
) -> None:
    tls = {
        "cert_file": str(pki.server_cert),
        "key_file": str(pki.server_key),
        "client_ca_file": str(pki.ca_file),
    }
    settings = settings_for(broker, aws, topic, tls=tls)
    produce(broker.bootstrap, topic, [(None, b"v%d" % i, None) for i in range(3)])

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy:
            anonymous = RawConsumer(target(proxy), credentials=pki.channel(client_cert=False))
            async with anonymous:
                assert await _refused(anonymous) == grpc.StatusCode.UNAVAILABLE
            async with RawConsumer(target(proxy)) as plain:
                assert await _refused(plain) == grpc.StatusCode.UNAVAILABLE
            signed = RawConsumer(target(proxy), credentials=pki.channel(client_cert=True))
            async with signed:
                got = await signed.receive(3)
                assert [d.value for d in got] == [b"v0", b"v1", b"v2"]
                assert signed.welcome is not None

    asyncio.run(scenario())


def test_no_token_password_or_payload_in_the_debug_log(
    broker: EmbeddedBroker,
    aws: EmbeddedAWS,
    topic: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Refusals are logged once per cause per 10 s, process-wide: an earlier test's wrong
    # token in this pytest process must not have used up this test's line.
    monkeypatch.setattr(service, "_refusals", LogThrottle(service.logger))
    password = "sasl-pa55word-never-logged-7d1e"
    monkeypatch.setenv("TRIAGE_TEST_SASL_PASSWORD", password)
    wrong = "wrong-token-that-looks-real-5c2a"
    settings = settings_for(
        broker,
        aws,
        topic,
        auth={"tokens": {"alpha": ALPHA, "beta": BETA}},
        # The password is resolved into the librdkafka config (which the broker ignores
        # on a PLAINTEXT listener): it must not reach the log from there either.
        kafka={"sasl_password": "env:TRIAGE_TEST_SASL_PASSWORD"},
    )
    payload = [b"KEY-7f3a-secret", b"VALUE-7f3a-secret", b"HEADER-7f3a-secret"]
    produce(broker.bootstrap, topic, [(payload[0], payload[1], [("h", payload[2])])])
    produce(broker.bootstrap, topic, [(None, b"plain", None)])
    caplog.set_level(logging.DEBUG)
    quiet_noisy_loggers()  # what `triage proxy -v` does

    async def scenario() -> None:
        async with Proxy(settings, 0) as proxy:
            async with RawConsumer(target(proxy), token=wrong, hello=False) as refused:
                assert await _refused(refused) == grpc.StatusCode.UNAUTHENTICATED

            async def handle(message: Message) -> None:
                if message.value == payload[1]:
                    raise ValueError("cannot handle this order")
                consumer.stop()

            consumer = Consumer(target(proxy), ALPHA, handle, max_backoff=0.2)
            async with asyncio.timeout(30):
                await consumer.run_async()
            assert await await_until(lambda: len(dead_letters(settings)) == 1)

    asyncio.run(scenario())
    text = caplog.text
    assert "'alpha'" in text  # the proxy logs which app connected, by name
    assert "refused a call" in text
    assert "dead-letter writer stopped: 1 written" in text
    secrets = [ALPHA, BETA, wrong, password]
    secrets += [p.decode() for p in payload]
    secrets += [base64.b64encode(p).decode() for p in payload]
    for secret in secrets:
        assert secret not in text


# --- named tokens revoked by SIGHUP, in a real `triage proxy` --------------------------


def write_toml(path: Path, values: Mapping[str, Mapping[str, object]]) -> None:
    """Sections of scalars, string lists and tables of strings (inline), mode 0600."""

    def value(v: object) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {json.dumps(x)}" for k, x in v.items()) + "}"
        return json.dumps(v)

    lines = []
    for section, table in values.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {value(v)}" for key, v in table.items())
    path.touch(0o600)
    path.write_text("\n".join(lines) + "\n")


@dataclass
class ProxyProcess:
    proc: subprocess.Popen[bytes]
    config: Path
    values: dict[str, dict[str, object]]
    target: str

    def rewrite_auth(self, **auth: object) -> None:
        self.values["auth"] = {"tokens": {"alpha": ALPHA, "beta": BETA}, **auth}
        write_toml(self.config, self.values)

    def hangup(self) -> None:
        self.proc.send_signal(signal.SIGHUP)


@pytest.fixture
def proxy_process(
    tmp_path: Path, broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> Iterator[ProxyProcess]:
    """`triage proxy` with the named tokens alpha and beta; killed by PID at the end."""
    table = f"dlq-{topic}"
    create_table(DeadLetterSettings(table=table, endpoint_url=aws.endpoint_url))
    port = free_port()
    values: dict[str, dict[str, object]] = {
        "kafka": {"bootstrap_servers": broker.bootstrap, "topic": topic, "group_id": f"g-{topic}"},
        "server": {"host": "127.0.0.1", "port": port, "http_port": 0},
        "auth": {"tokens": {"alpha": ALPHA, "beta": BETA}},
        "dead_letters": {"table": table, "endpoint_url": aws.endpoint_url},
        "shutdown": {"drain_timeout_s": 1},
    }
    config = tmp_path / "triage.toml"
    write_toml(config, values)
    log = (tmp_path / "proxy.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "triage_cli.main", "proxy", "-c", str(config), "-p", "0"],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        wait_for_port("127.0.0.1", port, 30, proc)
        yield ProxyProcess(proc, config, values, f"127.0.0.1:{port}")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
        stderr = (tmp_path / "proxy.log").read_text()
        assert ALPHA not in stderr
        assert BETA not in stderr


def test_sighup_revokes_one_app_and_leaves_the_others_alone(
    broker: EmbeddedBroker, topic: str, proxy_process: ProxyProcess, tmp_path: Path
) -> None:
    produce(broker.bootstrap, topic, [(None, b"v%d" % i, None) for i in range(4)])
    where = proxy_process.target

    async def scenario() -> None:
        async with (
            RawConsumer(where, token=ALPHA, credits=1) as alpha,
            RawConsumer(where, token=BETA, credits=1) as beta,
        ):
            [held_by_alpha] = await alpha.receive(1)
            [held_by_beta] = await beta.receive(1)

            proxy_process.rewrite_auth(revoked=["alpha"])
            proxy_process.hangup()
            # alpha's open stream ends UNAUTHENTICATED; what it held goes to others.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(_read_to_the_end(alpha), 15)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # beta's stream is untouched: it settles and keeps receiving.
            beta.settle(acks=[held_by_beta.offset])
            [next_for_beta] = await beta.receive(1)
            beta.settle(acks=[next_for_beta.offset])
            [again] = await beta.receive(1)
            assert held_by_alpha.offset in {next_for_beta.offset, again.offset}

            async with RawConsumer(where, token=ALPHA, hello=False) as new_alpha:
                assert await _refused(new_alpha) == grpc.StatusCode.UNAUTHENTICATED
            async with RawConsumer(where, token=BETA) as new_beta:
                frame = await asyncio.wait_for(new_beta.read(), 15)
                assert frame.WhichOneof("frame") == "welcome"

            # A broken file keeps the tokens as they are.
            proxy_process.config.write_text("[auth\n")
            proxy_process.hangup()
            log = tmp_path / "proxy.log"  # the reload was tried, and failed, once it says so
            assert await await_until(lambda: "token reload failed" in log.read_text(), 30)
            async with RawConsumer(where, token=ALPHA, hello=False) as still_revoked:
                assert await _refused(still_revoked) == grpc.StatusCode.UNAUTHENTICATED
            async with RawConsumer(where, token=BETA) as still_fine:
                frame = await asyncio.wait_for(still_fine.read(), 15)
                assert frame.WhichOneof("frame") == "welcome"

    asyncio.run(scenario())
    assert proxy_process.proc.poll() is None
    stderr = (tmp_path / "proxy.log").read_text()
    assert "authenticated as app 'alpha'" in stderr
    assert "revoked alpha" in stderr
    assert "token reload failed" in stderr


@pytest.mark.parametrize(
    ("key", "content"),
    [("cert_file", None), ("key_file", b"not PEM at all")],
)
def test_triage_proxy_exits_2_naming_a_bad_tls_file(
    tmp_path: Path, pki: Pki, key: str, content: bytes | None
) -> None:
    bad = tmp_path / "bad.pem"
    if content is not None:
        bad.write_bytes(content)
    tls = {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key), key: str(bad)}
    config = tmp_path / "triage.toml"
    write_toml(
        config,
        {
            "kafka": {"bootstrap_servers": "127.0.0.1:1", "topic": "t", "group_id": "g"},
            "server": {"host": "127.0.0.1", "port": 0, "http_port": 0},
            "auth": {"token": ALPHA},
            "dead_letters": {"table": "dlq"},
            "tls": tls,
        },
    )
    out = subprocess.run(
        [sys.executable, "-m", "triage_cli.main", "proxy", "-c", str(config), "-p", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert f"tls.{key}" in out.stderr
    assert ALPHA not in out.stderr
