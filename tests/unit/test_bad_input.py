"""The bad-input table, the half that needs no process: config files through `triage
config check` (the same loader and preflight the proxy runs at start), command-line
input, and the pure pieces (frame grammar, tokens, readiness, the log throttle).

Each row is one bad input, what it must end with (an exit code) and a fragment of the
message that names the cause. The half that needs a broker, DynamoDB and a running
proxy (gRPC frames, HTTP, Kafka records, the proxy's own exit codes) is
tests/integration/test_bad_input.py. Cases covered elsewhere, and not repeated here:
tests/unit/test_settings_limits.py (every number: NaN, +-inf, 0, negative, too large;
every reserved `[kafka.client]` property; inline secrets), tests/unit/test_security.py
(missing and non-PEM TLS files), tests/integration/test_client_input.py (consumer ids,
unwritable dead letters), tests/integration/test_attempts.py (a flapping fleet, crash
pills across a kill -9), tests/integration/test_security.py (TLS, mTLS, revocation),
tests/integration/test_dlq_cli.py (a long reason with a newline in `dlq list` piped and
`dlq show`; SIGINT during `dlq replay`), tests/unit/test_render.py (control characters
in a reason),
tests/integration/test_group_fence.py (two deployments sharing a group id over two
tables), tests/integration/test_init_deploy.py (destroy given a live deployment's state
folder), tests/unit/test_init_push.py (init's next steps), tests/unit/test_status_cli.py
(another deployment's process at this config's ports).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import trustme
from google.protobuf.message import DecodeError
from typer.testing import CliRunner

from tests.unit.test_dispatcher import connect, make, records
from triage_cli.main import app
from triage_protocol import triage_pb2 as pb
from triage_proxy.errors import FrameError
from triage_proxy.observe import endpoint as endpoint_module
from triage_proxy.observe.endpoint import (
    BROKER_GONE,
    NOT_A_MEMBER,
    HttpEndpoint,
    not_ready_because,
)
from triage_proxy.observe.logthrottle import LogThrottle, throttle_decision
from triage_proxy.observe.snapshot import ProcessSnapshot, ProxySnapshot
from triage_proxy.server.grammar import checked_frames

TOKEN = "unit-test-token-0123456789"


def base_config() -> dict[str, dict[str, Any]]:
    return {
        "kafka": {"bootstrap_servers": "127.0.0.1:1", "topic": "orders", "group_id": "g"},
        "server": {"host": "127.0.0.1", "port": 0, "http_port": 0},
        "auth": {"token": TOKEN},
        "dead_letters": {"table": "dlq", "overflow_bucket": "b"},
    }


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Good and bad TLS files: a server certificate and its key, another key, a CA, an
    encrypted key and PEM-shaped garbage."""
    folder = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    files = {name: folder / f"{name}.pem" for name in ("cert", "key", "other", "ca", "enc")}
    files["cert"].write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    server.private_key_pem.write_to_path(str(files["key"]))
    trustme.CA().issue_cert("x").private_key_pem.write_to_path(str(files["other"]))
    ca.cert_pem.write_to_path(str(files["ca"]))
    encrypt = ["openssl", "pkey", "-in", str(files["key"]), "-aes256", "-passout", "pass:pw"]
    subprocess.run(
        [*encrypt, "-out", str(files["enc"])],
        check=True,
        capture_output=True,
    )
    files["garbage"] = folder / "garbage.pem"
    files["garbage"].write_bytes(
        b"-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n"
    )
    files["garbage_key"] = folder / "garbage_key.pem"
    files["garbage_key"].write_bytes(
        b"-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n"
    )
    return files


Edit = Callable[[dict[str, dict[str, Any]], dict[str, Path]], None]


def _set(section: str, key: str, value: Any) -> Edit:
    def edit(raw: dict[str, dict[str, Any]], pki: dict[str, Path]) -> None:
        raw.setdefault(section, {})[key] = value

    return edit


def _tls(cert: str, key: str, ca: str | None = None) -> Edit:
    def edit(raw: dict[str, dict[str, Any]], pki: dict[str, Path]) -> None:
        raw["tls"] = {"cert_file": str(pki[cert]), "key_file": str(pki[key])}
        if ca is not None:
            raw["tls"]["client_ca_file"] = str(pki[ca])

    return edit


