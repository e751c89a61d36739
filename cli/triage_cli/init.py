"""`triage init` writes a config file; `triage config check` validates one.

Why a wizard: a proxy config carries a token and Kafka credentials, so the easy way to
write one must also be the safe way. `init` asks for (or takes as flags) the Kafka
connection, the topic and the dead-letter targets (and, with `--push URL`, an HTTP
endpoint the proxies deliver to: a `[[push]]` table), asks the broker how many partitions
the topic has, generates a strong named token, validates the whole file with the same
`settings_from_dict` the proxy uses, and writes it atomically with mode 0600 (created so,
never chmod-ed after, so it is never readable by others even for an instant).

Rules it keeps:
- A Kafka password is only ever a reference ("env:VAR" or "secret:NAME"); an inline
  value is refused.
- An existing file is never overwritten unless `--force`, which keeps it as `FILE.bak`
  (also 0600: it holds a token too).
- Unreachable broker: interactive mode says so and asks for the partition count;
  `--non-interactive` exits with UNAVAILABLE unless `--partitions` is given (a script
  should not silently deploy the wrong number of proxies).

Exit codes (`exitcodes.ExitCode`): 2 bad input (the message names the flag or key);
3 broker unreachable (non-interactive, no --partitions); 5 the file already exists.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from triage_cli.exitcodes import CommandFailed, ExitCode, exit_on_errors
from triage_cli.helptext import plain

if TYPE_CHECKING:
    from triage_proxy.config.push import PushTargetSettings
    from triage_proxy.config.settings import Settings

DEFAULT_CONFIG = Path("triage.toml")
DEFAULT_APP_NAME = "consumer"
DISCOVERY_TIMEOUT_S = 5.0
TOKEN_BYTES = 32


def _say(message: str) -> None:
    typer.echo(message, err=True)


# --- the questions ------------------------------------------------------------------------


class _Asker:
    """Takes each answer from its flag, else prompts, else (non-interactive) fails or
    uses the default, so one code path serves people and scripts."""

    def __init__(self, interactive: bool) -> None:
        self.interactive = interactive

    def prompt(self, prompt: str, **options: Any) -> Any:
        """typer.prompt, except that the end of stdin is bad input (exit 2, naming the
        question), not an interrupt: click reports both as Abort, so a stop signal is
        told apart by the handler that sees it."""
        from triage_cli.signals import on_stop_signals

        interrupted = False

        def stop() -> None:
            nonlocal interrupted
            interrupted = True
            raise KeyboardInterrupt

        with on_stop_signals(stop):
            try:
                return typer.prompt(prompt, err=True, **options)
            except typer.Abort:
                if interrupted:
                    raise
                raise CommandFailed(
                    ExitCode.BAD_INPUT,
                    f"stdin ended before an answer to {prompt!r}: answer every question, "
                    "or give flags with --non-interactive",
                ) from None

    def text(self, flag: str, given: str | None, prompt: str, default: str | None = None) -> str:
        if given is not None:
            return given
        if self.interactive:
            return str(self.prompt(prompt, default=default)).strip()
        if default is None:
            raise CommandFailed(ExitCode.BAD_INPUT, f"{flag} is required with --non-interactive")
        return default

    def optional(self, given: str | None, prompt: str) -> str | None:
        """An optional answer: empty means none."""
        if given is not None:
            return given or None
        if not self.interactive:
            return None
        answer = str(self.prompt(f"{prompt} (empty: none)", default="")).strip()
        return answer or None

    def choice(self, flag: str, given: str | None, prompt: str, options: tuple[str, ...]) -> str:
        while True:
            answer = self.text(flag, given, f"{prompt} [{'/'.join(options)}]", options[0])
            answer = answer.upper()
            if answer in options:
                return answer
            if not self.interactive or given is not None:
                raise CommandFailed(
                    ExitCode.BAD_INPUT, f"{flag} must be one of {', '.join(options)}"
                )
            _say(f"choose one of {', '.join(options)}")

    def reference(self, flag: str, given: str | None, prompt: str) -> str | None:
        """A secret by reference; an inline secret is refused (re-asked when prompting)."""
        from triage_proxy.config.secrets import secret_reference

        while True:
            answer = self.optional(given, prompt)
            if answer is None or secret_reference(answer) is not None:
                return answer
            message = (
                f'{flag} must reference the password ("env:VAR" or "secret:NAME"), '
                "never hold it: the config file would then contain it"
            )
            if not self.interactive or given is not None:
                raise CommandFailed(ExitCode.BAD_INPUT, message)
            _say(message)

    def number(
        self, flag: str, given: int | None, prompt: str, why: CommandFailed | None = None
    ) -> int:
        if given is not None:
            return given
        if not self.interactive:
            raise why or CommandFailed(
                ExitCode.UNAVAILABLE,
                f"the broker cannot be asked: give {flag} with --non-interactive",
            )
        return int(self.prompt(prompt, type=int))


def discover_partitions(kafka: dict[str, Any], timeout_s: float = DISCOVERY_TIMEOUT_S) -> int:
    """How many partitions the broker reports for the topic.

    Raises UnavailableError when the broker does not answer within `timeout_s` (or a
    referenced password cannot be resolved here), and ConfigError("kafka.topic") when
    the broker answers but has no such topic. Lists all topics instead of asking for one,
    so a broker with auto-creation does not create the topic as a side effect.
    """
    from confluent_kafka.admin import AdminClient

    from triage_proxy.config.secrets import Secrets
    from triage_proxy.config.sections import KafkaSettings
    from triage_proxy.errors import ConfigError, UnavailableError
    from triage_proxy.kafka.errors import kafka_errors
    from triage_proxy.store.aws import read_secret

    settings = KafkaSettings(**{"secrets": Secrets(fetch=read_secret), **kafka})
    try:
        config = settings.librdkafka_config()
    except ConfigError as exc:
        raise UnavailableError(f"cannot connect to the broker: {exc}") from None
    config["log_level"] = 0  # the failure is reported once, below, not as librdkafka noise
    config["socket.timeout.ms"] = int(timeout_s * 1000)
    answer = f"broker {settings.bootstrap_servers} did not answer in {timeout_s:g}s"
    with kafka_errors(answer, UnavailableError):
        metadata = AdminClient(config).list_topics(timeout=timeout_s)
    topic = metadata.topics.get(settings.topic)
    if topic is None or topic.error is not None:
        raise ConfigError("kafka.topic", f"topic {settings.topic!r} does not exist on the broker")
    return len(topic.partitions)


def _notify_key(target: str) -> str:
    if target.startswith("arn:"):
        return "notify_sns_topic_arn"
    if target.startswith(("http://", "https://")):
        return "notify_webhook_url"
    raise CommandFailed(
        ExitCode.BAD_INPUT, "--notify must be an SNS topic ARN (arn:...) or an http(s) URL"
    )


def render_config(raw: dict[str, Any]) -> str:
    """The TOML text of `raw`, validated first with the proxy's own loader."""
    import tomli_w

    from triage_proxy.config.loader import settings_from_dict
    from triage_proxy.store.aws import read_secret

    settings_from_dict(raw, {}, fetch_secret=read_secret)  # tokens inline: no environment
    header = (
        "# Written by `triage init`. Holds a consumer token: keep this file mode 0600.\n"
        "# Check it with `triage config check --config FILE`.\n\n"
    )
    return header + tomli_w.dumps(raw)


