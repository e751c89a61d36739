"""`triage init`, `triage config check`, `triage deploy/destroy --target local`, as users
run them: real processes against the real broker (Tansu) and AWS endpoint (moto server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from typer.testing import CliRunner

from tests.integration.harness import RawConsumer, create_topic, produce, wait_until
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port, free_port_block
from triage_cli.main import app
from triage_cli.supervisor import ProjectDir
from triage_proxy.config.loader import load_settings

pytestmark = pytest.mark.integration

TRIAGE = [sys.executable, "-m", "triage_cli.main"]


def run_triage(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TRIAGE, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def init_args(config: Path, bootstrap: str, topic: str, *extra: str) -> list[str]:
    return [
        "init",
        "--non-interactive",
        "--config",
        str(config),
        "--bootstrap-servers",
        bootstrap,
        "--topic",
        topic,
        *extra,
    ]


# --- init ---------------------------------------------------------------------------------


def test_init_discovers_partitions_and_writes_a_private_valid_config(
    tmp_path: Path, broker: EmbeddedBroker, unique_name: str
) -> None:
    create_topic(broker.bootstrap, unique_name, partitions=3)
    config = tmp_path / "triage.toml"
    out = run_triage(*init_args(config, broker.bootstrap, unique_name, "--app-name", "billing"))
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    settings = load_settings(config, env={})
    assert settings.kafka.partitions == 3
    token = settings.auth.tokens["billing"]
    assert len(token) >= 43  # 32 random bytes, url-safe base64
    assert token not in out.stdout + out.stderr
    assert "triage deploy --target local" in out.stdout
    assert "[auth.tokens] billing" in out.stdout
    assert settings.aws.proxies == 2  # min(partitions, 2): what deploy --target aws runs


def test_init_writes_aws_proxies_from_the_flag_or_the_partition_count(
    tmp_path: Path, unique_name: str
) -> None:
    closed = f"127.0.0.1:{free_port()}"
    one = tmp_path / "one.toml"
    out = run_triage(*init_args(one, closed, unique_name, "--partitions", "1"))
    assert out.returncode == 0, out.stderr
    assert load_settings(one, env={}).aws.proxies == 1
    four = tmp_path / "four.toml"
    flags = ["--partitions", "8", "--aws-proxies", "4"]
    out = run_triage(*init_args(four, closed, unique_name, *flags))
    assert out.returncode == 0, out.stderr
    assert load_settings(four, env={}).aws.proxies == 4
    out = run_triage(*init_args(tmp_path / "zero.toml", closed, unique_name, "--aws-proxies", "0"))
    assert out.returncode == 2


def test_init_unreachable_broker_needs_partitions(tmp_path: Path, unique_name: str) -> None:
    config = tmp_path / "triage.toml"
    closed = f"127.0.0.1:{free_port()}"
    out = run_triage(*init_args(config, closed, unique_name))
    assert out.returncode == 3
    assert "did not answer" in out.stderr
    assert "--partitions" in out.stderr
    assert not config.exists()
    out = run_triage(*init_args(config, closed, unique_name, "--partitions", "4"))
    assert out.returncode == 0, out.stderr
    assert load_settings(config, env={}).kafka.partitions == 4


def test_init_never_overwrites_without_force(tmp_path: Path, unique_name: str) -> None:
    config = tmp_path / "triage.toml"
    config.write_text("# mine\n")
    args = init_args(config, f"127.0.0.1:{free_port()}", unique_name, "--partitions", "1")
    out = run_triage(*args)
    assert out.returncode == 5
    assert "already exists" in out.stderr
    assert config.read_text() == "# mine\n"
    out = run_triage(*args, "--force")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "triage.toml.bak").read_text() == "# mine\n"
    assert load_settings(config, env={}).kafka.topic == unique_name


def test_init_refuses_an_inline_password(tmp_path: Path, unique_name: str) -> None:
    config = tmp_path / "triage.toml"
    sasl = ["--security-protocol", "SASL_SSL", "--sasl-mechanism", "PLAIN"]
    sasl += ["--sasl-username", "svc", "--sasl-password", "hunter2", "--partitions", "1"]
    out = run_triage(*init_args(config, f"127.0.0.1:{free_port()}", unique_name, *sasl))
    assert out.returncode == 2
    assert "--sasl-password" in out.stderr
    assert not config.exists()


def test_init_interactive_prompts(
    tmp_path: Path, broker: EmbeddedBroker, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts in order; an inline password is re-asked; an unresolvable reference means the
    broker cannot be asked, so the partition count is prompted for."""
    monkeypatch.delenv("TRIAGE_TEST_KAFKA_PW", raising=False)
    config = tmp_path / "triage.toml"
    answers = [
        broker.bootstrap,  # bootstrap servers
        "sasl_plaintext",  # security protocol (case-insensitive)
        "PLAIN",  # mechanism
        "svc",  # user name
        "hunter2",  # inline password: refused, asked again
        "env:TRIAGE_TEST_KAFKA_PW",
        unique_name,  # topic
        "",  # group: default
        "",  # table: default
        "",  # bucket: none
        "arn:aws:sns:us-east-1:000000000000:dlq",  # notify
        "",  # region: default
        "",  # endpoint: none
        "2",  # partitions (the broker could not be asked)
    ]
    result = CliRunner().invoke(app, ["init", "--config", str(config)], input="\n".join(answers))
    assert result.exit_code == 0, result.output
    assert "never hold it" in result.output
    settings = load_settings(config, env={})
    assert settings.kafka.security_protocol == "SASL_PLAINTEXT"
    assert settings.kafka.sasl_password == "env:TRIAGE_TEST_KAFKA_PW"
    assert settings.kafka.partitions == 2
    assert settings.kafka.group_id == f"triage-{unique_name}"
    assert settings.dead_letters.notify_sns_topic_arn == "arn:aws:sns:us-east-1:000000000000:dlq"
    assert "hunter2" not in config.read_text()