def _client(name: str, value: Any) -> Edit:
    def edit(raw: dict[str, dict[str, Any]], pki: dict[str, Path]) -> None:
        raw["kafka"]["client"] = {name: value}

    return edit


def _auth(tokens: dict[str, str], revoked: list[str]) -> Edit:
    def edit(raw: dict[str, dict[str, Any]], pki: dict[str, Path]) -> None:
        raw["auth"] = {"tokens": tokens, "revoked": revoked}

    return edit


def _ports(port: int, http_port: int, partitions: int) -> Edit:
    def edit(raw: dict[str, dict[str, Any]], pki: dict[str, Path]) -> None:
        raw["server"].update({"port": port, "http_port": http_port})
        raw["kafka"]["partitions"] = partitions

    return edit


def _push(**table: Any) -> Edit:
    """One `[[push]]` table named "orders" (an array of tables, not a section)."""

    def edit(raw: dict[str, Any], pki: dict[str, Path]) -> None:
        raw["push"] = [{"name": "orders", **table}]

    return edit


# (id, edit, exit code, fragment of the message naming the cause)
CONFIG_CASES: list[tuple[str, Edit, int, str]] = [
    ("token-of-spaces", _set("auth", "token", " " * 16), 2, "auth.tokens.default"),
    ("token-non-ascii", _set("auth", "token", "tøken-0123456789abc"), 2, "printable ASCII"),
    ("token-control-char", _set("auth", "token", "token\x01-0123456789ab"), 2, "printable ASCII"),
    ("token-inner-space", _set("auth", "token", "token 0123456789abcd"), 2, "without spaces"),
    ("token-too-short", _set("auth", "token", "short"), 2, "at least 16"),
    (
        "named-token-newline",
        _set("auth", "tokens", {"app": "line\nbreak-0123456789"}),
        2,
        "auth.tokens.app",
    ),
    (
        "token-env-unset",
        _set("auth", "tokens", {"app": "env:TRIAGE_NO_SUCH_VAR"}),
        2,
        "TRIAGE_NO_SUCH_VAR",
    ),
    (
        "token-and-tokens-default",
        _set("auth", "tokens", {"default": "other-token-0123456789"}),
        2,
        "keep one of them",
    ),
    (
        "revoked-token-copied-under-another-name",  # the only token left is the revoked one
        _auth({"app": "app-token-0123456789", "copy": "app-token-0123456789"}, ["app"]),
        2,
        "no usable token",
    ),
    ("topic-with-hash", _set("kafka", "topic", "a#b"), 2, "kafka.topic"),
    ("topic-empty", _set("kafka", "topic", ""), 2, "kafka.topic"),
    ("topic-too-long", _set("kafka", "topic", "t" * 250), 2, "kafka.topic"),
    ("topic-dot", _set("kafka", "topic", "."), 2, "kafka.topic"),
    (
        "endpoint-url-no-scheme",
        _set("dead_letters", "endpoint_url", "localhost:5000"),
        2,
        "dead_letters.endpoint_url",
    ),
    (
        "endpoint-url-bad-port",
        _set("dead_letters", "endpoint_url", "http://h:99999"),
        2,
        "dead_letters.endpoint_url",
    ),
    (
        "endpoint-url-ftp",
        _set("dead_letters", "endpoint_url", "ftp://h"),
        2,
        "dead_letters.endpoint_url",
    ),
    (
        "webhook-not-url",
        _set("dead_letters", "notify_webhook_url", "hooks"),
        2,
        "notify_webhook_url",
    ),
    ("tls-key-mismatch", _tls("cert", "other"), 2, "tls.key_file"),
    ("tls-garbage-cert", _tls("garbage", "key"), 2, "tls.cert_file"),
    ("tls-garbage-key", _tls("cert", "garbage_key"), 2, "tls.key_file"),
    ("tls-encrypted-key", _tls("cert", "enc"), 2, "is encrypted"),
    ("tls-garbage-ca", _tls("cert", "key", "garbage"), 2, "tls.client_ca_file"),
    ("tls-key-as-ca", _tls("cert", "key", "key"), 2, "tls.client_ca_file"),
    ("tls-cert-as-key", _tls("cert", "cert"), 2, "tls.key_file"),
    ("tls-cert-without-key", _set("tls", "cert_file", "/nonexistent.pem"), 2, "tls.key_file"),
    ("server-host-not-here", _set("server", "host", "192.0.2.1"), 2, "server.host"),
    ("server-host-unresolvable", _set("server", "host", "no-such-host.invalid"), 2, "server.host"),
    ("http-host-not-here", _set("server", "http_host", "192.0.2.1"), 2, "server.http_host"),
    ("http-enabled-not-bool", _set("server", "http_enabled", "no"), 2, "server.http_enabled"),
    (
        "librdkafka-unknown-property",
        _client("no.such.property", 1),
        2,
        'kafka.client."no.such.property"',
    ),
    (
        "librdkafka-bad-value",
        _client("socket.timeout.ms", "soon"),
        2,
        'kafka.client."socket.timeout.ms"',
    ),
    ("librdkafka-reserved", _client("enable.auto.commit", True), 2, "enable.auto.commit"),
    ("librdkafka-inline-secret", _client("ssl.key.password", "hunter2"), 2, "ssl.key.password"),
    ("sasl-password-inline", _set("kafka", "sasl_password", "hunter2"), 2, "kafka.sasl_password"),
    (
        "sasl-password-env-unset",
        _set("kafka", "sasl_password", "env:TRIAGE_NO_SUCH_VAR"),
        2,
        "kafka.sasl_password",
    ),
    (
        "ack-deadline-nan",
        _set("delivery", "ack_deadline_s", float("nan")),
        2,
        "delivery.ack_deadline_s",
    ),
    (
        "max-attempts-over-uint32",
        _set("delivery", "max_attempts", 2**32),
        2,
        "delivery.max_attempts",
    ),
    ("frame-below-floor", _set("server", "max_frame_bytes", 1024), 2, "server.max_frame_bytes"),
    ("push-url-ftp", _push(url="ftp://h/"), 2, "push.orders.url"),
    ("push-url-no-host", _push(url="orders.internal/kafka"), 2, "push.orders.url"),
    ("push-url-bad-port", _push(url="http://h:70000/"), 2, "push.orders.url"),
    ("push-unknown-mode", _push(url="http://h/", mode="smtp"), 2, "push.orders.mode"),
    (
        "push-min-above-max",
        _push(url="http://h/", min_concurrency=9, max_concurrency=8),
        2,
        "push.orders.min_concurrency",
    ),
    (
        "push-batch-over-bytes",
        _push(url="http://h/", batch=500, max_batch_bytes=4096),
        2,
        "push.orders.batch",
    ),
    ("push-inline-token", _push(url="http://h/", token="hunter2"), 2, "push.orders.token"),
    ("push-unknown-key", _push(url="http://h/", urls="x"), 2, "push.orders.urls"),
    ("group-id-empty", _set("kafka", "group_id", ""), 2, "kafka.group_id"),
    ("group-id-too-long", _set("kafka", "group_id", "g" * 256), 2, "at most 255"),
    ("table-too-short", _set("dead_letters", "table", "d"), 2, "dead_letters.table"),
    ("table-with-slash", _set("dead_letters", "table", "dlq/x"), 2, "not a DynamoDB table"),
    ("bootstrap-empty", _set("kafka", "bootstrap_servers", ""), 2, "kafka.bootstrap_servers"),
    ("bootstrap-only-commas", _set("kafka", "bootstrap_servers", " , "), 2, "is empty"),
    ("broker-port-over-65535", _set("kafka", "bootstrap_servers", "h:70000"), 2, "1..65535"),
    ("broker-with-space", _set("kafka", "bootstrap_servers", "a b:1"), 2, "not a broker"),
    ("advertised-host-space", _set("server", "advertised_host", "a b"), 2, "advertised_host"),
    ("region-invalid", _set("dead_letters", "region", "us east 1"), 2, "dead_letters.region"),
    ("region-typo", _set("dead_letters", "region", "useast1"), 2, "like us-east-1"),
    ("port-overflows-with-partitions", _ports(65535, 0, 2), 2, "set server.port to at most"),
    ("http-port-overflows", _ports(0, 65000, 600), 2, "server.http_port"),
    ("unknown-section", _set("nope", "x", 1), 2, "unknown section"),
    ("unknown-key", _set("server", "hots", "x"), 2, "server.hots"),
]