def write_private(path: Path, text: str, *, force: bool) -> Path | None:
    """Write `text` to `path` atomically with mode 0600; return the backup path if any.

    The new file is created 0600 by os.open (never chmod-ed after) next to the target,
    then renamed over it, so readers see the old file or the new one, never half of one.
    An existing file is refused unless `force`, which first copies it to FILE.bak (0600).
    """
    from triage_proxy.errors import ConfigError

    backup: Path | None = None
    if path.exists():
        if not force:
            raise _exists(path)
        backup = path.with_name(path.name + ".bak")
        _create_0600(backup, path.read_bytes(), replace=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        _create_0600(tmp, text.encode(), replace=False)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise ConfigError("--config", f"cannot write {path}: {exc}") from None
    return backup


def _exists(path: Path) -> CommandFailed:
    return CommandFailed(
        ExitCode.CONFLICT,
        f"{path} already exists; not overwriting it (use --force, which keeps "
        f"{path.name}.bak, or --config for another file)",
    )


def _create_0600(path: Path, data: bytes, *, replace: bool) -> None:
    if replace:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # an old .bak may have looser permissions: never reuse it
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def init(
    config: Annotated[
        Path, typer.Option("--config", "-c", help="Config file to write.")
    ] = DEFAULT_CONFIG,
    bootstrap_servers: Annotated[
        str | None, typer.Option(help="Kafka bootstrap servers, host:port[,host:port].")
    ] = None,
    security_protocol: Annotated[
        str | None, typer.Option(help="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL.")
    ] = None,
    sasl_mechanism: Annotated[
        str | None, typer.Option(help="PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER.")
    ] = None,
    sasl_username: Annotated[str | None, typer.Option(help="SASL user name.")] = None,
    sasl_password: Annotated[
        str | None,
        typer.Option(help='SASL password BY REFERENCE: "env:VAR" or "secret:NAME".'),
    ] = None,
    topic: Annotated[str | None, typer.Option(help="Topic to proxy.")] = None,
    group_id: Annotated[
        str | None, typer.Option(help="Consumer group (default: triage-TOPIC).")
    ] = None,
    table: Annotated[
        str | None, typer.Option(help="Dead-letter table (default: triage-TOPIC-dead-letters).")
    ] = None,
    overflow_bucket: Annotated[
        str | None, typer.Option(help="S3 bucket for oversized dead letters ('' for none).")
    ] = None,
    notify: Annotated[
        str | None,
        typer.Option(help="Dead-letter notifications: an SNS topic ARN or a webhook URL."),
    ] = None,
    push: Annotated[
        str | None,
        typer.Option(
            "--push",
            metavar="URL",
            help=plain(
                "Also deliver the records to this http(s) URL: a [[push]] table named "
                "after --app-name (no client library needed)."
            ),
        ),
    ] = None,
    push_batch: Annotated[
        int,
        typer.Option(min=1, help="Records per request to the --push URL (1: one per POST)."),
    ] = 1,
    region: Annotated[str | None, typer.Option(help="AWS region.")] = None,
    endpoint_url: Annotated[
        str | None, typer.Option(help="AWS endpoint override (a local moto server).")
    ] = None,
    partitions: Annotated[
        int | None,
        typer.Option(min=1, help="Partition count, when the broker cannot be asked."),
    ] = None,
    app_name: Annotated[
        str, typer.Option(help="Name of the generated token (one per consumer app).")
    ] = DEFAULT_APP_NAME,
    port: Annotated[
        int | None, typer.Option(help="Base gRPC port: partition p listens on PORT + p.")
    ] = None,
    http_port: Annotated[
        int | None, typer.Option(help="Base metrics/health port: partition p on PORT + p.")
    ] = None,
    aws_proxies: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=5000,
            help="Fleet tasks for `deploy --target aws` (default: min(partitions, 2)).",
        ),
    ] = None,
    non_interactive: Annotated[
        bool, typer.Option("--non-interactive", help="Never prompt; take flags and defaults.")
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing file (kept as FILE.bak).")
    ] = False,
) -> None:
    """Write a validated triage.toml (mode 0600) with a fresh token; never overwrites."""
    from triage_cli.push import http_table
    from triage_proxy.config.sections import (
        DEFAULT_HTTP_PORT,
        DEFAULT_PORT,
        DEFAULT_REGION,
        SASL_MECHANISMS,
        SECURITY_PROTOCOLS,
        AwsSettings,
    )
    from triage_proxy.config.validation import topic_problem

    with exit_on_errors():
        if config.exists() and not force:
            raise _exists(config)  # before any question, not after all of them
        # Flags that need no answer are checked before any question too.
        token_name = app_name.strip()
        if not token_name or not token_name.replace("-", "").replace("_", "").isalnum():
            raise CommandFailed(ExitCode.BAD_INPUT, "--app-name must be letters, digits, - or _")
        if push is None and push_batch != 1:
            raise CommandFailed(ExitCode.BAD_INPUT, "--push-batch needs --push URL")
        push_table = None if push is None else http_table(token_name, push, push_batch)
        ask = _Asker(interactive=not non_interactive)
        kafka: dict[str, Any] = {
            "bootstrap_servers": ask.text(
                "--bootstrap-servers", bootstrap_servers, "Kafka bootstrap servers"
            ),
        }
        protocol = ask.choice(
            "--security-protocol", security_protocol, "Security protocol", SECURITY_PROTOCOLS
        )
        kafka["security_protocol"] = protocol
        if protocol.startswith("SASL"):
            kafka["sasl_mechanism"] = ask.choice(
                "--sasl-mechanism", sasl_mechanism, "SASL mechanism", SASL_MECHANISMS
            )
            kafka["sasl_username"] = ask.text("--sasl-username", sasl_username, "SASL user name")
            password = ask.reference(
                "--sasl-password",
                sasl_password,
                'SASL password reference ("env:VAR"/"secret:NAME")',
            )
            if password is not None:
                kafka["sasl_password"] = password
        elif sasl_mechanism or sasl_username or sasl_password:
            raise CommandFailed(
                ExitCode.BAD_INPUT, "SASL options need a SASL_* --security-protocol"
            )
        kafka["topic"] = ask.text("--topic", topic, "Topic")
        problem = topic_problem(kafka["topic"])
        if problem is not None:
            raise CommandFailed(ExitCode.BAD_INPUT, f"--topic: {problem}")
        kafka["group_id"] = ask.text(
            "--group-id", group_id, "Consumer group", f"triage-{kafka['topic']}"
        )
        dead_letters: dict[str, Any] = {
            "table": ask.text(
                "--table", table, "Dead-letter table", f"triage-{kafka['topic']}-dead-letters"
            ),
        }
        bucket = ask.optional(overflow_bucket, "S3 overflow bucket for large dead letters")
        if bucket:
            dead_letters["overflow_bucket"] = bucket
        target = ask.optional(notify, "Notify on dead letters: SNS topic ARN or webhook URL")
        if target:
            dead_letters[_notify_key(target)] = target
        dead_letters["region"] = ask.text("--region", region, "AWS region", DEFAULT_REGION)
        endpoint = ask.optional(endpoint_url, "AWS endpoint override (local moto server)")
        if endpoint:
            dead_letters["endpoint_url"] = endpoint

        kafka["partitions"], reachable = _partitions(kafka, partitions, ask)
        raw: dict[str, Any] = {
            "kafka": kafka,
            "server": {
                "host": "127.0.0.1",
                "port": DEFAULT_PORT if port is None else port,
                "http_port": DEFAULT_HTTP_PORT if http_port is None else http_port,
            },
            "auth": {"tokens": {token_name: secrets.token_urlsafe(TOKEN_BYTES)}},
            "dead_letters": dead_letters,
            # deploy --target aws runs this many fleet tasks (one formula: fleet_size)
            "aws": {"proxies": AwsSettings(proxies=aws_proxies).fleet_size(kafka["partitions"])},
        }
        if push_table is not None:
            raw["push"] = [push_table]
        backup = write_private(config, render_config(raw), force=force)
        if reachable:
            warn_group_in_use(config)
    _print_next(config, raw, token_name, backup)


