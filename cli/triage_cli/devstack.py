"""Everything `triage dev` runs on one machine, owned by one object.

Start order: broker -> AWS endpoint -> topic and dead-letter table -> config file
-> one proxy process per partition. Stop order is the reverse, each process by
PID (SIGTERM, then SIGKILL after a grace period), so nothing outlives the stack; a
temporary state folder (no --state-dir, no --keep-state) is removed after a clean stop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from triage_cli.embedded import (
    HOST,
    EmbeddedAWS,
    EmbeddedBroker,
    free_port_block,
    stop_process,
    wait_for_port,
)
from triage_cli.signals import stop_on_signals, stop_signals_held
from triage_cli.supervisor import proxy_command
from triage_proxy.errors import ConfigError, StateError, UnavailableError

if TYPE_CHECKING:
    from triage_proxy.config.sections import ServerSettings

logger = logging.getLogger(__name__)

TABLE = "triage-dead-letters"
BUCKET = "triage-dead-letters-overflow"
PROXY_START_TIMEOUT_S = 30.0
PROXY_STOP_TIMEOUT_S = 15.0


def write_config(path: Path, values: dict[str, Any]) -> None:
    """Write the TOML config readable only by its owner (it holds a token)."""
    import tomli_w

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        tomli_w.dump(values, out)


def command(name: str) -> str:
    """`name` from this interpreter's folder (the venv's bin/), shown relative when
    under the current folder (`.venv/bin/triage`): what a person pastes works whether
    or not they activated the venv."""
    bindir = Path(sys.executable).parent
    with contextlib.suppress(ValueError):
        bindir = bindir.relative_to(Path.cwd())
    return str(bindir / name)


class DevStack:
    """Tansu + moto server + proxies for `topic`, on loopback ports."""

    def __init__(
        self,
        topic: str = "triage-dev",
        partitions: int = 1,
        state_dir: Path | None = None,
        proxy_overrides: dict[str, Any] | None = None,
        start_proxies: bool = True,
        *,
        keep_state: bool = False,
    ) -> None:
        from triage_proxy.config.validation import topic_problem

        problem = topic_problem(topic)
        if problem is not None:
            raise ConfigError("--topic", problem)
        if state_dir is not None and state_dir.exists() and not state_dir.is_dir():
            raise ConfigError("--state-dir", f"{state_dir} exists and is not a folder")
        self.topic = topic
        self.partitions = partitions
        self._temporary = state_dir is None and not keep_state
        """The state folder is ours to remove after a clean stop (it holds the dev token)."""
        self.state_dir = state_dir or Path(tempfile.mkdtemp(prefix="triage-dev-"))
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("--state-dir", f"cannot create {self.state_dir}: {exc}") from None
        self.table = TABLE
        self.token = secrets.token_urlsafe(32)
        self.config_path = self.state_dir / "triage.toml"
        self.broker = EmbeddedBroker(self.state_dir / "broker.log")
        self.aws = EmbeddedAWS(self.state_dir / "moto.log")
        self.proxy_ports: list[int] = []
        self._overrides = proxy_overrides or {}
        self._proxies: list[subprocess.Popen[bytes]] = []
        self._console: subprocess.Popen[str] | None = None
        self.console_url: str | None = None
        """The web console's login URL (`start_console`), None when it does not run."""
        self._started = False
        self._start_proxies = start_proxies
        """False: broker, endpoint, topic, table and config only (benchmarks run their own)."""

    @property
    def group_id(self) -> str:
        return f"triage-{self.topic}"

    def config_values(self, base_port: int) -> dict[str, Any]:
        values: dict[str, Any] = {
            "kafka": {
                "bootstrap_servers": self.broker.bootstrap,
                "topic": self.topic,
                "group_id": self.group_id,
            },
            # gRPC on base_port + p, the HTTP endpoint (metrics, status) right after them.
            "server": {"host": HOST, "port": base_port, "http_port": base_port + self.partitions},
            "auth": {"token": self.token},
            "dead_letters": {
                "table": self.table,
                "endpoint_url": self.aws.endpoint_url,
                "overflow_bucket": BUCKET,
            },
        }
        for section, table in self._overrides.items():
            if isinstance(table, list):  # an array of tables ([[push]])
                values[section] = table
            else:
                values.setdefault(section, {}).update(table)
        return values

    def start(self) -> None:
        if self._started:
            raise StateError("dev stack already started")
        self._started = True
        try:
            self.broker.start()
            self.aws.start()
            self._create_topic()
            self._create_table()
            base = free_port_block(2 * self.partitions)  # gRPC ports, then HTTP ports
            write_config(self.config_path, self.config_values(base))
            for partition in range(self.partitions if self._start_proxies else 0):
                self.start_proxy(partition)
        except BaseException:
            self.stop()
            raise

    def _create_topic(self) -> None:
        from confluent_kafka.admin import AdminClient
        from confluent_kafka.cimpl import NewTopic

        from triage_proxy.kafka.logs import KafkaLog

        # quiet: a failure raises from the future below, and is reported once, there
        admin = AdminClient(
            {"bootstrap.servers": self.broker.bootstrap, **KafkaLog(quiet=True).config()}
        )
        futures = admin.create_topics([NewTopic(self.topic, self.partitions, 1)])
        for future in futures.values():
            future.result(timeout=30)

    def _create_table(self) -> None:
        from triage_proxy.config.sections import DeadLetterSettings
        from triage_proxy.store.provisioning import create_bucket, create_table

        settings = DeadLetterSettings(
            table=self.table, endpoint_url=self.aws.endpoint_url, overflow_bucket=BUCKET
        )
        create_table(settings)
        create_bucket(settings)

    def start_proxy(self, partition: int) -> subprocess.Popen[bytes]:
        """Start (or restart) the proxy process for `partition` and wait until it listens."""
        from triage_proxy.config.loader import load_settings
        from triage_proxy.store.aws import read_secret

        port = load_settings(self.config_path, fetch_secret=read_secret).server.port + partition
        log = open(self.state_dir / f"proxy-{partition}.log", "ab")  # noqa: SIM115
        with log:
            proc = subprocess.Popen(
                proxy_command(self.config_path, partition),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        if partition < len(self._proxies):
            self._proxies[partition] = proc
            self.proxy_ports[partition] = port
        else:
            self._proxies.append(proc)
            self.proxy_ports.append(port)
        wait_for_port(HOST, port, PROXY_START_TIMEOUT_S, proc)
        return proc

    def proxy_process(self, partition: int) -> subprocess.Popen[bytes]:
        return self._proxies[partition]

    def stop_proxy(self, partition: int, sig: int = signal.SIGTERM) -> int | None:
        """Signal the proxy by PID and wait for it; SIGKILL after the grace period."""
        proc = self._proxies[partition]
        if stop_process(proc, PROXY_STOP_TIMEOUT_S, signum=sig):
            logger.warning("proxy %d did not stop in time; killed it", partition)
        return proc.returncode

    def start_console(self, port: int) -> str:
        """Serve `triage console` on this stack's config (a child process, stopped with
        the stack); returns its login URL."""
        from triage_cli.console.command import spawn_console

        if self._console is not None:
            raise StateError("the console already runs")
        self._console, self.console_url = spawn_console(
            self.config_path, port, self.state_dir / "console.log"
        )
        return self.console_url

    def _stop_console(self) -> None:
        proc, self._console = self._console, None
        if proc is None:
            return
        stop_process(proc, PROXY_STOP_TIMEOUT_S)
        if proc.stdout is not None:
            proc.stdout.close()

    def stop(self) -> None:
        """Stop every process this stack started, the console and proxies first; safe twice.
        A second Ctrl-C meanwhile changes nothing (each stop is bounded)."""
        with stop_signals_held():
            self._stop_console()
            for partition in range(len(self._proxies)):
                self.stop_proxy(partition)
            self.aws.stop()
            self.broker.stop()

    def __enter__(self) -> DevStack:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        clean = exc_type is None or issubclass(exc_type, KeyboardInterrupt)
        if clean and self._temporary:
            # Logs and the config with the dev token go; after a failure they stay, so
            # the message pointing at a log still points at something.
            shutil.rmtree(self.state_dir, ignore_errors=True)

    # --- for people and scripts -------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """What a person or a script needs: the stack's addresses, the token, and
        `endpoint`, the one address a `Consumer` is given (any proxy answers Topology:
        here partition 0's, as the config advertises it). Each proxy's `http` is where
        it answers `/status`, `/metrics` and `/readyz` (None with the endpoint off)."""
        server = self._server_settings()
        endpoint = None
        if self.proxy_ports:
            endpoint = server.advertised_endpoint(0, self.proxy_ports[0])
        proxies = []
        for partition, port in enumerate(self.proxy_ports):
            address = server.http_address(partition)
            http = None if address is None else f"http://{address[0]}:{address[1]}"
            proxies.append({"partition": partition, "target": f"{HOST}:{port}", "http": http})
        return {
            "bootstrap": self.broker.bootstrap,
            "dynamodb_endpoint": self.aws.endpoint_url,
            "topic": self.topic,
            "table": self.table,
            "token": self.token,
            "config": str(self.config_path),
            "endpoint": endpoint,
            "proxies": proxies,
            "push": self.describe_push(server),
            "console": self.console_url,
        }

    def _server_settings(self) -> ServerSettings:
        from triage_proxy.config.loader import load_settings
        from triage_proxy.store.aws import read_secret

        return load_settings(self.config_path, fetch_secret=read_secret).server

    def describe_push(self, server: ServerSettings) -> list[dict[str, Any]]:
        """The `[[push]]` targets the proxies deliver to. A registration target (mode
        "grpc") names where a consumer registers: each proxy's `GET /consumers` (a
        consumer gets the records of the partitions of the proxy it registered with),
        with the raw token as `Authorization` and its own port as `grpcport`."""
        tables = self._overrides.get("push") or []
        if not tables:
            return []
        out: list[dict[str, Any]] = []
        for table in tables:
            if table.get("mode", "http") == "http":
                out.append(
                    {
                        "name": table["name"],
                        "mode": "http",
                        "url": table["url"],
                        "batch": table.get("batch", 1),
                    }
                )
                continue
            urls = []
            for partition in range(len(self.proxy_ports)):
                address = server.http_address(partition)
                if address is not None:
                    urls.append(f"http://{address[0]}:{address[1]}/consumers")
            out.append(
                {
                    "name": table["name"],
                    "mode": "grpc",
                    "registration": urls,
                    "authorization": self.token,
                }
            )
        return out

    def describe_json(self) -> str:
        return json.dumps(self.describe(), separators=(", ", ": "))

    def print_endpoints(self) -> None:
        from rich.console import Console
        from rich.table import Table

        info = self.describe()
        table = Table(title="triage dev", show_header=False)
        table.add_row("Kafka bootstrap", info["bootstrap"])
        table.add_row("DynamoDB endpoint", info["dynamodb_endpoint"])
        table.add_row("topic / table", f"{info['topic']} / {info['table']}")
        table.add_row("token", info["token"])
        table.add_row("config", info["config"])
        table.add_row("consumer endpoint", str(info["endpoint"]))
        for proxy in info["proxies"]:
            table.add_row(f"proxy partition {proxy['partition']}", proxy["target"])
            if proxy["http"]:
                table.add_row("  status, metrics", f"{proxy['http']}/status, /metrics")
        for push in info["push"]:
            if push["mode"] == "http":
                table.add_row(f"push {push['name']}", f"{push['url']} (batch {push['batch']})")
            else:
                for url in push["registration"]:
                    table.add_row(f"push {push['name']} registers at", url)
        console = Console(stderr=True)
        console.print(table)
        hint = ""
        for push in info["push"]:
            if push["mode"] == "grpc" and push["registration"]:
                each = (
                    " each proxy (it gets that proxy's partitions)"
                    if len(push["registration"]) > 1
                    else ""
                )
                hint = (
                    "A consumer of the original Triage (triage.MessageHandler on PORT) "
                    f"registers with{each}:\n"
                    f"  curl -H 'Authorization: {push['authorization']}' -H 'grpcport: PORT' "
                    f"{push['registration'][0]}\n"
                )
        if info["push"]:
            hint += (
                f"{command('triage')} status --config {info['config']} shows each push "
                "target's limit, latency and errors.\n"
            )
        if info["console"]:
            hint += f"Web console (opening the URL logs you in):\n  {info['console']}\n"
        else:
            hint += (
                f"Web console: {command('triage')} console -c {info['config']}  "
                "(or triage dev --console)\n"
            )
        # Plain print, never wrapped: these lines are meant to be copied as they are.
        print(hint + self.next_steps(info), file=sys.stderr, flush=True)
        console.print("Ctrl-C stops everything.")

    @staticmethod
    def next_steps(info: dict[str, Any]) -> str:
        """What docs/getting-started.md has a newcomer run next, with this stack's values:
        the environment a consumer reads, and a test message to produce. With push
        targets, no consumer: the proxies deliver to them."""
        env = " ".join(
            f"{name}={shlex.quote(str(info[key]))}"
            for name, key in (
                ("TRIAGE_ENDPOINT", "endpoint"),
                ("TRIAGE_TOKEN", "token"),
                ("TRIAGE_CONFIG", "config"),
            )
        )
        lines = ["In another terminal (docs/getting-started.md):", f"  export {env}"]
        if not info["push"]:
            lines.append(f"  {command('python')} consumer.py")
        lines.append(
            f'  {command("triage")} produce -c "$TRIAGE_CONFIG" --key order-1 --value hello'
        )
        return "\n".join(lines)

    def wait_for_signal(self) -> None:
        """Block until SIGINT or SIGTERM, then stop the stack; or raise when a proxy
        process dies. The stop runs before the handler goes, so a second signal that
        comes meanwhile only sets `stop` again."""
        with stop_on_signals() as stop:
            while not stop.wait(0.5):
                for partition, proc in enumerate(self._proxies):
                    if proc.poll() is not None:
                        raise UnavailableError(
                            f"proxy for partition {partition} exited with {proc.returncode}; "
                            f"see {self.state_dir / f'proxy-{partition}.log'}"
                        )
            self.stop()
