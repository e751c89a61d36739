"""The `triage` command.

Heavy modules (confluent-kafka, boto3, grpc) are imported inside the commands
that need them so `triage --help` stays instant. SIGINT and SIGTERM take the
same graceful path everywhere.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from triage_cli.console.command import console
from triage_cli.deploy import deploy, destroy, supervise
from triage_cli.dlq.command import dlq_app
from triage_cli.exitcodes import CommandFailed, ExitCode, exit_on_errors
from triage_cli.helptext import reflow_help
from triage_cli.init import config_app, init
from triage_cli.produce import produce
from triage_cli.status.command import status

app = typer.Typer(
    name="triage",
    help="Triage: a Kafka consumer proxy that removes head-of-line blocking.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    quiet_noisy_loggers()


NOISY_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3")
"""At DEBUG these log whole request and response bodies: dead-letter payloads, and the
secrets Secrets Manager returns. Never below INFO, even with --verbose."""


def quiet_noisy_loggers() -> None:
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)


@app.command()
def proxy(
    config: Annotated[Path, typer.Option("--config", "-c", help="TOML config file.")],
    partition: Annotated[
        list[int] | None,
        typer.Option(
            "--partition",
            "-p",
            help="Partition to serve (repeatable). None: join the topic's fleet, and serve "
            "what the consumer group assigns.",
        ),
    ] = None,
    slot: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Listen on server.port + SLOT and server.http_port + SLOT (default: the "
            "partition with one --partition, else 0). One per process on a host.",
        ),
    ] = None,
    port: Annotated[
        int | None, typer.Option(help="Listen on this port instead of server.port + slot.")
    ] = None,
    advertised_host: Annotated[
        str | None,
        typer.Option(
            envvar="TRIAGE_ADVERTISED_HOST",
            help="Host consumers are given for this proxy, instead of server.advertised_host "
            "(set by the AWS stack: the load balancer's name).",
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run one proxy process until SIGTERM/SIGINT (then drain and commit).

    With --partition (repeatable) it serves those partitions; without, it joins the
    topic's fleet: the deployment's consumer group assigns it partitions, and it serves
    each one once it holds that partition's lease.

    SIGHUP re-reads the [auth] section of the config: revoked tokens are refused from
    then on and their open streams end; a bad file keeps the current tokens."""
    import asyncio
    import dataclasses
    import os
    import signal

    from triage_cli.signals import on_stop_signals
    from triage_proxy.app import Proxy
    from triage_proxy.config.checks import file_warnings
    from triage_proxy.config.ecs import resolve_advertised_host
    from triage_proxy.config.loader import load_settings
    from triage_proxy.gctuning import freeze_when_ready, set_collection_policy
    from triage_proxy.preflight import preflight
    from triage_proxy.store.aws import read_secret

    _setup_logging(verbose)
    with exit_on_errors():
        pins = sorted(set(partition)) if partition else None
        if pins is not None and pins[0] < 0:
            raise CommandFailed(ExitCode.BAD_INPUT, "--partition must be >= 0")
        offset = slot if slot is not None else (pins[0] if pins else 0)
        settings = load_settings(config, fetch_secret=read_secret)
        if port is not None:
            server = dataclasses.replace(settings.server, port=port - offset if port else 0)
            settings = dataclasses.replace(settings, server=server)
        if advertised_host:
            server = dataclasses.replace(settings.server, advertised_host=advertised_host)
            settings = dataclasses.replace(settings, server=server)
        # "ecs-task-dns"/"ecs-task-ip": this ECS task's own address, asked once here
        server = resolve_advertised_host(settings.server, os.environ)
        settings = dataclasses.replace(settings, server=server)
        # What the proxy would refuse later (a bad TLS file, an address this machine does
        # not have, an unresolvable secret, a property librdkafka refuses): exit 2 now,
        # before a port is bound or a lease taken (the supervisor then gives up, no restarts).
        preflight(settings, network=True, slot=offset)
        for warning in file_warnings(config):
            logging.getLogger("triage_proxy").warning("%s", warning)

        async def main() -> None:
            runner = Proxy(
                settings,
                pins,
                slot=slot,
                auth_source=lambda: load_settings(config, fetch_secret=read_secret).auth,
            )
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGHUP, runner.reload_auth)
            frozen = loop.create_task(freeze_when_ready(runner.ready))
            with on_stop_signals(runner.stop, loop):
                await runner.serve()
            frozen.cancel()

        set_collection_policy()  # gctuning.py: the process's GC policy (this process only)

        asyncio.run(main())  # a TLS file that is missing or not PEM: ConfigError, exit 2