def warn_group_in_use(config: Path) -> None:
    """Warn on stderr when the config's consumer group is in use on the broker already
    (live members, or committed offsets on the topic): two deployments with one group id
    and two dead-letter tables are fenced only by the group (kafka/groups.py)."""
    from triage_proxy.config.loader import load_settings
    from triage_proxy.kafka.groups import group_in_use
    from triage_proxy.store.aws import read_secret

    settings = load_settings(config, fetch_secret=read_secret)
    problem = group_in_use(settings.kafka)
    if problem is not None:
        typer.secho(f"warning: {problem}", err=True, fg=typer.colors.YELLOW)


def _partitions(kafka: dict[str, Any], given: int | None, ask: _Asker) -> tuple[int, bool]:
    """The broker's answer when it gives one; else the flag or a prompt. And whether the
    broker answered with the topic (so its consumer group can be asked about too)."""
    from triage_proxy.errors import ConfigError, UnavailableError

    try:
        found = discover_partitions(kafka)
    except UnavailableError as exc:
        _say(f"warning: cannot discover the partition count: {exc}")
        return ask.number("--partitions", given, "Number of partitions of the topic"), False
    except ConfigError as exc:  # the broker answered: it has no such topic
        _say(f"warning: {exc.problem}; the proxies will not start until it exists")
        missing = CommandFailed(
            ExitCode.NOT_FOUND,
            f"{exc.problem} ({kafka['bootstrap_servers']}): create it first, or give "
            "--partitions N with --non-interactive",
        )
        asked = ask.number("--partitions", given, "Number of partitions of the topic", missing)
        return asked, False
    if given is not None and given != found:
        raise CommandFailed(
            ExitCode.BAD_INPUT,
            f"--partitions {given} disagrees with the broker, which reports {found} for "
            f"{kafka['topic']!r} (every partition needs its proxy)",
        )
    _say(f"topic {kafka['topic']!r} has {found} partition(s)")
    return found, True