@pytest.mark.parametrize(
    ("edit", "code", "names"),
    [pytest.param(edit, code, names, id=name) for name, edit, code, names in CONFIG_CASES],
)
def test_config_check_refuses_naming_the_cause(
    tmp_path: Path,
    pki: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    edit: Edit,
    code: int,
    names: str,
) -> None:
    monkeypatch.delenv("TRIAGE_NO_SUCH_VAR", raising=False)
    raw = base_config()
    sasl = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN"}
    edit(raw, pki)
    if "sasl_password" in raw["kafka"]:
        raw["kafka"].update(sasl)
    path = tmp_path / "triage.toml"
    path.write_bytes(tomli_w.dumps(raw).encode())
    path.chmod(0o600)
    result = CliRunner().invoke(app, ["config", "check", "--config", str(path)])
    assert result.exit_code == code, result.output
    assert names in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1  # one line, no traceback
    assert "Traceback" not in result.output
    assert "hunter2" not in result.output  # a secret is never quoted


def test_a_push_url_on_port_0_is_refused(tmp_path: Path, pki: dict[str, Path]) -> None:
    raw = base_config()
    _push(url="http://h:0/")(raw, pki)
    path = tmp_path / "triage.toml"
    path.write_bytes(tomli_w.dumps(raw).encode())
    path.chmod(0o600)
    result = CliRunner().invoke(app, ["config", "check", "--config", str(path)])
    assert result.exit_code == 2
    assert "push.orders.url" in result.stderr