# --- config check -------------------------------------------------------------------------


def _good_config(tmp_path: Path, bootstrap: str, topic: str, *extra: str) -> Path:
    config = tmp_path / "triage.toml"
    out = run_triage(*init_args(config, bootstrap, topic, *extra))
    assert out.returncode == 0, out.stderr
    return config


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        ("[kafka]", "kafka.bogus"),
        ("[server]", "server.port"),
        ("[dead_letters]", "dead_letters.batch_size"),
    ],
)
def test_config_check_names_the_offending_key(
    tmp_path: Path, broker: EmbeddedBroker, topic: str, edit: str, key: str
) -> None:
    config = _good_config(tmp_path, broker.bootstrap, topic)
    ok = run_triage("config", "check", "--config", str(config))
    assert ok.returncode == 0, ok.stderr
    assert "OK" in ok.stdout
    assert "consumer" in ok.stdout
    assert load_settings(config).auth.tokens["consumer"] not in ok.stdout
    bad = {
        "kafka.bogus": 'bogus = "x"',
        "server.port": 'port = "7700"',
        "dead_letters.batch_size": "batch_size = 100",
    }[key]
    text = config.read_text().replace(edit, f"{edit}\n{bad}", 1)
    if key == "server.port":
        text = text.replace("port = 7700\n", "", 1)
    config.write_text(text)
    out = run_triage("config", "check", "--config", str(config))
    assert out.returncode == 2
    assert key in out.stderr


def test_config_check_connect(
    tmp_path: Path, broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str
) -> None:
    config = _good_config(tmp_path, broker.bootstrap, topic, "--endpoint-url", aws.endpoint_url)
    out = run_triage("config", "check", "--config", str(config), "--connect")
    assert out.returncode == 4  # the table does not exist yet
    assert "does not exist" in out.stderr or "not found" in out.stderr.lower()
    from triage_proxy.store.provisioning import create_table

    create_table(load_settings(config).dead_letters)
    out = run_triage("config", "check", "--config", str(config), "--connect")
    assert out.returncode == 0, out.stderr
    assert "reachable" in out.stdout