def _print_next(config: Path, raw: dict[str, Any], token_name: str, backup: Path | None) -> None:
    """What to do next; the token itself stays in the file (not in scrollback)."""
    port = raw["server"]["port"]
    if backup is not None:
        _say(f"kept the previous file as {backup}")
    typer.echo(
        f"Wrote {config} (mode 0600).\n"
        f"The consumer token is [auth.tokens] {token_name} in {config}.\n\n"
        "Next:\n"
        f"  triage config check --config {config}   # the file, as the proxies will read it\n"
        f"  triage deploy --target local --config {config}   # creates the table; or --target aws\n"
        f"  triage status --config {config}\n\n"
        f"{_push_next(config, raw)}"
        f"A consumer (pip install ./proto ./client_lib; export TRIAGE_TOKEN from [auth.tokens]):\n"
        "  import os\n"
        "  from triage_client import Consumer\n"
        "  async def handle(message):  # return = ack, raise = nack\n"
        "      ...\n"
        f'  Consumer("127.0.0.1:{port}", os.environ["TRIAGE_TOKEN"], handle).run()\n'
        f"Any proxy's address will do (deploy starts them on ports {port}, {port} + 1, ...): "
        "the Consumer finds the process serving each partition (Topology) and consumes them all."
    )


def _push_next(config: Path, raw: dict[str, Any]) -> str:
    """Where the records go when the file has a push target (empty when it has none)."""
    lines = []
    for table in raw.get("push", []):
        batch = table.get("batch", 1)
        shape = "one record per POST" if batch == 1 else f"up to {batch} records per POST"
        lines.append(
            f"The proxies POST the records to {table['url']}\n"
            f"({shape}, CloudEvents; push target {table['name']!r} in [[push]]):\n"
            f"  triage status --config {config}   # its limit, latency, responses, errors\n"
        )
    return "".join(line + "\n" for line in lines)