@app.command()
def dev(
    topic: Annotated[str, typer.Option(help="Topic to create and proxy.")] = "triage-dev",
    partitions: Annotated[int, typer.Option(min=1, max=64)] = 1,
    json_: Annotated[
        bool, typer.Option("--json", help="Print one JSON line with the endpoints.")
    ] = False,
    demo: Annotated[
        bool, typer.Option("--demo", help="Run the head-of-line blocking demo, then exit.")
    ] = False,
    messages: Annotated[int, typer.Option(help="Demo: messages to produce.", min=10)] = 2000,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where config and logs go (default: a temp folder, removed after a clean "
            "stop and kept after a failure, for its logs)."
        ),
    ] = None,
    keep_state: Annotated[
        bool, typer.Option("--keep-state", help="Keep the temp folder (logs, config) at exit.")
    ] = False,
    push: Annotated[
        list[str] | None,
        typer.Option(
            "--push",
            metavar="URL",
            help="Deliver the topic's records to this http(s) URL (CloudEvents; repeatable: "
            'push targets "dev", "dev-2", ...).',
        ),
    ] = None,
    push_batch: Annotated[
        int,
        typer.Option(
            min=1, help="Records per request to each --push URL (1: one record per POST)."
        ),
    ] = 1,
    push_registration: Annotated[
        bool,
        typer.Option(
            "--push-registration",
            help='Let the original Triage\'s gRPC consumers register (push target "dev-grpc", '
            "GET /consumers on each proxy's HTTP port).",
        ),
    ] = False,
    console: Annotated[
        bool,
        typer.Option("--console", help="Also serve the web console (prints its login URL)."),
    ] = False,
    console_port: Annotated[
        int, typer.Option(help="Port of --console (0: any free port).", min=0, max=65535)
    ] = 9800,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Start a broker, a DynamoDB endpoint and one proxy per partition on this machine;
    with --push, the proxies deliver to a URL themselves (no client needed)."""
    from triage_cli.devstack import DevStack
    from triage_cli.embedded import missing_local_extra
    from triage_cli.push import http_table, registration_table

    _setup_logging(verbose)
    if not verbose:
        logging.getLogger().setLevel(logging.WARNING)
    with exit_on_errors():
        # Checked before anything starts: a bad --push is a one-line exit 2, not a proxy
        # that dies at start with the reason in its log.
        tables = [
            http_table("dev" if i == 0 else f"dev-{i + 1}", url, push_batch)
            for i, url in enumerate(push or [])
        ]
        if push_batch != 1 and not push:
            raise CommandFailed(ExitCode.BAD_INPUT, "--push-batch needs --push URL")
        if push_registration:
            tables.append(registration_table("dev-grpc"))
        missing = missing_local_extra("triage dev")
        if missing is not None:
            raise CommandFailed(ExitCode.BAD_INPUT, missing)
        stack = DevStack(
            topic=topic,
            partitions=partitions,
            state_dir=state_dir,
            proxy_overrides={"push": tables} if tables else None,
            keep_state=keep_state,
        )
    with exit_on_errors(), stack:
        if demo:
            from triage_cli.demo import run_demo

            run_demo(stack, messages=messages)
            return
        if console:
            stack.start_console(console_port)
        if json_:
            print(stack.describe_json(), flush=True)
        else:
            stack.print_endpoints()
        stack.wait_for_signal()


app.add_typer(dlq_app, name="dlq")
app.command()(init)
app.add_typer(config_app, name="config")
app.command()(deploy)
app.command()(destroy)
app.command(hidden=True)(supervise)
app.command()(status)
app.command()(produce)
app.command()(console)


reflow_help(app)


def run() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    run()