# --- deploy / destroy --target local ------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Deployment:
    """A local deployment under test; remembers every pid it saw so the fixture can kill
    anything left (by pid) even when the test fails."""

    def __init__(self, config: Path, state_dir: Path | None = None) -> None:
        self.config = config
        self.project = ProjectDir.for_config(config.resolve(), state_dir)
        self.seen: set[int] = set()

    def args(self) -> list[str]:
        """--config (and --state-dir when not the default) for deploy and destroy."""
        args = ["--target", "local", "--config", str(self.config)]
        if self.project.root != ProjectDir.for_config(self.config.resolve()).root:
            args += ["--state-dir", str(self.project.root)]
        return args

    def state(self) -> dict[str, Any]:
        state = self.project.read_state() or {}
        entries = [*state.get("partitions", []), *state.get("proxies", [])]
        self.seen.update(int(e["pid"]) for e in entries if e.get("pid"))
        if state.get("supervisor_pid"):
            self.seen.add(int(state["supervisor_pid"]))
        return state

    def entries(self) -> list[dict[str, Any]]:
        """The supervised processes: a fleet's per slot, a pinned layout's per partition."""
        state = self.state()
        return list(state["proxies"] if state["mode"] == "fleet" else state["partitions"])

    def pids(self) -> dict[int, int]:
        """Pid by slot (a fleet) or by partition (pinned)."""
        key = "slot" if self.state()["mode"] == "fleet" else "partition"
        return {int(e[key]): int(e["pid"]) for e in self.entries() if e["pid"]}

    def supervisor_pid(self) -> int:
        pid = self.project.read_pid(self.project.supervisor_pid_file)
        assert pid is not None
        self.seen.add(pid)
        return pid

    def kill_leftovers(self) -> None:
        for path in self.project.root.glob("*.pid"):
            pid = self.project.read_pid(path)
            if pid is not None:
                self.seen.add(pid)
        marker = str(self.config.resolve())
        for pid in self.seen:
            with contextlib.suppress(psutil.Error):
                if marker in " ".join(psutil.Process(pid).cmdline()):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def deployment(
    tmp_path: Path, broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> Iterator[Deployment]:
    """`triage init` for a 2-partition topic, with a short ownership lease and drain."""
    create_topic(broker.bootstrap, unique_name, partitions=2)
    ports = ["--port", str(free_port_block(2)), "--http-port", str(free_port_block(2))]
    config = _good_config(
        tmp_path, broker.bootstrap, unique_name, "--endpoint-url", aws.endpoint_url, *ports
    )
    with config.open("a") as out:
        out.write("\n[ownership]\nlease_s = 3.0\n\n[shutdown]\ndrain_timeout_s = 3.0\n")
        out.write("\n[commit]\ninterval_s = 0.2\n")
    found = Deployment(config)
    try:
        yield found
    finally:
        found.kill_leftovers()


async def _consume_from(
    endpoint: str, token: str, partition: int, value: bytes, timeout: float = 40
) -> None:
    """A topic-level Consumer given any process of the deployment, on `partition` only,
    until `value` is delivered (Topology finds the process that serves it, wherever the
    group put it)."""
    from triage_client import Consumer, Message

    seen = asyncio.Event()

    async def handle(message: Message) -> None:
        if message.value == value:
            seen.set()

    consumer = Consumer(endpoint, token, handle, partitions=[partition], max_backoff=0.5)
    task = asyncio.create_task(consumer.run_async())
    try:
        await asyncio.wait_for(seen.wait(), timeout)
        await asyncio.sleep(0.3)  # let the ack reach the proxy
    except TimeoutError:
        raise AssertionError(f"{value!r} never delivered through {endpoint}") from None
    finally:
        consumer.stop()
        await asyncio.wait_for(task, 30)


async def _consume_one(target: str, token: str, value: bytes, timeout: float = 30) -> None:
    """Connect (retrying while the proxy is not serving yet) until `value` is delivered."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            async with RawConsumer(target, token) as consumer:
                while True:
                    [delivery] = await consumer.receive(1, timeout=deadline - loop.time())
                    consumer.settle(acks=[delivery.offset])
                    if delivery.value == value:
                        await asyncio.sleep(0.3)  # let the ack reach the proxy
                        return
        except (EOFError, Exception) as exc:
            if loop.time() > deadline:
                raise AssertionError(f"{value!r} never delivered by {target}") from exc
            await asyncio.sleep(0.3)


@pytest.mark.slow
def test_deploy_local_supervises_and_destroy_stops_everything(
    deployment: Deployment, broker: EmbeddedBroker
) -> None:
    """The default: a fleet of min(partitions, cores) processes sharing the partitions."""
    config = deployment.config
    settings = load_settings(config)
    token = settings.auth.tokens["consumer"]
    out = run_triage("deploy", "--target", "local", "--config", str(config))
    deployment.state()
    assert out.returncode == 0, out.stderr + out.stdout
    assert "consumer" in out.stdout
    assert token not in out.stdout + out.stderr
    assert deployment.state()["mode"] == "fleet"
    processes = min(2, os.cpu_count() or 1)
    assert f"a fleet of {processes} proxies" in out.stdout
    pids = deployment.pids()
    supervisor = deployment.supervisor_pid()
    assert sorted(pids) == list(range(processes))
    assert all(_alive(pid) for pid in [*pids.values(), supervisor])

    endpoint = f"127.0.0.1:{settings.server.port}"  # slot 0: any process answers Topology
    for p in (0, 1):
        produce(broker.bootstrap, settings.kafka.topic, [(None, f"first-{p}".encode(), None)], p)
        asyncio.run(_consume_from(endpoint, token, p, f"first-{p}".encode()))

    again = run_triage("deploy", "--target", "local", "--config", str(config))
    assert again.returncode == 5
    assert "is running" in again.stderr

    os.kill(pids[0], signal.SIGKILL)
    restarted = wait_until(lambda: deployment.pids().get(0, pids[0]) != pids[0], timeout=20)
    assert restarted, "the supervisor did not restart the killed proxy"
    new_pid = deployment.pids()[0]
    assert _alive(new_pid)
    assert not _alive(pids[0])
    for p in (0, 1):  # served again, by the restarted process or by the other one
        produce(broker.bootstrap, settings.kafka.topic, [(None, b"after-restart", None)], p)
        asyncio.run(_consume_from(endpoint, token, p, b"after-restart", timeout=60))
    assert deployment.entries()[0]["restarts"] == 1

    everything = [supervisor, new_pid, *pids.values()]
    out = run_triage("destroy", "--target", "local", "--config", str(config))
    assert out.returncode == 0, out.stderr
    assert wait_until(lambda: not any(_alive(pid) for pid in everything), timeout=10)
    assert not list(deployment.project.root.glob("*.pid"))
    for log in deployment.project.root.glob("*.log"):
        assert token not in log.read_text()
    out = run_triage("destroy", "--target", "local", "--config", str(config))
    assert out.returncode == 0
    assert "nothing deployed" in out.stdout


@pytest.mark.slow
def test_deploy_local_pinned_runs_one_process_per_partition(
    deployment: Deployment, broker: EmbeddedBroker
) -> None:
    """--pinned: the layout from before fleets, each partition at server.port + p."""
    config = deployment.config
    settings = load_settings(config)
    token = settings.auth.tokens["consumer"]
    out = run_triage("deploy", "--target", "local", "--config", str(config), "--pinned")
    try:
        assert out.returncode == 0, out.stderr + out.stdout
        assert deployment.state()["mode"] == "pinned"
        pids = deployment.pids()
        assert sorted(pids) == [0, 1]
        targets = {p: f"127.0.0.1:{settings.server.port + p}" for p in (0, 1)}
        for p in (0, 1):
            value = f"pinned-{p}".encode()
            produce(broker.bootstrap, settings.kafka.topic, [(None, value, None)], p)
            asyncio.run(_consume_one(targets[p], token, value))
        # A token added to the file is accepted by every proxy after one SIGHUP to the
        # supervisor, which passes it on (docs/guides/security.md), restarting nothing.
        rotated = "rotated-" + secrets.token_urlsafe(24)
        line = f'consumer = "{token}"\n'
        assert line in config.read_text()
        config.write_text(config.read_text().replace(line, f'{line}next = "{rotated}"\n'))
        os.kill(deployment.supervisor_pid(), signal.SIGHUP)
        for p in (0, 1):
            value = f"rotated-{p}".encode()
            produce(broker.bootstrap, settings.kafka.topic, [(None, value, None)], p)
            asyncio.run(_consume_one(targets[p], rotated, value))
        assert deployment.pids() == pids
        assert "SIGHUP passed on to 2 proxies" in deployment.project.supervisor_log.read_text()
        both = run_triage(
            "deploy", "--target", "local", "--config", str(config), "--pinned", "--proxies", "2"
        )
        assert both.returncode == 2
        assert "--pinned and --proxies" in both.stderr
    finally:
        out = run_triage("destroy", "--target", "local", "--config", str(config))
    assert out.returncode == 0, out.stderr
    assert wait_until(lambda: not any(_alive(pid) for pid in pids.values()), timeout=10)


@pytest.mark.slow
def test_destroy_cleans_up_after_a_dead_supervisor(deployment: Deployment) -> None:
    config = deployment.config
    out = run_triage("deploy", "--target", "local", "--config", str(config))
    assert out.returncode == 0, out.stderr + out.stdout
    pids = list(deployment.pids().values())
    supervisor = deployment.supervisor_pid()
    os.kill(supervisor, signal.SIGKILL)
    assert wait_until(lambda: not _alive(supervisor), timeout=10)
    logs = {p.name: p.read_text()[-2000:] for p in deployment.project.root.glob("*.log")}
    assert all(_alive(pid) for pid in pids), logs  # orphans now
    out = run_triage("destroy", "--target", "local", "--config", str(config))
    assert out.returncode == 0, out.stderr
    assert "not running" in out.stderr, out.stdout + out.stderr
    assert wait_until(lambda: not any(_alive(pid) for pid in pids), timeout=10), out.stdout
    assert json.dumps(deployment.project.read_state()) == "null"


def test_deploy_reports_a_proxy_that_cannot_start(deployment: Deployment) -> None:
    """A proxy that exits on a config error (its exit 2) is given up at once (no restart
    loop); deploy says so, exits 2 like the proxy (a config error, not an outage), and
    leaves nothing running: pid files and state.json removed, the logs kept."""
    with deployment.config.open("a") as config:
        config.write('\n[tls]\ncert_file = "/nonexistent/c.pem"\nkey_file = "/nonexistent/k.pem"\n')
    out = run_triage("deploy", "--target", "local", "--config", str(deployment.config))
    assert out.returncode == 2, out.stderr
    assert "given up (last exit status 2)" in out.stderr
    assert "tls." in out.stderr  # the cause, from the proxy's log
    assert "the proxy in slot " in out.stderr  # the default is a fleet: named by slot
    assert "proxy-" in out.stderr  # points at the log
    assert not list(deployment.project.root.glob("*.pid"))
    assert not deployment.project.state_file.exists()
    assert "giving it up" in deployment.project.supervisor_log.read_text()
    assert list(deployment.project.root.glob("proxy-*.log"))
    assert not any(_alive(pid) for pid in deployment.seen)


@pytest.mark.slow
def test_a_second_deployment_whose_ports_are_taken_fails_naming_the_cause(
    deployment: Deployment, tmp_path: Path
) -> None:
    """Issue 10: the same config deployed again with another --state-dir. Its proxies
    cannot bind the ports the first deployment holds; the first deployment's answers on
    those ports are not the second one's readiness, so deploy names the cause and exits 2:
    the proxy exited 2 (a port in use is a config error to fix, not an outage)."""
    first = run_triage("deploy", *deployment.args())
    deployment.state()
    assert first.returncode == 0, first.stderr + first.stdout
    first_pids = deployment.pids()
    second = Deployment(deployment.config, tmp_path / "second")
    try:
        out = run_triage("deploy", *second.args())
        second.state()
        assert out.returncode == 2, out.stdout + out.stderr
        assert "Deployed" not in out.stdout
        http_port = load_settings(deployment.config).server.http_port
        assert "given up" in out.stderr
        assert "in use" in out.stderr.lower(), out.stderr
        assert any(f":{http_port + p}" in out.stderr for p in (0, 1)), out.stderr
        assert "proxy-" in out.stderr  # points at the log
        assert not list(second.project.root.glob("*.pid"))
        assert not any(_alive(pid) for pid in second.seen - set(first_pids.values()))
        assert deployment.pids() == first_pids  # the first one is untouched
        assert all(_alive(pid) for pid in first_pids.values())
    finally:
        second.kill_leftovers()
        run_triage("destroy", *deployment.args())


def test_destroy_aws_asks_before_deleting(tmp_path: Path) -> None:
    config = tmp_path / "triage.toml"
    result = CliRunner().invoke(
        app, ["destroy", "--target", "aws", "--config", str(config)], input="n\n"
    )
    assert result.exit_code == 1
    assert "nothing was deleted" in result.output


@pytest.mark.slow
def test_destroy_with_another_deployments_state_dir_refuses_and_stops_nothing(
    deployment: Deployment, tmp_path: Path
) -> None:
    """A bad-input row: `destroy --config B --state-dir <A's folder>` (and B side by side
    with A, sharing `.triage/`) must not stop A, delete its state or orphan its proxies:
    exit 5 naming A and the command that stops it. A's own destroy still works after."""
    first = run_triage("deploy", *deployment.args())
    assert first.returncode == 0, first.stderr + first.stdout
    pids = deployment.pids()
    supervisor = deployment.supervisor_pid()
    other = tmp_path / "other" / "other.toml"
    other.parent.mkdir()
    other.write_text(deployment.config.read_text())
    other.chmod(0o600)
    beside = deployment.config.with_name("beside.toml")  # shares the default .triage/
    beside.write_text(other.read_text())
    beside.chmod(0o600)
    for args in (
        ["--config", str(other), "--state-dir", str(deployment.project.root)],
        ["--config", str(beside)],
    ):
        out = run_triage("destroy", "--target", "local", *args)
        assert out.returncode == 5, out.stdout + out.stderr
        assert "another deployment" in out.stderr
        assert f"--config {deployment.config.resolve()}" in out.stderr
        assert "Destroyed" not in out.stdout
        assert all(_alive(pid) for pid in [supervisor, *pids.values()])
        assert deployment.pids() == pids
        assert deployment.project.supervisor_pid_file.exists()
    # deploying the side-by-side config into the live folder is refused the same way
    out = run_triage("deploy", "--target", "local", "--config", str(beside))
    assert out.returncode == 5, out.stdout + out.stderr
    assert "another deployment" in out.stderr
    assert deployment.pids() == pids
    out = run_triage("destroy", *deployment.args())
    assert out.returncode == 0, out.stderr
    assert wait_until(lambda: not any(_alive(p) for p in [supervisor, *pids.values()]), 15)