# --- triage config check ------------------------------------------------------------------

config_app = typer.Typer(
    name="config",
    help="Check a config file.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@config_app.command("check")
def check(
    config: Annotated[
        Path, typer.Option("--config", "-c", help="Config file to check.")
    ] = DEFAULT_CONFIG,
    connect: Annotated[
        bool, typer.Option("--connect", help="Also reach the broker and the dead-letter table.")
    ] = False,
) -> None:
    """Validate a config and what it points at (TLS files, addresses, secret references,
    librdkafka properties) as the proxy will at start; on error name the key and exit 2."""
    from triage_proxy.config.checks import file_warnings
    from triage_proxy.config.loader import load_settings
    from triage_proxy.deadletters.writer import overflow_warning
    from triage_proxy.preflight import preflight
    from triage_proxy.store.aws import read_secret

    with exit_on_errors():
        settings = load_settings(config, fetch_secret=read_secret)
        preflight(settings, network=connect)  # what the proxy would refuse at start
        typer.echo(f"OK {config}")
        for label, value in summary(settings):
            typer.echo(f"  {label:<14} {value}")
        warnings = [overflow_warning(settings.dead_letters), *file_warnings(config)]
        for warning in warnings:
            if warning is not None:
                typer.echo(f"warning: {warning}", err=True)
        if connect:
            _check_connect(settings)


def summary(settings: Settings) -> list[tuple[str, str]]:
    """What an operator wants to see at a glance: never a token, only token names."""
    kafka, dlq, server = settings.kafka, settings.dead_letters, settings.server
    partitions = "ask the broker at deploy" if kafka.partitions is None else str(kafka.partitions)
    revoked = f" (revoked: {', '.join(settings.auth.revoked)})" if settings.auth.revoked else ""
    http_at = server.http_address(0)
    http = "off" if http_at is None else f"{server.http_host}:{server.http_port} + p"
    return [
        ("broker", f"{kafka.bootstrap_servers} ({kafka.security_protocol})"),
        ("topic", kafka.topic),
        ("partitions", partitions),
        ("group", kafka.group_id),
        (
            "table",
            f"{dlq.table} ({dlq.region}{', ' + dlq.endpoint_url if dlq.endpoint_url else ''})",
        ),
        ("bucket", dlq.overflow_bucket or "none"),
        ("gRPC", f"{server.host}:{server.port} + p"),
        ("http", http),
        (
            "TLS",
            "on" + (" (client certificates)" if settings.tls.client_ca_file else "")
            if settings.tls.enabled
            else "off",
        ),
        ("tokens", ", ".join(sorted(settings.auth.active())) + revoked),
        *[("push", _push_summary(target)) for target in settings.push],
    ]


def _push_summary(target: PushTargetSettings) -> str:
    if target.mode == "grpc":
        return f"{target.name}: gRPC consumers register (GET /consumers on the HTTP port)"
    return f"{target.name}: {target.url} (batch {target.batch})"


def _check_connect(settings: Settings) -> None:
    """Reach the broker (topic and partition count) and the dead-letter table."""
    import dataclasses

    from triage_proxy.errors import ConfigError
    from triage_proxy.store.query import DeadLetterTable

    kafka = {f.name: getattr(settings.kafka, f.name) for f in dataclasses.fields(settings.kafka)}
    try:
        found = discover_partitions(kafka)
    except ConfigError as exc:
        raise CommandFailed(ExitCode.NOT_FOUND, str(exc)) from None
    if settings.kafka.partitions is not None and found != settings.kafka.partitions:
        raise CommandFailed(
            ExitCode.BAD_INPUT,
            f"config key 'kafka.partitions': {settings.kafka.partitions} but the broker "
            f"reports {found} for {settings.kafka.topic!r}",
        )
    typer.echo(f"  broker         reachable, {settings.kafka.topic!r} has {found} partition(s)")
    from triage_proxy.kafka.groups import group_in_use

    problem = group_in_use(settings.kafka)
    if problem is not None:
        typer.secho(f"warning: {problem}", err=True, fg=typer.colors.YELLOW)
    table = DeadLetterTable(settings.dead_letters, group=settings.kafka.group_id)
    try:
        table.check()  # a missing table: NotFoundError, exit 4
    finally:
        table.close()
    typer.echo(f"  table          reachable ({settings.dead_letters.table})")