def test_a_readable_config_with_inline_tokens_is_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "triage.toml"
    path.write_bytes(tomli_w.dumps(base_config()).encode())
    path.chmod(0o644)
    result = CliRunner().invoke(app, ["config", "check", "--config", str(path)])
    assert result.exit_code == 0
    assert "readable by others" in result.stderr
    assert "chmod 600" in result.stderr
    assert TOKEN not in result.output
    path.chmod(0o600)
    result = CliRunner().invoke(app, ["config", "check", "--config", str(path)])
    assert "readable by others" not in result.stderr


def _special(tmp: Path, kind: str) -> Path:
    """A path that is not a regular UTF-8 file: `kind` says what it is."""
    if kind == "fifo":
        path = tmp / "fifo"
        os.mkfifo(path)  # opening it for reading would block until a writer comes
        return path
    if kind == "directory":
        return tmp
    if kind == "device":
        return Path("/dev/zero")  # never ends
    path = tmp / "latin1.toml"
    text = tomli_w.dumps({**base_config(), "kafka": {**base_config()["kafka"], "topic": "é"}})
    path.write_bytes(text.replace("é", "orders").encode() + "# café\n".encode("latin-1"))
    return path


# (id, what the path is, which config key points at it, fragment of the message)
PATH_CASES: list[tuple[str, str, str, str]] = [
    ("config-is-a-fifo", "fifo", "<file>", "is a FIFO"),
    ("config-is-a-directory", "directory", "<file>", "is a directory"),
    ("config-is-a-device", "device", "<file>", "is a character device"),
    ("config-not-utf8", "latin1", "<file>", "is not UTF-8"),
    ("tls-cert-is-a-fifo", "fifo", "tls.cert_file", "is a FIFO"),
    ("tls-key-is-a-directory", "directory", "tls.key_file", "is a directory"),
    ("tls-cert-is-a-device", "device", "tls.cert_file", "is a character device"),
    ("tls-ca-is-a-fifo", "fifo", "tls.client_ca_file", "is a FIFO"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kind", "key", "names"), [pytest.param(k, c, n, id=i) for i, k, c, n in PATH_CASES]
)
def test_a_path_that_is_no_regular_file_is_refused_not_waited_on(
    tmp_path: Path, pki: dict[str, Path], kind: str, key: str, names: str
) -> None:
    special = _special(tmp_path, kind)
    raw = base_config()
    if key != "<file>":
        files = {"tls.cert_file": pki["cert"], "tls.key_file": pki["key"]}
        if key == "tls.client_ca_file":
            files[key] = pki["ca"]
        files[key] = special
        raw["tls"] = {k.split(".")[1]: str(v) for k, v in files.items()}
    config = tmp_path / "triage.toml"
    config.write_bytes(tomli_w.dumps(raw).encode())
    config.chmod(0o600)
    target = special if key == "<file>" else config
    result = CliRunner().invoke(app, ["config", "check", "--config", str(target)])
    assert result.exit_code == 2, result.output
    assert f"'{key}'" in result.stderr
    assert names in result.stderr
    assert "regular file" in result.stderr or "UTF-8" in result.stderr  # what to do


# --- the command line ---------------------------------------------------------------------

CLI_CASES: list[tuple[str, list[str], str, int, str]] = [
    ("init-eof-on-stdin", ["init", "--bootstrap-servers", "b:1"], "", 2, "stdin ended"),
    (
        "init-topic-with-hash",
        ["init", "--non-interactive", "--bootstrap-servers", "b:1", "--topic", "a#b"],
        "",
        2,
        "--topic",
    ),
    (
        "init-inline-sasl-password",
        [
            "init",
            "--non-interactive",
            "--bootstrap-servers",
            "b:1",
            "--security-protocol",
            "SASL_SSL",
            "--sasl-mechanism",
            "PLAIN",
            "--sasl-username",
            "u",
            "--sasl-password",
            "hunter2",
            "--topic",
            "t",
        ],
        "",
        2,
        "--sasl-password",
    ),
    (
        "init-bad-notify",
        [
            "init",
            "--non-interactive",
            "--bootstrap-servers",
            "b:1",
            "--topic",
            "t",
            "--notify",
            "carrier-pigeon",
            "--partitions",
            "1",
        ],
        "",
        2,
        "--notify",
    ),
    (
        "init-bad-app-name",
        [
            "init",
            "--non-interactive",
            "--bootstrap-servers",
            "b:1",
            "--topic",
            "t",
            "--partitions",
            "1",
            "--app-name",
            "a b",
        ],
        "",
        2,
        "--app-name",
    ),
    ("dev-topic-with-hash", ["dev", "--topic", "bad#"], "", 2, "--topic"),
    ("dev-push-not-http", ["dev", "--push", "ftp://h/"], "", 2, "'--push': must be an http"),
    ("dev-push-bad-port", ["dev", "--push", "http://h:70000/"], "", 2, "'--push'"),
    (
        "dev-push-batch-too-big",
        ["dev", "--push", "http://h/", "--push-batch", "20000"],
        "",
        2,
        "'--push-batch'",
    ),
    ("dev-push-batch-alone", ["dev", "--push-batch", "5"], "", 2, "--push-batch needs --push"),
    (
        "status-watch-and-json",
        ["status", "--config", "{config}", "--watch", "--json"],
        "",
        2,
        "--watch",
    ),
    (
        "config-check-missing-file",
        ["config", "check", "--config", "{missing}"],
        "",
        2,
        "does not exist",
    ),
]


@pytest.mark.parametrize(
    ("args", "stdin", "code", "names"),
    [pytest.param(a, i, c, n, id=name) for name, a, i, c, n in CLI_CASES],
)
def test_the_command_line_refuses_naming_the_cause(
    tmp_path: Path, args: list[str], stdin: str, code: int, names: str
) -> None:
    config = tmp_path / "triage.toml"
    config.write_bytes(tomli_w.dumps(base_config()).encode())
    values = {"config": str(config), "missing": str(tmp_path / "absent.toml")}
    args = [a.format(**values) for a in args]
    if args[0] == "init":
        args += ["--config", str(tmp_path / "new.toml")]
    result = CliRunner().invoke(app, args, input=stdin)
    assert result.exit_code == code, result.output
    assert names in result.output
    assert "hunter2" not in result.output


def test_dev_state_dir_that_is_a_file_is_bad_input(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    result = CliRunner().invoke(app, ["dev", "--state-dir", str(afile)])
    assert result.exit_code == 2
    assert "--state-dir" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_proxy_help_shows_the_auth_section() -> None:
    result = CliRunner().invoke(app, ["proxy", "--help"], env={"COLUMNS": "80"})
    assert "[auth]" in result.output


# --- the pure pieces ----------------------------------------------------------------------


def _frames(*frames: pb.ConsumerFrame | Exception) -> AsyncIterator[pb.ConsumerFrame]:
    async def gen() -> AsyncIterator[pb.ConsumerFrame]:
        for frame in frames:
            if isinstance(frame, Exception):
                raise frame
            yield frame

    return gen()


HELLO = pb.ConsumerFrame(hello=pb.Hello(consumer_id="c", credits=1))


@pytest.mark.parametrize(
    ("frames", "names"),
    [
        pytest.param([DecodeError("x")], "frame 1", id="garbage-first-frame"),
        pytest.param([HELLO, DecodeError("x")], "frame 2", id="garbage-after-hello"),
        pytest.param([HELLO, HELLO], "second Hello", id="second-hello"),
        pytest.param(
            [HELLO, pb.ConsumerFrame(settle=pb.Settle(acks=[0] * 2_000_000))],
            "settles at most 100000",
            id="settle-two-million-plain-acks",
        ),
        pytest.param(
            [HELLO, pb.ConsumerFrame(settle=pb.Settle(nacks=[pb.Nack(offset=0)] * 100_001))],
            "nacks together",
            id="settle-too-many-nacks",
        ),
        pytest.param(
            [HELLO, pb.ConsumerFrame(extend=pb.Extend(offsets=[0] * 100_001))],
            "an Extend names at most 100000",
            id="extend-too-many-offsets",
        ),
        pytest.param(
            [HELLO, pb.ConsumerFrame(release=pb.Release(offsets=[0] * 100_001))],
            "a Release names at most",
            id="release-too-many-offsets",
        ),
    ],
)
def test_frames_that_break_the_grammar_are_frame_errors(
    frames: list[pb.ConsumerFrame | Exception], names: str
) -> None:
    async def read_all() -> None:
        async for _ in checked_frames(_frames(*frames)):
            pass

    with pytest.raises(FrameError, match=names):
        asyncio.run(read_all())


def test_duplicate_offsets_in_one_extend_count_once() -> None:
    dispatcher, _tracker, _dead = make()
    dispatcher.add(records(0, 3))
    session = connect(dispatcher, "c", 10)
    dispatcher.extend(session, [0] * 100_000 + [1, 1, 2])
    assert dispatcher.counters.extended == 3


@pytest.mark.parametrize(
    ("snap", "why"),
    [
        pytest.param({"state": "running", "ready": True}, None, id="running"),
        pytest.param({"state": "standby", "ready": False}, "standby", id="standby"),
        pytest.param(
            {"state": "running", "ready": True, "degraded": ("log_end",)},
            BROKER_GONE,
            id="broker-gone-window-empty",
        ),
        pytest.param(
            {"state": "running", "ready": True, "degraded": ("fetch",), "in_window": 3},
            None,
            id="broker-gone-work-left",
        ),
    ],
)
def test_readiness_is_false_while_the_broker_is_gone_and_nothing_is_left(
    snap: dict[str, Any], why: str | None
) -> None:
    base: dict[str, Any] = {"topic": "t", "partition": 0, "alive": True, "grpc_port": 1}
    base.update({"window_max_messages": 1, "window_max_bytes": 1, "advertised_endpoint": ""})
    assert not_ready_because(ProxySnapshot(**base, **snap)) == why


@pytest.mark.parametrize(
    ("state", "member", "why"),
    [
        pytest.param("running", False, NOT_A_MEMBER, id="session-lost"),
        pytest.param("starting", False, "starting", id="not-joined-yet"),
    ],
)
def test_a_fleet_process_out_of_its_group_is_not_ready(state: str, member: bool, why: str) -> None:
    """A lost group session empties the assignment: serving "all of nothing" is not ready."""
    snap = ProcessSnapshot(topic="t", state=state, ready=False, alive=True, mode="fleet")
    assert not_ready_because(dataclasses.replace(snap, member=member)) == why


def test_the_throttle_policy_logs_first_then_counts() -> None:
    assert throttle_decision(None, 0, 100.0, 10.0).log
    counted = throttle_decision(100.0, 0, 105.0, 10.0)
    assert (counted.log, counted.suppressed) == (False, 1)
    again = throttle_decision(100.0, 7, 110.0, 10.0)
    assert (again.log, again.suppressed) == (True, 7)


def test_three_thousand_refusals_make_one_line_per_cause_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    throttle = LogThrottle(logging.getLogger("test.throttle"), 10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.throttle"):
        for _ in range(3000):
            throttle.warning("wrong token", "refused a call from %s", "ipv4:10.0.0.1:5")
        throttle.warning("other cause", "refused a stream from %s", "ipv4:10.0.0.2:6")
        now[0] = 11.0
        throttle.warning("wrong token", "refused a call from %s", "ipv4:10.0.0.1:5")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "10.0.0.1" in lines[0]
    assert "2999 more like it" in lines[2]


# --- the HTTP endpoint ----------------------------------------------------------------------

MALFORMED_HTTP = [
    b"GARBAGE\r\n\r\n",  # not a method
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",  # not a header
    b"\x16\x03\x01\x00\xa5\x01\x00",  # TLS on the HTTP port
]


@pytest.mark.parametrize("request_bytes", MALFORMED_HTTP, ids=["method", "header", "tls"])
def test_two_hundred_malformed_http_requests_make_one_line_and_no_traceback(
    caplog: pytest.LogCaptureFixture, request_bytes: bytes
) -> None:
    async def send_all() -> list[bytes]:
        async with HttpEndpoint(lambda: None, ("127.0.0.1", 0)) as endpoint:  # type: ignore[arg-type, return-value]
            answers = []
            for _ in range(200):
                reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
                writer.write(request_bytes)
                answers.append(await reader.read(64))
                writer.close()
            return answers

    with caplog.at_level(logging.DEBUG):
        answers = asyncio.run(send_all())
    assert all(a.startswith(b"HTTP/1.0 400") for a in answers)
    lines = [r for r in caplog.records if "malformed HTTP request" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].levelno == logging.WARNING
    assert not any(r.exc_info for r in caplog.records)
    assert b"GARBAGE" not in caplog.text.encode()  # the client's bytes are not logged


def test_an_idle_http_connection_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(endpoint_module, "KEEPALIVE_TIMEOUT_S", 0.3)

    async def idle() -> bytes:
        async with HttpEndpoint(lambda: None, ("127.0.0.1", 0)) as endpoint:  # type: ignore[arg-type, return-value]
            reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
            async with asyncio.timeout(5):
                got = await reader.read()  # b"": the endpoint closed it
            writer.close()
            return got

    assert asyncio.run(idle()) == b""


def test_revoking_a_name_revokes_its_token_under_every_name() -> None:
    from triage_proxy.config.sections import AuthSettings

    shared, other = "shared-token-0123456789", "other-token-0123456789"
    auth = AuthSettings(
        token=shared, tokens={"app": shared, "mirror": shared, "b": other}, revoked=("app",)
    )
    assert auth.active() == {"b": other}


def _write(path: Path, raw: dict[str, Any]) -> Path:
    path.write_text(tomli_w.dumps(raw))
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("layout", ["state-dir-of-another", "shared-default-folder"])
def test_destroy_refuses_another_deployments_state_and_touches_nothing(
    tmp_path: Path, layout: str
) -> None:
    """The folder's state.json records another config (a wrong --state-dir, or two configs
    side by side sharing `.triage/`): destroy exits 5 naming that deployment and the
    command that stops it, and deletes nothing. (A live one: tests/integration/
    test_init_deploy.py.)"""
    other = _write(tmp_path / "other.toml", base_config())
    mine_raw = base_config()
    mine_raw["kafka"]["group_id"] = "mine"
    folder = tmp_path / "mine" if layout == "state-dir-of-another" else tmp_path
    folder.mkdir(exist_ok=True)
    mine = _write(folder / "mine.toml", mine_raw)
    state = tmp_path / ".triage"
    state.mkdir()
    (state / "state.json").write_text(
        f'{{"config": "{other.resolve()}", "topic": "orders", "group_id": "g"}}\n'
    )
    (state / "supervisor.pid").write_text("999999999\n")  # dead: still not ours to remove
    args = ["destroy", "--target", "local", "--config", str(mine)]
    if layout == "state-dir-of-another":
        args += ["--state-dir", str(state)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 5, result.output
    assert "another deployment" in result.output
    assert f"--config {other.resolve()}" in result.output
    assert "deleted nothing" in result.output
    assert (state / "state.json").exists()
    assert (state / "supervisor.pid").exists()


def test_deploy_state_dir_that_is_a_file_is_bad_input(tmp_path: Path) -> None:
    config = base_config()
    config["kafka"]["partitions"] = 1
    config["server"]["port"] = 19999
    path = _write(tmp_path / "t.toml", config)
    afile = tmp_path / "afile"
    afile.write_text("x")
    result = CliRunner().invoke(
        app, ["deploy", "--target", "local", "-c", str(path), "--state-dir", str(afile)]
    )
    assert result.exit_code == 2, result.output
    assert "--state-dir" in result.output
    assert afile.read_text() == "x"
