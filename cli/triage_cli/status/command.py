"""The `triage status` command: load the config, read the sources once (or every
`--interval` with `--watch`), print the tables or `--json`, and exit by what was down."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from triage_cli.exitcodes import CommandFailed, ExitCode, exit_on_errors
from triage_cli.status.render import not_deployed_note, render_report
from triage_cli.status.sources import Sources, gather

DeploymentDirOption = Annotated[
    Path | None,
    typer.Option(
        help="local: the deployment's project folder, as given to deploy (default: "
        ".triage/ by the config): its record names the processes that should run."
    ),
]
"""`--state-dir` of the commands that read a local deployment's record (status, console)."""
DEFAULT_WATCH_INTERVAL_S = 2.0


def status(
    config: Annotated[Path, typer.Option("--config", "-c", help="The proxies' TOML config file.")],
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[
        float, typer.Option(help="Seconds between refreshes with --watch.", min=0.2)
    ] = DEFAULT_WATCH_INTERVAL_S,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
    host: Annotated[
        str | None, typer.Option(help="Ask the proxies on this host instead of server.http_host.")
    ] = None,
    target: Annotated[
        str,
        typer.Option(
            help="local: the proxies at server.http_port + k; aws: each running ECS task of "
            "the deployment at server.http_port (run inside the VPC)."
        ),
    ] = "local",
    state_dir: DeploymentDirOption = None,
) -> None:
    """Per partition: committed offset, log end, lag, in-flight, instances, dead letters;
    then each push target: limit, in-flight, latency, responses, errors and state."""
    from rich.console import Console

    from triage_proxy.config.loader import load_settings
    from triage_proxy.store.aws import read_secret

    with exit_on_errors():
        if watch and json_:
            raise CommandFailed(ExitCode.BAD_INPUT, "--watch and --json do not go together")
        if target not in ("local", "aws"):
            raise CommandFailed(ExitCode.BAD_INPUT, "--target must be local or aws")
        settings = load_settings(config, fetch_secret=read_secret)
        hosts = None
        if target == "aws":
            from triage_cli.aws import fleet_hosts

            hosts = fleet_hosts(config)
        sources = Sources(settings, host, hosts, state_dir)
        sources.config = str(config)
        console = Console(highlight=False)
        try:
            if watch:
                _watch(sources, console, interval)
                return
            report = gather(sources)
        finally:
            sources.close()
        if json_:
            print(json.dumps(report.to_json(), indent=2))
            if not report.deployed:
                typer.echo(not_deployed_note(report), err=True)
            if report.legacy_partitions:
                from triage_proxy.store.migrate import legacy_warning

                typer.echo(
                    "warning: "
                    + legacy_warning(report.topic, report.legacy_partitions, str(config)),
                    err=True,
                )
        else:
            console.print(render_report(report))
        code = report.exit_code
        if code is ExitCode.NOT_FOUND:
            raise CommandFailed(code, str(report.dead_letters_error))
        if code is not ExitCode.OK:
            raise typer.Exit(int(code))


def _watch(sources: Sources, console: Any, interval: float) -> None:
    """Redraw the table every `interval` until Ctrl-C or SIGTERM (exit 0)."""
    from rich.live import Live
    from rich.text import Text

    from triage_proxy.errors import UnavailableError

    def frame() -> Any:
        try:
            return render_report(gather(sources))
        except UnavailableError as exc:
            return Text(f"{exc} (retrying every {interval:g} s)", style="red")

    with (
        contextlib.suppress(KeyboardInterrupt),  # Ctrl-C or SIGTERM (see exit_on_errors)
        Live(frame(), console=console, auto_refresh=False) as live,
    ):
        # On stderr once the first table is drawn, so a script (or a test) knows a
        # signal from now on ends it with 0 and leaves that table on a non-terminal.
        print(f"watching every {interval:g} s; Ctrl-C stops", file=sys.stderr, flush=True)
        while True:
            time.sleep(interval)
            live.update(frame(), refresh=True)
